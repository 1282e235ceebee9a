"""Generate bytes with an lm checkpoint written by ``spmdkit train --task lm``."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from spmdkit._checkpoint import (CheckpointConfig, CheckpointDamagedError, CheckpointError, Checkpointer, _without_step,
                                 step_name)
from spmdkit._config import SEEDS
from spmdkit._errors import ConfigError, fix
from spmdkit._strategies import get_strategy
from spmdkit._tasks import lm, task_defaults
from spmdkit._tasks._base import Task
from spmdkit._train._steps import task_state

# remat and scan_unroll change the program, not the parameters' shapes: sample builds the form the run
# trained with, and a checkpoint that saved neither (one written before --scan-unroll) gets lm's defaults.
_MODEL_KEYS = ("layers", "d_model", "heads", "seq_len", "precision", "remat", "scan_unroll")
_PARAMS = ".params"  # where TrainState keeps the parameters, as the checkpoint names the place
_READ_ATTEMPTS = 3  # steps deleted while read (a live run's retention) before the error stands


def _newest_step(ckpt: Checkpointer, step: int | None,
                 damaged: list[tuple[int, str]]) -> tuple[int, list[tuple[int, str]]]:
    """``step``, or the newest intact step and the newer ones passed over, each with its problem.

    The newest step of a run killed mid-save (or of a live run, saving it now) has no manifest
    yet: sample took it and failed with "resume from an earlier step (spmdkit does so with
    --resume)", which sample has no flag for. Like a reader's restore_latest it falls back past
    such steps and past ``damaged`` (steps whose files proved damaged when read: a changed byte
    that only the checksum shows), and leaves them in place."""
    steps = ckpt.steps()
    if not steps:
        raise CheckpointError(fix(f"{ckpt.directory} holds no spmdkit checkpoints.",
                                  "pass the --checkpoint-dir of a `spmdkit train --task lm` run."))
    if step is not None:
        if step not in steps:
            raise CheckpointError(fix(f"{ckpt.directory} has no step {step}; it has {steps}.",
                                      f"pass --step {steps[-1]}."))
        return step, []
    passed = {s for s, _ in damaged}
    candidate, skipped = _newest_intact(ckpt, [s for s in steps if s not in passed])
    skipped = sorted([*skipped, *((s, why) for s, why in damaged if candidate is None or s > candidate)],
                     reverse=True)
    if candidate is not None:
        return candidate, skipped
    raise CheckpointDamagedError(fix(f"no intact checkpoint in {ckpt.directory}: steps {steps} are all damaged "
                                     f"(step {skipped[0][0]}: {skipped[0][1]}).",
                                     f"see spmdkit checkpoints {ckpt.directory} --verify; sample from another run's "
                                     "--checkpoint-dir."))


def _newest_intact(ckpt: Checkpointer, steps: list[int]) -> tuple[int | None, list[tuple[int, str]]]:
    """The newest of ``steps`` whose files show no problem (None if none), and the newer ones
    passed over, each with its first problem."""
    skipped = []
    for step in reversed(steps):
        problems = ckpt.problems(step, arrays=False)
        if not problems:
            return step, skipped
        skipped.append((step, problems[0]))
    return None, skipped


def _intact_hint(ckpt: Checkpointer, step: int, error: CheckpointDamagedError) -> CheckpointDamagedError:
    """A damaged step's error with sample's own fix (its restore's speaks of --resume)."""
    intact, _ = _newest_intact(ckpt, [s for s in ckpt.steps() if s != step])
    remedy = (f"pass --step {intact} (the newest intact step; without --step, sample takes it)" if intact is not None else
              f"no other step of {ckpt.directory} is intact: sample from another run's --checkpoint-dir")
    return CheckpointDamagedError(fix(str(error).split("\n  Fix:")[0], remedy + "."))


def load_lm(checkpoint_dir: str | Path, step: int | None = None, **model: Any) -> tuple[lm.TransformerLM, Any, int]:
    """``(model, params, step)`` of an lm checkpoint; the sizes from its saved options.

    ``model`` overrides the saved sizes (``layers=``, ``d_model=``...): a run started
    from Python has no saved options, so its sizes must be given here.
    """
    if not Path(checkpoint_dir).is_dir():
        # A file (params.npz, a step's metadata) was reported as "does not exist", which it does.
        what = "is a file, not a directory" if Path(checkpoint_dir).exists() else "does not exist"
        raise CheckpointError(fix(f"checkpoint directory {str(checkpoint_dir)!r} {what}.",
                                  "pass the --checkpoint-dir of a `spmdkit train --task lm` run."))
    ckpt = Checkpointer(CheckpointConfig(str(checkpoint_dir)), log=lambda m: None)
    damaged: list[tuple[int, str]] = []  # found when read: passed over on the next pass
    relisted = 0
    while True:
        chosen, skipped = _newest_step(ckpt, step, damaged)
        try:
            loaded = _load_step(ckpt, chosen, checkpoint_dir, model)
        except (CheckpointError, OSError) as e:
            gone = not (ckpt.directory / step_name(chosen)).exists()
            if step is None and gone and relisted < _READ_ATTEMPTS - 1:
                # Beside a live run, its retention (--keep) may delete the step while it is read: that was
                # "metadata cannot be read ... Fix: pass the sizes the run trained with". List the steps again.
                relisted += 1
                continue
            if gone or not isinstance(e, CheckpointDamagedError):
                raise
            if step is not None:
                raise _intact_hint(ckpt, chosen, e) from None
            # Its files passed the listing's checks but not the read's (a changed byte: its checksum).
            damaged.append((chosen, _without_step(str(e).splitlines()[0], chosen, ckpt.directory)))
            continue
        if skipped:
            warnings.warn(f"sample: {'steps' if len(skipped) > 1 else 'step'} {[s for s, _ in skipped]} of "
                          f"{ckpt.directory} cannot be used (step {skipped[0][0]}: {skipped[0][1]}); sampling "
                          f"from step {chosen}, the newest intact one.", RuntimeWarning, stacklevel=2)
        return loaded


def _load_step(ckpt: Checkpointer, step: int, checkpoint_dir: str | Path,
               model: dict[str, Any]) -> tuple[lm.TransformerLM, Any, int]:
    meta = ckpt.meta(step)
    if meta.get("task") != "lm":
        raise ConfigError(fix(f"the checkpoint at step {step} in {checkpoint_dir} is of task {meta.get('task')!r}, not lm.",
                              "sample from a `spmdkit train --task lm` checkpoint."))
    strategy = meta.get("strategy") or {}
    if strategy.get("strategy") == "ensemble":
        # Every leaf has a leading member axis: the size check below blamed the model's sizes ("pass
        # the sizes the run trained with", which were right) and suggested --members, which sample lacks.
        raise ConfigError(fix(f"the checkpoint at step {step} in {checkpoint_dir} holds an ensemble of "
                              f"{strategy.get('members')} models (--strategy ensemble); sample continues a prompt with "
                              "one model.", "sample the --checkpoint-dir of a run trained with --strategy data, "
                              "single or sharded."))
    options = {**task_defaults("lm"), **(meta.get("config") or {})}
    unknown = sorted(set(model) - set(_MODEL_KEYS))
    if unknown:
        raise ConfigError(fix(f"sample: {unknown} are not lm sizes.", f"pass only {list(_MODEL_KEYS)}."))
    cfg = lm.LMConfig(**{**{k: options[k] for k in _MODEL_KEYS if options.get(k) is not None}, **model})
    model_def, init, loss_fn = lm.lm_functions(cfg)
    shell = Task(name="lm", init=init, loss_fn=loss_fn, train_data={"tokens": np.zeros((1, cfg.seq_len + 1), np.uint8)})
    # Only the parameters are restored: sampling needs no optimizer state. The whole state was
    # rebuilt with the saved (or default, AdamW) optimizer, so a run from Python, which saves no
    # options, could not be sampled unless it had trained with AdamW ("resume with the optimizer").
    make_state = task_state(shell, optax.sgd(0.0))
    key = jax.random.key(0)  # only the shapes of the state are taken from it
    target = get_strategy("single").abstract(make_state, key, unbox=True).params
    _check_sizes(ckpt, step, target, cfg, given=model, saved=bool(meta.get("config")))
    params, _ = ckpt.restore(step, target, part=_PARAMS)
    return model_def, params, step


def _check_sizes(ckpt: Checkpointer, step: int, target: Any, cfg: lm.LMConfig, given: dict[str, Any],
                 saved: bool) -> None:
    """The model built to sample has the checkpoint's parameter shapes; else an error that says which
    sizes were used and where they came from. The checkpoint's own message speaks of "the target"
    and tells how to restore into it, which a sampling user cannot act on."""
    try:
        ckpt.check_target(step, target, part=_PARAMS)
    except CheckpointError as e:
        diagnosis = str(e).split("\n  Fix:")[0].replace("the target", "the model built to sample")
        sizes = {k: getattr(cfg, k) for k in ("layers", "d_model", "heads", "seq_len")}
        source = (f"you passed {given}" if given else "saved with the checkpoint" if saved else
                  "lm's defaults: the run saved no options (it was started from Python)")
        remedy = (f"drop {sorted(given)} to use the sizes saved with the checkpoint, or pass the ones the run trained with."
                  if given and saved else "pass the sizes the run trained with: spmdkit.sample(dir, prompt, "
                  "layers=..., d_model=..., heads=..., seq_len=...).")
        raise CheckpointError(fix(f"{diagnosis}\n  sample built the model with {sizes} ({source}).", remedy)) from None


def _prompt_bytes(prompt: str | bytes | bytearray) -> bytes:
    """The prompt's bytes: text as UTF-8, with the undecodable bytes of a command line (which Python
    holds as lone surrogates, U+DC80-U+DCFF) given back as those bytes, as ``os.fsencode`` does."""
    if not isinstance(prompt, str):
        return bytes(prompt)
    try:
        return prompt.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError as e:
        raise ConfigError(fix(f"prompt holds {prompt[e.start:e.end]!r} at position {e.start}, a lone surrogate that is "
                              "no text and no escaped byte.", "pass the prompt as bytes (prompt=b'...'), or as valid "
                              "text.")) from None


def sample(
    checkpoint_dir: str | Path,
    prompt: str | bytes = "",
    length: int = 200,
    temperature: float = 0.0,
    seed: int = 0,
    step: int | None = None,
    stream: Callable[[bytes], object] | None = None,
    **model: Any,
) -> bytes:
    """``length`` bytes that an lm checkpoint continues ``prompt`` with.

    ``temperature=0`` takes the most likely byte each time (greedy); above 0 it samples
    from the softmax of ``logits / temperature`` with keys from ``seed``. The model sees
    the last ``seq_len`` bytes; an empty prompt starts from a newline. ``stream``, when
    given, is called with each byte (a ``bytes`` of length 1) as soon as it is generated,
    so a long sample can be shown as it grows (``stream=sys.stdout.buffer.write``) and what
    came before an interrupt is kept; the return value is every byte, as without it.
    """
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ConfigError(fix(f"length={length!r}: a whole number of bytes >= 0.", "e.g. length=200 (--length 200)."))
    if (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
            or not math.isfinite(temperature) or temperature < 0):
        raise ConfigError(fix(f"temperature={temperature!r}: a finite number >= 0 (0: the most likely byte).",
                              "e.g. temperature=0.8 (--temperature 0.8)."))
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEEDS:
        # jax.random.key keeps 32 bits of a seed: 2**32 sampled seed 0's text and -1 seed 2**32 - 1's
        # (and from 2**63 on it was a bare OverflowError)
        raise ConfigError(fix(f"seed={seed!r}: a whole number from 0 to {SEEDS - 1}.", "e.g. seed=1 (--seed 1)."))
    if stream is not None and not callable(stream):
        raise ConfigError(fix(f"stream={stream!r:.40}: a function called with each generated byte.",
                              "e.g. stream=sys.stdout.buffer.write, or leave it out."))
    if not isinstance(prompt, (str, bytes, bytearray)):
        raise ConfigError(fix(f"prompt={prompt!r:.40} ({type(prompt).__name__}): text or bytes.",
                              "e.g. prompt='def main(' (--prompt 'def main(')."))
    text = bytearray(_prompt_bytes(prompt)) or bytearray(b"\n")
    model_def, params, _ = load_lm(checkpoint_dir, step, **model)
    seq_len = model_def.cfg.seq_len

    @jax.jit
    def next_byte(params, window, last, key):
        logits = model_def.apply({"params": params}, window)[0, last]
        if temperature == 0:
            return jnp.argmax(logits)
        scaled = logits / temperature
        # A temperature so small that logits / T overflows float32 (or T itself rounds to 0 in float32:
        # 1e-40) made every positive logit +inf, and categorical took the first of them, not the most
        # likely byte: 1e-40 sampled "\n" where greedy gave " ". Shifted by the largest logit, the most
        # likely bytes stay 0 and the others go to -inf, the limit of T -> 0. Finite: unchanged.
        top = jnp.max(logits)
        shifted = jnp.where(logits == top, 0.0, (logits - top) / temperature)
        return jax.random.categorical(key, jnp.where(jnp.isfinite(scaled).all(), scaled, shifted))

    base = jax.random.key(seed)
    out = bytearray()
    for i in range(length):
        context = (text + out)[-seq_len:]
        window = np.zeros((1, seq_len), np.int32)  # causal: what follows `last` is never seen
        window[0, : len(context)] = np.frombuffer(bytes(context), np.uint8)
        out.append(int(next_byte(params, window, len(context) - 1, jax.random.fold_in(base, i))))
        if stream is not None:
            stream(bytes(out[-1:]))
    return bytes(out)
