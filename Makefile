# Two entry points, both safe on a fresh machine: they build .venv when needed.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench lock clean

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/spmdkit demo

test: $(STAMP)
	$(BIN)/pytest -q

bench: $(STAMP)
	$(BIN)/spmdkit bench --all --json bench/ --markdown bench/

# Re-pin constraints.txt to what the current .venv holds (after a tested upgrade).
lock: $(STAMP)
	$(BIN)/pip freeze --exclude-editable | grep -v '^-e' > constraints.txt

clean:
	rm -rf $(VENV)
