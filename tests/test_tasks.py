"""Built-in tasks and the Task contract."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import spmdkit
from spmdkit._tasks import digits, linreg


def test_linreg_is_seed_002():
    task = linreg.make()
    assert task.num_train == 128 and task.train_data["x"].shape == (128, 1)
    x, y = task.train_data["x"], task.train_data["y"]
    residual = y - (2 * x - 1)
    assert abs(residual.mean()) < 0.15 and 0.4 < residual.std() < 0.6  # noise 0.5
    assert task.defaults["lr"] == 0.005
    params = task.init(jax.random.key(123))
    assert set(params) == {"weight", "bias"} and params["weight"].shape == ()


def test_digits_is_real_sklearn_data_split_without_overlap():
    train, test = digits.load()
    assert train["image"].shape[1:] == (8, 8, 1) and train["image"].dtype == np.float32
    assert len(train["label"]) + len(test["label"]) == 1797
    assert len(test["label"]) == 359
    assert 0.0 <= train["image"].min() and train["image"].max() <= 1.0
    assert set(np.unique(train["label"])) == set(range(10))
    flat = lambda d: {row.tobytes() for row in d["image"]}  # noqa: E731
    assert len(flat(train) & flat(test)) < 5  # the data set has a few duplicate images


def test_digits_cnn_shapes():
    task = digits.make()
    params = task.init(jax.random.key(0))
    assert params["Dense_0"]["kernel"].shape == (2 * 2 * 64, 256)
    loss, aux = task.loss_fn(params, jax.tree.map(lambda x: x[:5], task.train_data), None)
    assert np.isfinite(loss) and 0 <= aux["accuracy"] <= 1


def test_get_task_unknown():
    with pytest.raises(spmdkit.ConfigError, match=r"(?s)task='cifar' is not known.*\['digits', 'linreg', 'lm', 'mlp', 'mnist'\]"):
        spmdkit.get_task("cifar")


def base_task(**kw):
    args = dict(name="t", init=lambda k: {}, loss_fn=lambda p, b, k: (0.0, {}), train_data={"x": np.ones(4)})
    return spmdkit.Task(**{**args, **kw})


def test_mismatched_array_lengths_name_both_arrays():
    with pytest.raises(spmdkit.DataError) as e:
        base_task(train_data={"x": np.ones((10, 2)), "y": np.ones(9)})
    assert "train_data['x'] has 10 examples, train_data['y'] has 9" in str(e.value)
    with pytest.raises(spmdkit.DataError, match=r"eval_data\['y'\] has 3"):
        base_task(eval_data={"x": np.ones(4), "y": np.ones(3)})


@pytest.mark.parametrize(
    "data, match",
    [
        ({}, "holds no arrays"),
        ({"x": np.float32(1)}, r"train_data\['x'\] is a scalar"),
        ({"x": np.ones((0, 3))}, "has 0 examples"),
        # A list is a pytree: each number was a leaf, named "train_data['x'][0][0] is a scalar".
        ({"x": [[1.0, 2.0]] * 4, "y": np.ones(4)},
         r"(?s)train_data\['x'\] is a Python list or tuple of values.*np.asarray\(train_data\['x'\]\)"),
        ({"x": np.ones((4, 2)), "y": (1, 0, 1, 0)}, r"train_data\['y'\] is a Python list or tuple"),
        # Per-example records are not a list of values: np.asarray of them makes an object array.
        ({"rows": [{"x": 1.0, "y": 0}] * 4}, r"(?s)train_data\['rows'\] is a Python list or tuple of per-example "
                                             r"records \(train_data\['rows'\]\[0\]\['x'\] is one value\).*"
                                             r"np.stack\(\[r\[k\] for r in rows\]\)"),
    ],
)
def test_bad_data(data, match):
    with pytest.raises(spmdkit.DataError, match=match):
        base_task(train_data=data)


def test_non_callable_init():
    with pytest.raises(spmdkit.DataError, match="must be callables"):
        base_task(init=None)
