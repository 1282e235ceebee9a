"""Seed 003's CNN, scaled to 8x8 inputs, on scikit-learn's handwritten digits."""

from __future__ import annotations

from collections.abc import Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from spmdkit._errors import DataError, fix
from spmdkit._types import Predictor
from spmdkit._tasks._base import Task


NUM_CLASSES = 10  # the CNN's outputs: a label outside 0..9 makes its loss NaN at the first step


class CNN(nn.Module):
    """The Flax MNIST example's CNN (conv 32, conv 64, dense 256, dense 10)."""

    num_classes: int = NUM_CLASSES

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(32, (3, 3))(x))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = nn.relu(nn.Conv(64, (3, 3))(x))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(256)(x))
        return nn.Dense(self.num_classes)(x)


def classification_task(
    name: str, model: nn.Module, train: dict, test: dict, defaults: dict
) -> Task:
    """A softmax classifier task for any Flax module on ``{"image", "label"}`` data."""
    for split, data in (("training", train), ("eval", test)):
        if data is not None and (not isinstance(data, Mapping) or not {"image", "label"} <= set(data)):
            leaves = sorted(data) if isinstance(data, Mapping) else type(data).__name__
            raise DataError(fix(f"task {name!r}: its {split} data hold {leaves}; it reads 'image' [N, rows, cols, 1] "
                                "and 'label' [N] (class ids).",
                                f"write the data set from the task (spmdkit data write DIR --task {name}), or with "
                                "leaves named image and label."))
    example = jnp.zeros((1, *train["image"].shape[1:]), jnp.float32)

    def init(rng):
        return model.init(rng, example)["params"]

    def loss_fn(params, batch, rng):
        logits = model.apply({"params": params}, batch["image"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
        return loss, {"accuracy": accuracy}

    def predict(params, batch):
        return jax.nn.softmax(model.apply({"params": params}, batch["image"]))

    def score(probs, batch):
        label = batch["label"]
        picked = jnp.take_along_axis(probs, label[:, None], axis=-1)[:, 0]
        return {"accuracy": (jnp.argmax(probs, -1) == label).astype(jnp.float32), "nll": -jnp.log(picked + 1e-12)}

    return Task(
        name=name, init=init, loss_fn=loss_fn, train_data=train, eval_data=test, defaults=defaults,
        predictor=Predictor(predict, score),
    )


def load(test_fraction: float = 0.2, split_seed: int = 0) -> tuple[dict, dict]:
    """The 1,797 8x8 digits shipped with scikit-learn, scaled to [0, 1], split."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    labels = digits.target.astype(np.int32)
    order = np.random.default_rng(split_seed).permutation(len(labels))
    n_test = int(round(len(labels) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return (
        {"image": images[train], "label": labels[train]},
        {"image": images[test], "label": labels[test]},
    )


DEFAULTS = {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9, "steps": 300, "batch_size": 64}


def make(data_dir: str | None = None) -> Task:
    """The digits task; the data ships with scikit-learn, so ``data_dir`` is not used."""
    train, test = load()
    return classification_task("digits", CNN(), train, test, defaults=DEFAULTS)


def from_data(train: dict, test: dict | None) -> Task:
    """The digits task on given splits (a data set directory's ``train`` and ``eval``)."""
    return classification_task("digits", CNN(), train, test, defaults=DEFAULTS)
