# Two entry points, both safe on a fresh machine: they build their environment when needed.
#   default environment: the newest tested Python >= 3.12 found here, current JAX (constraints.txt), in .venv
#   oldest supported:    Python 3.11 + jax 0.10.2 (constraints-oldest.txt), in .venv-oldest
PY ?= $(shell ./tools/find-python)
PY_OLDEST ?= $(shell ./tools/find-python 3.11)
VENV := .venv
VENV_OLDEST := .venv-oldest
# The stamp names the interpreter's version, so a machine that gains a newer Python rebuilds.
PYVER := $(shell $(PY) -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null)
STAMP := $(VENV)/.installed-$(PYVER)
STAMP_OLDEST := $(VENV_OLDEST)/.installed
# The oldest environment runs the modules that call JAX, Flax and Orbax the most directly: pmap on
# shard_map, devices, meshes, rules and the sharded layout (Flax's partitioning), every strategy's
# init/step/evaluate (test_strategies, test_step, test_step_fit, test_train), the compile cache,
# the data formats, the planner's memory counts (fitted per jax release: test_plan_memory, under
# a minute), and the docstring examples. The strategies' numerics at many device counts
# (test_data_parallel, test_ensemble, test_grad_accum: 11 of its 21 minutes) and the
# subprocess-heavy modules run in the default environment only.
OLDEST_TESTS := tests/test_pmap.py tests/test_pmap_nested.py tests/test_pmap_api.py tests/test_pmap_conformance.py \
	tests/test_devices.py tests/test_mesh.py tests/test_rules.py tests/test_config.py tests/test_tasks.py \
	tests/test_sharded.py tests/test_train.py tests/test_cache.py tests/test_step.py tests/test_strategies.py \
	tests/test_step_fit.py tests/test_data.py tests/test_data_format.py tests/test_plan_memory.py src/spmdkit

.PHONY: demo env env-oldest test test-oldest bench lock lock-oldest clean

$(STAMP): pyproject.toml constraints.txt
	@test -n "$(PYVER)" || { ./tools/find-python; exit 1; }
	@echo "spmdkit: building $(VENV) with $(PY) (Python $(PYVER))"
	rm -rf $(VENV)
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -c constraints.txt -e '.[test,grain]'
	touch $(STAMP)

$(STAMP_OLDEST): pyproject.toml constraints-oldest.txt
	@test -n "$(PY_OLDEST)" || { ./tools/find-python 3.11; exit 1; }
	@echo "spmdkit: building $(VENV_OLDEST) with $(PY_OLDEST) (the oldest supported Python and JAX)"
	rm -rf $(VENV_OLDEST)
	$(PY_OLDEST) -m venv $(VENV_OLDEST)
	$(VENV_OLDEST)/bin/pip install --quiet --upgrade pip
	$(VENV_OLDEST)/bin/pip install --quiet -c constraints-oldest.txt -e '.[test]'
	touch $(STAMP_OLDEST)

# The environments alone (CI builds both before it runs their tests side by side).
env: $(STAMP)
env-oldest: $(STAMP_OLDEST)

demo: $(STAMP)
	@echo "spmdkit: Python $(PYVER) in $(VENV)"
	$(VENV)/bin/spmdkit demo

# Two pytest workers (pytest-xdist): most of the suite's wall time is spent waiting for processes
# it started (JAX start-ups, two-process runs, timeouts), which the other worker fills.
test: $(STAMP)
	@echo "spmdkit: Python $(PYVER) in $(VENV)"
	$(VENV)/bin/pytest -q -n 2 --dist loadgroup

test-oldest: $(STAMP_OLDEST)
	$(VENV_OLDEST)/bin/pytest -q $(OLDEST_TESTS)

bench: $(STAMP)
	$(VENV)/bin/spmdkit bench --all --json bench/ --markdown bench/

# Re-pin a constraints file to what its environment holds (after a tested upgrade).
lock: $(STAMP)
	$(VENV)/bin/pip freeze --exclude-editable | grep -v '^-e' > constraints.txt

lock-oldest: $(STAMP_OLDEST)
	$(VENV_OLDEST)/bin/pip freeze --exclude-editable | grep -v '^-e' > constraints-oldest.txt

clean:
	rm -rf $(VENV) $(VENV_OLDEST)
