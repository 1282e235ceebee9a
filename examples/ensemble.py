"""An ensemble of CNNs on handwritten digits, trained at once, one member per device.

The model code is the single-model code: `create_train_state` builds one model from one
key, `apply_model` computes one model's gradients, `update_model` applies them.
`spmdkit.Ensemble(K)` makes K states from K keys (member m from key m of a split), runs
the step for every member on the same batches and returns results with a leading member
axis. The ensemble's prediction (the mean of the members' probabilities) is one line of
ours, not of the library.

    python examples/ensemble.py
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import spmdkit


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(features=16, kernel_size=(3, 3))(x))
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nn.relu(nn.Conv(features=32, kernel_size=(3, 3))(x))
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(features=64)(x))
        return nn.Dense(features=10)(x)


def create_train_state(rng, learning_rate, momentum):
    cnn = CNN()
    params = cnn.init(rng, jnp.ones([1, 8, 8, 1]))["params"]
    # inject_hyperparams keeps the learning rate in the optimizer state, where an ensemble
    # can give each member its own (see `main(learning_rates=...)`); the updates are sgd's.
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=learning_rate, momentum=momentum)
    return train_state.TrainState.create(apply_fn=cnn.apply, params=params, tx=tx)


def apply_model(state, images, labels):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, images)
        one_hot = jax.nn.one_hot(labels, 10)
        loss = optax.softmax_cross_entropy(logits=logits, labels=one_hot).mean()
        return loss, logits

    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
    return grads, loss, accuracy


def update_model(state, grads):
    return state.apply_gradients(grads=grads)


def train_step(state, batch):
    grads, loss, accuracy = apply_model(state, batch["image"], batch["label"])
    return update_model(state, grads), {"loss": loss, "accuracy": accuracy}


def probabilities(state, batch):
    return jax.nn.softmax(state.apply_fn({"params": state.params}, batch["image"]))


@functools.lru_cache(maxsize=1)
def get_datasets(num_test: int = 360):
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]  # [N, 8, 8, 1] in [0, 1]
    labels = digits.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(labels))
    images, labels = images[order], labels[order]
    return ({"image": images[num_test:], "label": labels[num_test:]},
            {"image": images[:num_test], "label": labels[:num_test]})


def train(strategy, rng, steps: int, batch_size: int = 64, learning_rate: float = 0.1, momentum: float = 0.9):
    """`steps` steps of `train_step` on shuffled batches; the data order depends on the step only."""
    train_ds, _ = get_datasets()
    state = strategy.init(functools.partial(create_train_state, learning_rate=learning_rate, momentum=momentum), rng)
    step = strategy.step(train_step)
    n = len(train_ds["label"])
    for i in range(steps):
        rows = np.random.default_rng(i).permutation(n)[:batch_size]
        state, metrics = step(state, {k: v[rows] for k, v in train_ds.items()})
        jax.block_until_ready(metrics)  # XLA:CPU collectives: sync every step
    return state, metrics


def main(members: int | None = None, steps: int = 300, learning_rates: list[float] | None = None) -> dict[str, object]:
    """An ensemble; with ``learning_rates``, a population: member m trains with rate m."""
    members = len(learning_rates) if learning_rates else members or jax.device_count()
    hyperparams = {"learning_rate": list(learning_rates)} if learning_rates else None
    ensemble = spmdkit.Ensemble(members, hyperparams=hyperparams)
    state, metrics = train(ensemble, jax.random.key(0), steps)
    _, test_ds = get_datasets()
    probs = np.asarray(ensemble.apply(probabilities)(state, test_ds), np.float64)  # [members, N, 10]
    member_accuracy = np.mean(np.argmax(probs, -1) == test_ds["label"], axis=-1)
    ensemble_accuracy = np.mean(np.argmax(probs.mean(axis=0), -1) == test_ds["label"])
    return {"state": state, "probs": probs, "member_accuracy": member_accuracy,
            "ensemble_accuracy": float(ensemble_accuracy), "train_loss": np.asarray(metrics["loss"])}


if __name__ == "__main__":
    spmdkit.use_host_devices(8)
    out = main()
    print("test accuracy of each member:", np.round(out["member_accuracy"], 3))
    print(f"test accuracy of the ensemble (mean of probabilities): {out['ensemble_accuracy']:.3f}")
    rates = [0.3, 0.1, 0.03, 0.01]
    out = main(steps=100, learning_rates=rates)  # four learning rates trained at once
    for rate, accuracy in zip(rates, out["member_accuracy"]):
        print(f"learning rate {rate}: test accuracy after 100 steps {accuracy:.3f}")
