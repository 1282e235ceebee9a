"""``spmdkit bench --suite input``: training steps fed from memory, from disk, with prefetch.

Digits (8x8 images, flattened) and an MLP 64-256-256-10, trained with ``DataParallel``
on all local devices, one compiled step, synced every step as ``fit`` does. The steps
are fed by:

- (a) ``arrays``: the in-memory arrays, shuffled and batched by spmdkit (``fit``'s default);
- (b) ``grain``: a Grain pipeline over the on-disk data set (``write_dataset``), built
  as the README recommends: ``spmdkit.grain_batches(dir, B, seed=seed)``, a Grain
  ``MapDataset`` whose element k is global batch k read with one slice per leaf, no
  prefetch (Grain's per-example ``MapDataset.source(DatasetSource(dir)).shuffle(seed)
  .batch(B)`` reads, shuffles and stacks 256 examples one by one per batch);
- (c) ``grain + prefetch``: (b) with spmdkit's prefetch (``TrainConfig.prefetch``):
  batches read and put on the devices by a thread while the step runs.

Target: steps/s of (c) / (a) >= 0.95, from paired per-round ratios. Also the
input-only throughput (batches/s, no step) of each source, in its own interleaved
rounds. Without Grain installed, (b) and (c) read the data set directly (memory maps).
"""

from __future__ import annotations

import tempfile
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from spmdkit._bench._timing import case_row, machine, measure, ratio, target
from spmdkit._bench.report import collect
from spmdkit._data import ArrayFeed, PipelineFeed, Prefetch, grain_batches, to_devices, write_dataset
from spmdkit._strategies import DataParallel
from spmdkit._tasks import digits

TARGET_PREFETCH = 0.95
PREFETCH = 2


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = x.reshape((x.shape[0], -1))
        for width in (256, 256):
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(10)(x)


def _has_grain() -> bool:
    try:
        import grain  # noqa: F401
    except ImportError:
        return False
    return True


def _pipeline(directory: str, batch_size: int, seed: int) -> Any:
    if not _has_grain():  # Python 3.11 (no Grain): the same data set read directly
        return None
    return grain_batches(directory, batch_size, seed=seed)


def _sources(train: dict, directory: str, batch_size: int, strategy: Any) -> dict[str, Any]:
    """Endless ``(epoch, batch)`` iterators, one per case."""
    sharding_for = lambda even: strategy._batch_sharding_for("step", even)  # noqa: E731
    shards = strategy.batch_shards
    arrays = ArrayFeed(train, batch_size, 0, True).batches(0)

    def disk():
        pipeline = _pipeline(directory, batch_size, 0)
        if pipeline is None:
            from spmdkit._data import load_dataset

            return ArrayFeed(load_dataset(directory), batch_size, 0, True).batches(0)
        return PipelineFeed(pipeline, batch_size).batches(0)

    place = lambda b: to_devices(b, sharding_for, shards)  # noqa: E731
    return {"(a) arrays": arrays, "(b) grain": disk(), "(c) grain + prefetch": Prefetch(disk(), PREFETCH, place)}


# A 6-7 ms step on 8 simulated devices varies 13-25% round to round whatever feeds it: 9 rounds
# left two back-to-back runs 10.7% apart, so 15 (well under a minute idle).
ROUNDS = 15


def _train_step(strategy: Any) -> tuple[Any, Any]:
    """The suite's model: ``make_state`` and the strategy's compiled step of an MLP on digits."""
    model, opt = _MLP(), optax.sgd(0.05, momentum=0.9)

    def make_state(rng):
        params = model.init(rng, jnp.zeros((1, 8, 8, 1)))["params"]
        return {"params": params, "opt": opt.init(params)}

    def train_step(state, batch):
        def loss_fn(p):
            logits = model.apply({"params": p}, batch["image"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, o = opt.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": o}, loss

    return make_state, strategy.step(train_step)


def _measure_sources(train: Any, batch_size: int, strategy: Any, rounds: int) -> dict[str, dict[str, Any]]:
    """Steps fed by each source, then each source alone, over the same data set on disk."""
    make_state, step = _train_step(strategy)
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        directory = str(write_dataset(f"{tmp}/digits", train))
        states: dict[str, Any] = {}
        step_sources = _sources(train, directory, batch_size, strategy)
        input_sources = _sources(train, directory, batch_size, strategy)
        try:
            def stepper(name):
                def case():
                    _, batch = next(step_sources[name])
                    states[name], loss = step(states.get(name) or strategy.init(make_state, 0), batch)
                    jax.block_until_ready(states[name])  # as fit: every step synced
                return case

            def reader(name):
                return lambda: jax.block_until_ready(next(input_sources[name])[1])

            runs["train steps"] = measure({n: stepper(n) for n in step_sources}, rounds=rounds)
            runs["input only"] = measure({n: reader(n) for n in input_sources}, rounds=rounds)
        finally:
            for sources in (step_sources, input_sources):
                for it in sources.values():
                    if isinstance(it, Prefetch):
                        it.close()
    return runs


def run(quick: bool = False, rounds: int | None = None) -> dict[str, Any]:
    rounds = rounds or (3 if quick else ROUNDS)
    strategy = DataParallel()
    batch_size = (64 if quick else 256) // strategy.batch_shards * strategy.batch_shards
    train, _ = digits.load()
    runs = _measure_sources(train, batch_size, strategy, rounds)
    rows = []
    for label, record in runs.items():
        for name in record["cases"]:
            c = case_row(record, name)
            rows.append({"measure": label, "source": name, "per_s": 1e3 / c["median"] if c["median"] else None,
                         "median_ms": c["median"], "iqr_pct": c["iqr_pct"], "min_ms": c["min"], "max_ms": c["max"],
                         "flag": c["flag"]})
    steps = runs["train steps"]
    prefetch_gain = ratio(steps, "(b) grain", "(c) grain + prefetch")
    report = {
        "suite": "input",
        "machine": machine(),
        "columns": ["measure", "source", "per_s", "median_ms", "iqr_pct", "min_ms", "max_ms", "flag"],
        "rows": rows,
        "targets": [
            # time(a) / time(c) per round = steps/s of (c) over steps/s of (a)
            target("steps/s from a Grain pipeline over the on-disk format with prefetch / from in-memory arrays "
                   "(paired per-round ratios)", ratio(steps, "(a) arrays", "(c) grain + prefetch"), ">=",
                   TARGET_PREFETCH),
        ],
        "notes": [
            f"batch {batch_size} on {strategy.batch_shards} device(s); prefetch {PREFETCH} batches",
            "(b), (c): spmdkit.grain_batches(dir, batch_size, seed=0), a Grain MapDataset of whole batches (one read "
            "per leaf per batch), read by index as fit reads it",
            f"prefetch bought: steps/s of (c) / (b) = {prefetch_gain['median']:.3f} (median of paired ratios)",
        ] + ([] if _has_grain() else ["Grain is not installed (Python < 3.12?): (b) and (c) read the on-disk data "
                                      "set through memory maps instead of a Grain pipeline"]),
    }
    return collect(report, runs)
