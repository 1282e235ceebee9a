"""Ensemble: members equal lone runs, placement, averaged probabilities, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmdkit
from spmdkit._strategies._base import to_host
from spmdkit._strategies.ensemble import placement
from spmdkit._tasks import digits, linreg
from spmdkit._train import iterate_batches
from spmdkit._train._steps import task_state, task_train_step

OPT = optax.sgd(0.05, momentum=0.9)

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def task():
    return digits.make()


def max_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def train_both(task, ensemble: spmdkit.Ensemble, steps: int = 20):
    """The ensemble, and each member trained alone on one device from the same key."""
    init_key, make_state, train_step = jax.random.key(7), task_state(task, OPT), task_train_step(task, OPT)
    state = ensemble.init(make_state, init_key, unbox=True)
    step = ensemble.step(train_step)
    single = spmdkit.Single()
    single_step = single.step(train_step)
    keys = ensemble.member_keys(init_key)
    alone = [single.init(make_state, keys[m], unbox=True) for m in range(ensemble.members)]
    batches = iterate_batches(task.train_data, 32, 0, False)
    for _ in range(steps):
        _, host = next(batches)
        state, _ = step(state, host)
        alone = [single_step(s, host)[0] for s in alone]
    return to_host(state.params), [to_host(s.params) for s in alone]


@pytest.mark.parametrize(
    "members, devices, per_device",
    [(8, 8, 1), (16, 8, 2), (8, 4, 2)],
)
def test_each_member_equals_the_same_member_trained_alone(task, members, devices, per_device):
    ensemble = spmdkit.Ensemble(members=members, devices=jax.devices()[:devices])
    assert ensemble.describe()["device_count"] == devices
    assert ensemble.describe()["members_per_device"] == per_device
    stacked, alone = train_both(task, ensemble)
    members_params = ensemble.member_params(stacked)
    for m in range(members):
        assert max_diff(members_params[m], alone[m]) <= TOLERANCE, m
    # and they are different models (different keys), not one model K times
    assert max_diff(members_params[0], members_params[1]) > 1e-2


@pytest.mark.parametrize("member_loop", ["unroll", "map", "vmap"])
def test_an_adam_step_from_the_same_state_equals_each_members_lone_step(task, member_loop):
    # Adam on 4 vs 8 devices ended ~1e-2 apart after 30 steps (2 members per device, unroll):
    # a 1e-7 rounding difference flipped a ReLU gate, not a placement error. From the same
    # state every member's step, its gradient and Adam's moments agree to rounding.
    opt = optax.adam(1e-2, eps=1e-3)
    ens = spmdkit.Ensemble(members=8, devices=jax.devices()[:4], member_loop=member_loop)
    state = ens.init(task_state(task, opt), jax.random.key(7), unbox=True)
    batches = iterate_batches(task.train_data, 32, 0, False)
    state, _ = ens.step(task_train_step(task, opt))(state, next(batches)[1])  # a state Adam has moments in
    host = next(batches)[1]
    new, aux = ens.step(task_train_step(task, opt))(state, host)
    single_step = spmdkit.Single().step(task_train_step(task, opt))
    members = jax.device_get(state)
    for m in range(8):
        ref, ref_aux = single_step(jax.tree.map(lambda x: x[m], members), host)
        got = jax.tree.map(lambda x: np.asarray(x)[m], jax.device_get(new))
        assert max_diff(got.params, to_host(ref.params)) <= 1e-7, m
        assert max_diff(got.opt_state, jax.device_get(ref.opt_state)) <= 1e-7, m
        assert float(aux["loss"][m]) == pytest.approx(float(ref_aux["loss"]), rel=1e-6)


def test_member_state_is_sharded_over_the_member_axis():
    ens = spmdkit.Ensemble(members=16)
    state = ens.init(lambda k: {"w": jax.random.normal(k, (3,)), "opt": optax.adam(1e-3).init(jnp.ones(3))}, 0)
    w = state["w"]
    assert w.shape == (16, 3) and w.sharding.spec == jax.P("member")
    assert {s.data.shape for s in w.addressable_shards} == {(2, 3)}


def test_ensemble_probability_is_the_mean_of_member_probabilities(task):
    ens = spmdkit.Ensemble(members=8)
    state = ens.init(task_state(task, OPT), jax.random.key(3), unbox=True)
    batch = jax.tree.map(lambda x: x[:20], task.eval_data)
    probs = ens.apply(lambda s, b: task.predictor.predict(s.params, b))(state, batch)  # [K, B, C]
    got = np.mean(np.asarray(probs), axis=0)  # the mean is the caller's line, as fit's eval writes it
    host_params = ens.member_params(to_host(state.params))
    expected = np.mean([np.asarray(task.predictor.predict(p, batch)) for p in host_params], axis=0)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got.sum(-1), 1.0, rtol=1e-5)


def test_short_run_ensemble_beats_mean_member_and_reports_it(task, tmp_path):
    result = spmdkit.fit(task, spmdkit.Ensemble(members=8), optax.sgd(0.05, momentum=0.9),
                         spmdkit.TrainConfig(steps=60, batch_size=64), out_dir=tmp_path, progress=False)
    s = result.summary
    assert len(s["member_accuracy"]) == 8 and s["members"] == 8
    assert s["ensemble_accuracy"] >= s["mean_member_accuracy"]
    assert s["ensemble_gain"] == pytest.approx(s["ensemble_accuracy"] - s["mean_member_accuracy"])
    assert (tmp_path / "ensemble.png").read_bytes().startswith(b"\x89PNG")
    train_rows = [r for r in result.history if r["split"] == "train"]
    assert len(train_rows[0]["member_loss"]) == 8
    assert train_rows[0]["loss"] == pytest.approx(np.mean(train_rows[0]["member_loss"]))


def test_a_later_run_into_an_ensembles_out_removes_its_ensemble_png(task, tmp_path, request):
    # ensemble.png stayed beside any later run's files, read as that run's.
    spmdkit.fit(task, spmdkit.Ensemble(members=2), optax.sgd(0.05), spmdkit.TrainConfig(steps=2, batch_size=64),
                out_dir=tmp_path, progress=False, log=lambda m: None)
    assert (tmp_path / "ensemble.png").is_file()
    stop_fit_at_start = request.getfixturevalue("stop_fit_at_start")  # only now: the first run trains

    with pytest.raises(stop_fit_at_start):  # the later run ends at its start, as a kill would leave it
        spmdkit.fit(task, spmdkit.DataParallel(), optax.sgd(0.05), spmdkit.TrainConfig(steps=2, batch_size=64),
                    out_dir=tmp_path, progress=False, log=lambda m: None)
    assert not (tmp_path / "ensemble.png").exists() and not (tmp_path / "summary.json").exists()


def test_bagging_gives_each_member_its_own_order(task):
    ens = spmdkit.Ensemble(members=4, bagging=True, devices=jax.devices()[:4])
    assert ens.data_streams == 4
    host = jax.tree.map(lambda *xs: np.stack(xs), *(
        next(iterate_batches(task.train_data, 16, 0, False, stream=m))[1] for m in range(4)
    ))
    assert not np.array_equal(host["label"][0], host["label"][1])
    # A step takes [K, b, ...]: member m steps on its own rows (13: any size, nothing padded).
    own = jax.tree.map(lambda x: x[:, :13], host)
    state = ens.init(task_state(task, OPT), jax.random.key(0), unbox=True)
    new, aux = ens.step(task_train_step(task, OPT))(state, own)
    single = spmdkit.Single()
    for m in range(4):
        alone = jax.tree.map(lambda x: x[m], jax.device_get(state))
        ref, ref_aux = single.step(task_train_step(task, OPT))(alone, jax.tree.map(lambda x: x[m], own))
        assert max_diff(ens.member_params(to_host(new.params))[m], to_host(ref.params)) <= TOLERANCE
        assert float(aux["loss"][m]) == pytest.approx(float(ref_aux["loss"]), rel=1e-5)
    result = spmdkit.fit(task, ens, OPT, spmdkit.TrainConfig(steps=30, batch_size=16), progress=False)
    assert result.summary["bagging"] is True and len(result.summary["member_accuracy"]) == 4
    # An ordinary [B, ...] batch was read as 4 rows of one example each, silently.
    flat = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), own)
    with pytest.raises(spmdkit.BatchSizeError, match=r"(?s)has shape \(52,.*bagging=True\) steps on one share "
                                                     r"per member.*x.reshape\(4, -1"):
        ens.step(task_train_step(task, OPT))(state, flat)


def test_ensemble_of_a_task_without_predictor_reports_each_member():
    result = spmdkit.fit(linreg.make(), spmdkit.Ensemble(members=4), optax.sgd(0.005),
                         spmdkit.TrainConfig(steps=300, batch_size=128), progress=False)
    reports = result.summary["member_reports"]
    assert len(reports) == 4 and all(abs(r["w"] - 2) < 0.3 for r in reports)
    assert "ensemble_accuracy" not in result.summary


def test_an_ensemble_with_no_eval_row_writes_its_files_and_exits_cleanly(tmp_path):
    # Train rows carry member_accuracy: with no eval row (no eval data here; a run preempted by SIGTERM
    # before its first eval, as a kill fuzzer found) ensemble.png's plot raised IndexError, exit 1.
    x = np.linspace(-1, 1, 64, dtype=np.float32)

    def loss_fn(p, b, rng):
        err = p["w"] * b["x"] + p["b"] - b["y"]
        return jnp.mean(err ** 2), {"accuracy": jnp.mean(jnp.abs(err) < 0.1)}

    task = spmdkit.Task(name="line", init=lambda rng: {"w": jnp.zeros(()), "b": jnp.zeros(())}, loss_fn=loss_fn,
                        train_data={"x": x, "y": 3 * x + 1})
    result = spmdkit.fit(task, spmdkit.Ensemble(4), optax.sgd(0.1), spmdkit.TrainConfig(steps=3, batch_size=16),
                         out_dir=tmp_path, progress=False)
    assert result.summary["status"] == "completed"
    assert {p.name for p in tmp_path.iterdir()} >= {"summary.json", "params.npz", "loss.png", "metrics.jsonl"}
    assert not (tmp_path / "ensemble.png").exists()


@pytest.mark.parametrize("members, devices, used", [(8, 8, 8), (16, 8, 8), (3, 8, 3), (12, 8, 6), (7, 4, 1), (1, 8, 1)])
def test_placement(members, devices, used):
    assert placement(members, devices) == used


@pytest.mark.parametrize("members, idle, near", [(9, 5, "members=8 or 16"), (12, 2, "members=8 or 16"),
                                                 (10, 3, "members=8 or 16")])
def test_members_that_leave_devices_idle_are_named(members, idle, near):
    with pytest.warns(UserWarning, match=f"members={members}.* so {idle} devices stay idle. Use {near} "):
        ens = spmdkit.Ensemble(members=members)
    assert ens.describe()["device_count"] == 8 - idle


@pytest.mark.parametrize("members, devices", [(4, 8), (16, 8), (8, 8), (3, 3)])
def test_members_that_use_every_device_they_can_warn_nothing(members, devices, recwarn):
    spmdkit.Ensemble(members=members, devices=jax.devices()[:devices])
    assert not [w for w in recwarn if "idle" in str(w.message)]


def test_errors():
    with pytest.raises(spmdkit.ConfigError, match="members=0: an ensemble needs"):
        spmdkit.Ensemble(members=0)
    with pytest.raises(spmdkit.ConfigError) as e:
        spmdkit.Ensemble(members=12, mesh=spmdkit.make_mesh(member=8))
    msg = str(e.value)
    assert "members=12 cannot be placed on the 8 devices" in msg and "12 is not a multiple of 8" in msg
    assert "e.g. 8, 16" in msg
    ens = spmdkit.Ensemble(members=8)
    state = spmdkit.Ensemble(members=4).init(lambda k: {"w": jax.numpy.zeros(2)}, 0)
    with pytest.raises(spmdkit.MembersMismatchError) as e:
        ens.place_state(jax.device_get(state))
    assert "holds 4 member(s), but this ensemble has members=8" in str(e.value)
    assert "use members=4 to continue" in str(e.value)
    placed = spmdkit.Ensemble(members=4).place_state(jax.device_get(state))
    assert placed["w"].sharding.spec == jax.P("member")


@pytest.mark.parametrize("loop", ["map", "vmap"])
def test_member_loops_agree_with_unroll(task, loop):
    host = jax.tree.map(lambda x: x[:16], task.train_data)
    results = []
    for how in ("unroll", loop):
        ens = spmdkit.Ensemble(members=4, devices=jax.devices()[:2], member_loop=how)
        state = ens.init(task_state(task, OPT), jax.random.key(0), unbox=True)
        state, metrics = ens.step(task_train_step(task, OPT))(state, host)
        results.append((to_host(state.params), np.asarray(metrics["loss"])))
    assert max_diff(results[0][0], results[1][0]) < 1e-5
    np.testing.assert_allclose(results[0][1], results[1][1], rtol=1e-5)


def test_unknown_member_loop():
    with pytest.raises(spmdkit.ConfigError, match="member_loop='scan' is not known"):
        spmdkit.Ensemble(members=2, member_loop="scan")


def test_ensemble_names_an_empty_device_list_and_keys_already_split():
    # max() of an empty list, and JAX's "split accepts a single key", before.
    with pytest.raises(spmdkit.MeshError, match=r"Ensemble\(devices=\[\]\): a non-empty list of jax.Device"):
        spmdkit.Ensemble(4, devices=[])
    with pytest.raises(spmdkit.SignatureError, match=r"rng has shape \(4,\); it takes one key"):
        spmdkit.Ensemble(4).init(lambda rng: {"w": jax.random.normal(rng, (3,))}, jax.random.split(jax.random.key(0), 4))


def test_a_numpy_member_count_is_a_member_count():
    # members=np.int64(4) (a sweep over np.arange) was "an ensemble needs a whole number of members >= 1".
    ens = spmdkit.Ensemble(np.int64(4))
    assert ens.members == 4 and type(ens.members) is int and ens.describe()["members"] == 4


def _scored_task(score, eval_data):
    x = np.random.default_rng(0).normal(size=(40, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    loss = lambda p, b, r: (optax.softmax_cross_entropy_with_integer_labels(b["x"] @ p["w"], b["y"]).mean(), {})
    predict = lambda p, b: jax.nn.softmax(b["x"] @ p["w"])
    return spmdkit.Task(name="scored", init=lambda k: {"w": jax.random.normal(k, (4, 2)) * 0.1}, loss_fn=loss,
                        train_data={"x": x, "y": y}, eval_data=eval_data(x, y),
                        predictor=spmdkit.Predictor(predict, score))


@pytest.mark.parametrize("eval_data", [lambda x, y: {"x": x, "y": y},
                                       lambda x, y: [{"x": x[i:i + 16], "y": y[i:i + 16]} for i in (0, 16, 32)]],
                         ids=["arrays", "pipeline"])
def test_a_score_that_returns_a_mean_is_named_not_divided_by_the_rows(eval_data):
    # The ensemble metrics sum score's values and divide by the eval set's size: a mean came out
    # divided by the rows (ensemble_accuracy 0.064 for 0.825), silently.
    mean = lambda probs, b: {"accuracy": jnp.mean(jnp.argmax(probs, -1) == b["y"])}
    rows = lambda probs, b: {"accuracy": (jnp.argmax(probs, -1) == b["y"]).astype(jnp.float32)}
    config = spmdkit.TrainConfig(steps=2, batch_size=8, eval_batch_size=16)
    with pytest.raises(spmdkit.TaskError, match=r"'accuracy' has shape \(\) on a batch of \d+; it must give one value"):
        spmdkit.fit(_scored_task(mean, eval_data), spmdkit.Ensemble(2), optax.sgd(0.1), config, progress=False)
    result = spmdkit.fit(_scored_task(rows, eval_data), spmdkit.Ensemble(2), optax.sgd(0.1), config, progress=False)
    assert 0.5 < result.summary["ensemble_accuracy"] <= 1.0


def test_the_fix_for_one_models_state_works_as_written():
    # The MembersMismatchError for single-model states said to stack them with
    # jax.tree.map(lambda *xs: jnp.stack(xs), *states): done with states a strategy had placed,
    # that raised the same error again (they stay on that strategy's devices). The message's code
    # now places them too; run exactly as it is written, it gives the ensemble's own members.
    import re

    def make(rng):
        return {"w": jax.random.normal(rng, (3, 2)), "b": jnp.zeros(2)}

    def step(state, batch):
        g = jax.grad(lambda s: jnp.mean((batch["x"] @ s["w"] + s["b"]) ** 2))(state)
        return jax.tree.map(lambda a, b: a - 0.1 * b, state, g), {}

    single, ensemble = spmdkit.Single(), spmdkit.Ensemble(4)
    states = [single.init(make, k) for k in jax.random.split(jax.random.key(0), 4)]
    batch = {"x": np.ones((8, 3), np.float32)}
    for state in (states[0], jax.tree.map(lambda *xs: jnp.stack(xs), *states)):
        with pytest.raises(spmdkit.MembersMismatchError) as e:
            ensemble.step(step)(state, batch)
        code = re.search(r"(ensemble\.place_state\(jax\.tree\.map\(lambda \*xs: jnp\.stack\(xs\), \*states\)\))",
                         str(e.value))
        assert code, str(e.value)
        got, _ = ensemble.step(step)(eval(code.group(1)), batch)
        want, _ = ensemble.step(step)(ensemble.init(make, jax.random.key(0)), batch)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
