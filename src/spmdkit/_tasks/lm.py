"""A byte-level decoder-only transformer language model on real text.

The model: token and learned position embeddings, ``layers`` pre-norm blocks (RMSNorm,
causal multi-head attention, RMSNorm, GELU MLP) as one ``nn.scan``, a final RMSNorm and
an output projection tied to the token embedding. Every parameter and activation names
its dimensions logically (``batch``, ``length``, ``embed``, ``heads``, ``kv``, ``mlp``,
``vocab``, ``layers``), so a rules table alone decides the layout.

The text: by default the ``*.py`` files of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``, without ``site-packages``), or every file under
``text_dir``. Files are sorted by relative path; the file with sorted index ``i`` is
held out for eval when ``i % 20 == 0``, the others are training text. Each side is the
concatenation of its files' bytes, read in that order and cut at ``text_bytes`` bytes
(training) and ``text_bytes // 10`` bytes (held out), so a default run reads ~1 MB.
Examples are windows of ``seq_len + 1`` bytes (inputs and next-byte targets) at a
stride of ``seq_len``, so each byte is a target once. Eval reports bits per byte: the mean cross-entropy in nats / ln 2.
"""

from __future__ import annotations

import math
import os
import stat
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from spmdkit._errors import ConfigError, DataError, fix
from spmdkit._tasks._base import Task

DEFAULTS = {"optimizer": "adamw", "lr": 3e-3, "steps": 200, "batch_size": 32, "eval_every": 100}
HELD_OUT_EVERY = 20  # the file with sorted index i is held out when i % 20 == 0
TEXT_BYTES = 1_000_000  # training bytes read by default; held-out: a tenth of that
VOCAB = 256  # bytes
PRECISIONS = {"f32": jnp.float32, "bf16": jnp.bfloat16}
# nn.remat policies by name: "full" recomputes the whole block in the backward pass,
# "dots" keeps the matmul outputs (without a batch dimension) and recomputes the rest.
REMAT = ("none", "full", "dots")
# By default the scan over layers is unrolled (one straight-line program, no loop) up to this
# many layers: on CPU the rolled loop costs more than it saves (it slices every layer's weights
# out of the stacked parameters and writes every layer's saved activations into stacked
# buffers, each a copy); deeper models keep the loop, whose compile time does not grow with depth.
UNROLL_ALL_UP_TO = 8
# The token embedding's init scale, as GPT-2's. It is also the output projection (tied), so
# its scale sets the untrained logits: with 0.02 they are near zero, the prediction near
# uniform (8 bits per byte); with 1.0 the model predicted the current byte again with a
# logit of ~sqrt(d_model) and started at ~18 bits per byte.
TOKEN_EMBED_STD = 0.02


def _heads_fix(d_model: int, heads: int) -> str:
    """The nearest sizes that fit: head counts dividing ``d_model`` on either side of ``heads``,
    and multiples of ``heads`` on either side of ``d_model`` (64 and 3: --heads 2 or 4, or
    --d-model 63 or 66; it said --d-model 63 or --heads 1).

    >>> _heads_fix(64, 3)
    'use --heads 2 or 4 (divisors of d_model=64), or --d-model 63 or 66 (multiples of heads=3).'
    """
    divisors = [d for d in range(1, d_model + 1) if d_model % d == 0]
    near = [d for d in (max((d for d in divisors if d < heads), default=None),
                        min((d for d in divisors if d > heads), default=None)) if d is not None]
    sizes = sorted({m for m in ((d_model // heads) * heads, (d_model // heads + 1) * heads) if m >= heads})
    return (f"use --heads {' or '.join(map(str, near))} (divisors of d_model={d_model}), or --d-model "
            f"{' or '.join(map(str, sizes))} (multiples of heads={heads}).")


@dataclass(frozen=True)
class LMConfig:
    """Sizes and switches of the model. ``d_model`` must be a multiple of ``heads``.

    Example:
        >>> LMConfig(layers=2, d_model=64, heads=4).head_dim
        16
    """

    layers: int = 2
    d_model: int = 64
    heads: int = 4
    seq_len: int = 64
    mlp_ratio: int = 4
    precision: str = "f32"  # compute dtype; parameters and optimizer state stay float32
    remat: str = "none"
    scan_unroll: int | None = None  # layers per iteration of the scan's loop; None: see ``unroll``

    def __post_init__(self) -> None:
        for name in ("layers", "d_model", "heads", "seq_len", "mlp_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(fix(f"lm: {name}={value!r} must be a whole number >= 1.",
                                      f"e.g. --{name.replace('_', '-')} 4."))
        if self.d_model % self.heads:
            raise ConfigError(fix(f"lm: d_model={self.d_model} is not a multiple of heads={self.heads}.",
                                  _heads_fix(self.d_model, self.heads)))
        if self.precision not in PRECISIONS:
            raise ConfigError(fix(f"lm: precision={self.precision!r} is not known.",
                                  f"choose one of {sorted(PRECISIONS)} (--precision bf16)."))
        if self.remat not in REMAT:
            raise ConfigError(fix(f"lm: remat={self.remat!r} is not a remat policy.",
                                  f"choose one of {list(REMAT)} (--remat full)."))
        unroll = self.scan_unroll
        if unroll is not None and (isinstance(unroll, bool) or not isinstance(unroll, int) or unroll < 1):
            raise ConfigError(fix(f"lm: scan_unroll={unroll!r} must be a whole number >= 1 (layers per iteration of "
                                  "the scan's loop) or None (the default).",
                                  f"pass scan_unroll=1 (a rolled loop; --scan-unroll 1) or scan_unroll={self.layers} (all "
                                  "layers, no loop)."))

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @property
    def dtype(self):
        return PRECISIONS[self.precision]

    @property
    def unroll(self) -> int:
        """Layers per iteration of the scan's loop: ``scan_unroll`` (at most ``layers``), or by default
        every layer (no loop) up to ``UNROLL_ALL_UP_TO`` layers and 1 (a rolled loop) beyond.

        Example:
            >>> LMConfig(layers=4).unroll, LMConfig(layers=12).unroll, LMConfig(layers=4, scan_unroll=1).unroll
            (4, 1, 1)
        """
        if self.scan_unroll is None:
            return self.layers if self.layers <= UNROLL_ALL_UP_TO else 1
        return min(self.scan_unroll, self.layers)


def _param(module: nn.Module, name: str, init, names: tuple[str, ...], shape: tuple[int, ...]) -> jax.Array:
    return module.param(name, nn.with_logical_partitioning(init, names), shape, jnp.float32)


def _named(x: jax.Array, *names: str) -> jax.Array:
    return nn.with_logical_constraint(x, names)


class RMSNorm(nn.Module):
    dtype: object = jnp.float32

    @nn.compact
    def __call__(self, x):
        scale = _param(self, "scale", nn.initializers.ones, ("embed",), (x.shape[-1],))
        x32 = x.astype(jnp.float32)  # the mean square in float32 also under bf16
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
        return (x32 * scale).astype(self.dtype)


class Block(nn.Module):
    """Pre-norm attention and MLP, both residual; ``(x, None) -> (x, None)`` for nn.scan."""

    cfg: LMConfig

    @nn.compact
    def __call__(self, x, _):
        cfg, dt = self.cfg, self.cfg.dtype
        dense = nn.initializers.normal(0.02)
        out_init = nn.initializers.normal(0.02 / math.sqrt(2 * cfg.layers))
        h = RMSNorm(dt, name="attn_norm")(x)
        shape = (cfg.d_model, cfg.heads, cfg.head_dim)
        w_qkv = [_param(self, n, dense, ("embed", "heads", "kv"), shape).astype(dt) for n in ("query", "key", "value")]
        # The scores' 1/sqrt(kv) applied to the query weight (embed x d_model numbers) rather than to
        # the (batch, heads, length, length) scores: one pass over the largest activation fewer.
        w_qkv[0] = w_qkv[0] / math.sqrt(cfg.head_dim)
        q, k, v = _project_qkv(h, w_qkv, flat=not _length_split())
        scores = jnp.einsum("bhqd,bhkd->bhqk", q, k).astype(jnp.float32)
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        probs = _named(jax.nn.softmax(scores, axis=-1).astype(dt), "batch", "heads", "length", None)
        attn = _named(jnp.einsum("bhqk,bhkd->bhqd", probs, v), "batch", "heads", "length", "kv")
        w_out = _param(self, "out", out_init, ("heads", "kv", "embed"), (cfg.heads, cfg.head_dim, cfg.d_model))
        x = _named(x + jnp.einsum("bhld,hde->ble", attn, w_out.astype(dt)), "batch", "length", "embed")
        h = RMSNorm(dt, name="mlp_norm")(x)
        hidden = cfg.mlp_ratio * cfg.d_model
        w_in = _param(self, "mlp_in", dense, ("embed", "mlp"), (cfg.d_model, hidden)).astype(dt)
        w_mlp_out = _param(self, "mlp_out", out_init, ("mlp", "embed"), (hidden, cfg.d_model)).astype(dt)
        if _length_split():  # sequence parallel: the tokens stay (batch, length), each split its own way
            h = _named(jax.nn.gelu(h @ w_in), "batch", "length", "mlp")
            return _named(x + h @ w_mlp_out, "batch", "length", "embed"), None
        # The tokens as one dimension (batch-major, so split like the batch): the weights' gradients
        # are then single matrix products. With (batch, length) as two contracting dimensions
        # XLA:CPU copies the (tokens x mlp) gradient transposed in every layer, a fifth of the step.
        b, l = x.shape[:2]
        h = _named(jax.nn.gelu(h.reshape(b * l, -1) @ w_in), "batch", "mlp")
        return _named(x + (h @ w_mlp_out).reshape(b, l, -1), "batch", "length", "embed"), None


def _project_qkv(h: jax.Array, weights: list[jax.Array], flat: bool):
    """Queries, keys and values ``(batch, heads, length, kv)`` of ``h (batch, length, embed)``: the
    layout the attention's batched products take, so that no copy sits between them.

    ``flat``: the three projections as one product of the tokens ``(batch x length, embed)`` with
    the three weights side by side ``(embed, heads, 3, kv)``: one larger matrix product instead of
    three, whose gradient's weight part is one product too (not three, each contracting batch and
    length). Under sequence parallelism (``flat=False``) the tokens keep ``(batch, length)``, each
    projection its own product.
    """
    if not flat:
        return tuple(_named(jnp.einsum("ble,ehd->bhld", h, w), "batch", "heads", "length", "kv") for w in weights)
    b, l, e = h.shape
    heads, kv = weights[0].shape[1:]
    # (embed, heads, 3, kv): heads the major of the merged dimension, so a split of heads stays one
    # contiguous block of it (tensor parallelism needs no resharding for the reshape).
    w = jnp.stack(weights, axis=2).reshape(e, heads * 3 * kv)
    qkv = (h.reshape(b * l, e) @ w).reshape(b, l, heads, 3, kv)
    return tuple(_named(qkv[:, :, :, i].transpose(0, 2, 1, 3), "batch", "heads", "length", "kv") for i in range(3))


def _length_split() -> bool:
    """Whether the active logical rules split ``length`` over a mesh axis (sequence parallel)."""
    return any(name == "length" and axis is not None for name, axis in nn.get_logical_axis_rules())


def _block(cfg: LMConfig):
    if cfg.remat == "none":
        return Block
    policy = {"full": jax.checkpoint_policies.nothing_saveable,
              "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}[cfg.remat]
    # prevent_cse=False is safe, and cheaper, only where every layer runs inside a loop of two or
    # more iterations: the recomputation then sits in the backward loop, apart from the forward
    # one. Unrolled (or a single iteration, which XLA inlines), common-subexpression elimination
    # would merge the recomputation with the forward pass and keep the activations after all.
    looped = cfg.layers // cfg.unroll >= 2 and cfg.layers % cfg.unroll == 0
    return nn.remat(Block, policy=policy, prevent_cse=not looped)


class TransformerLM(nn.Module):
    """``tokens (batch, length) int -> logits (batch, length, 256) float32``."""

    cfg: LMConfig

    @nn.compact
    def __call__(self, tokens):
        cfg, dt = self.cfg, self.cfg.dtype
        wte = _param(self, "token_embed", nn.initializers.normal(TOKEN_EMBED_STD), ("vocab", "embed"), (VOCAB, cfg.d_model))
        wpe = _param(self, "position_embed", nn.initializers.normal(0.02), ("length", "embed"), (cfg.seq_len, cfg.d_model))
        length = tokens.shape[1]
        # A one-hot product, not a gather: with vocab and embed both split it partitions cleanly.
        x = jax.nn.one_hot(tokens, VOCAB, dtype=wte.dtype) @ wte + wpe[None, :length]
        x = _named(x.astype(dt), "batch", "length", "embed")
        x, _ = nn.scan(_block(cfg), length=cfg.layers, variable_axes={"params": 0}, split_rngs={"params": True},
                       unroll=cfg.unroll, metadata_params={nn.PARTITION_NAME: "layers"})(cfg, name="layers")(x, None)
        x = RMSNorm(dt, name="final_norm")(x)
        logits = jnp.einsum("ble,ve->blv", x, wte.astype(dt)) / math.sqrt(cfg.d_model)
        return _named(logits.astype(jnp.float32), "batch", "length", "vocab")


# ---------------------------------------------------------------- text
def stdlib_dir() -> Path:
    """The standard library of the running interpreter (the default corpus)."""
    return Path(sysconfig.get_paths()["stdlib"])


def text_files(text_dir: str | Path | None = None) -> list[Path]:
    """The corpus files, sorted by relative path: stdlib ``*.py`` or every file of ``text_dir``."""
    if text_dir is None:
        root = stdlib_dir()
        files = [p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts
                 and "dist-packages" not in p.relative_to(root).parts]
        where = f"the standard library at {root}"
    else:
        root = Path(text_dir)
        files = _walk_files(root, text_dir)
        where = f"--text-dir {str(text_dir)!r}"
    listed = sorted((p for p in files if p.is_file()), key=lambda p: p.relative_to(root).as_posix())
    files = _each_file_once(listed)
    if len(files) < 2:
        # "holds 1 file(s)" of a folder listing two names for one file (a link) read as a miscount.
        linked = (f" ({len(listed)} names, links to {len(files)} file(s): each real file is read once)"
                  if len(listed) > len(files) else "")
        raise DataError(fix(f"lm: {where} holds {len(files)} file(s){linked}; the corpus needs at least 2 (file 0 is "
                            f"held out for eval, as is every {HELD_OUT_EVERY}th).", "put more (non-hidden) text files in it."))
    return files


def _each_file_once(files: list[Path]) -> list[Path]:
    """``files`` with each real file (device and inode) once, at its first name: a symbolic or
    hard link to a held-out file ("latest.txt") put its text in the training split too."""
    seen, out = set(), []
    for p in files:
        try:
            st = p.stat()
        except OSError:  # gone since the listing: reading it names it
            out.append(p)
            continue
        if not st.st_ino:  # a file system without inode numbers: nothing to tell links by
            out.append(p)
        elif (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            out.append(p)
    return out


def text_folders(text_dir: str | Path) -> set[str]:
    """The real paths of the folders the corpus of ``text_dir`` reads, walked as the corpus walks
    them (non-hidden, through symbolic links): what a run's --out must not be inside."""
    return {os.path.realpath(folder) for folder, _ in _walk_folders(Path(text_dir), text_dir)}


def _walk_folders(root: Path, text_dir: str | Path) -> Iterator[tuple[str, list[str]]]:
    """``(folder, non-hidden file names)`` of every folder under ``root`` the corpus enters,
    through symlinked folders too. A directory that cannot be listed or entered is an error:
    rglob skipped it without a word, so its files were left out of the corpus (and the held-out
    split, every 20th file, shifted), and an unlistable --text-dir itself "held 0 files"."""
    def refuse(e: OSError, what: str = "list", folder: str | None = None) -> None:
        folder = folder or e.filename
        raise DataError(fix(f"lm: --text-dir {str(text_dir)!r}: cannot {what} {folder} ({e.strerror or e}); its "
                            "files would be left out of the corpus.",
                            f"make it readable (chmod -R u+rX {folder}), or move it out of --text-dir (a name "
                            "starting with '.' is skipped)."))

    _check_root(root, text_dir)
    # Symlinked folders are entered (a corpus of links to data sets is common; their files were left
    # out without a word), each real folder once, the first in sorted order: a link to an ancestor is no loop.
    seen = set()
    for folder, dirs, names in os.walk(root, onerror=refuse, followlinks=True):
        try:
            # Through "folder/.": that needs search (x) permission, which a folder that can be listed but
            # not entered (chmod 400 or 600) lacks; its files' stat then failed as a bare PermissionError.
            here = os.stat(os.path.join(folder, os.curdir))
        except OSError as e:
            refuse(e, "enter", folder)
        if (here.st_dev, here.st_ino) in seen:
            dirs[:] = []
            continue
        seen.add((here.st_dev, here.st_ino))
        # By "name/": the walk then meets folders in the sorted order of the files' paths ("a-b/x" before
        # "a/z/x"), so a folder reached twice is kept under its first name in that order, as files are.
        dirs[:] = sorted((d for d in dirs if not d.startswith(".")), key=lambda d: d + "/")
        yield folder, [n for n in names if not n.startswith(".")]


def _check_root(root: Path, text_dir: str | Path) -> None:
    """--text-dir itself is a directory. A missing one reached the walk's "cannot list it" and its fix,
    "make it readable (chmod -R u+rX ...)", which no chmod can do for a path that is not there."""
    try:
        mode = os.stat(root).st_mode
    except (FileNotFoundError, NotADirectoryError):
        what = (f"is a symbolic link to {os.readlink(root)}, which does not exist" if root.is_symlink()
                else "does not exist")
        raise DataError(fix(f"lm: --text-dir {str(text_dir)!r} {what}.",
                            f"pass a directory that exists (a relative path is taken from {os.getcwd()}), or "
                            "leave --text-dir out to train on the standard library's sources.")) from None
    except OSError:
        return  # one that cannot be reached (a folder above it without x): the walk names it and the fix
    if not stat.S_ISDIR(mode):
        raise DataError(fix(f"lm: --text-dir {str(text_dir)!r} is not a directory.",
                            "pass a directory of text files, or leave --text-dir out to train on the "
                            "standard library's sources."))


def _walk_files(root: Path, text_dir: str | Path) -> list[Path]:
    """Every non-hidden file of the folders :func:`_walk_folders` enters; a symbolic link to
    nothing, a FIFO, a socket or a device among them is an error."""
    files = [Path(folder, n) for folder, names in _walk_folders(root, text_dir) for n in names]
    for p in files:
        if p.is_symlink() and not p.exists():  # its text would be missing and the held-out split shifted
            raise DataError(fix(f"lm: --text-dir {str(text_dir)!r}: {p} is a symbolic link to {os.readlink(p)}, "
                                "which does not exist; its text would be left out of the corpus.",
                                f"remove the link (rm {p}) or restore what it points to, or rename it to start "
                                "with '.' (skipped)."))
        if p.exists() and not p.is_file():  # a FIFO, a socket, a device (a link to /dev/zero): dropped unsaid
            kind = next((what for test, what in ((p.is_fifo, "a FIFO"), (p.is_socket, "a socket"),
                                                 (p.is_char_device, "a character device"),
                                                 (p.is_block_device, "a block device")) if test()), "not a file")
            raise DataError(fix(f"lm: --text-dir {str(text_dir)!r}: {p} is {kind}, not a regular file; lm reads "
                                "every non-hidden file as text and cannot read this one (or would never finish).",
                                "move it out of --text-dir, or rename it to start with '.' (skipped)."))
    return files


def _read(files: list[Path], limit: int) -> bytes:
    parts, size = [], 0
    for path in files:
        if size >= limit:
            break
        # Only the bytes still wanted: read_bytes() took a 4 GB file whole (4.3 GB resident, 11 s)
        # to keep its first kilobyte, and a file larger than memory killed the run.
        try:
            with open(path, "rb") as f:
                data = f.read(limit - size)
        except OSError as e:  # unreadable, or deleted since the listing: a bare traceback before
            raise DataError(fix(f"lm: cannot read the corpus file {path} ({e.strerror or e}): it is not readable, "
                                "or it was removed or replaced while the corpus was read.",
                                "run again once the directory is settled, or make every file under --text-dir "
                                "readable (move others out of it).")) from None
        parts.append(data)
        size += len(data)
    return b"".join(parts)


def windows(text: bytes, seq_len: int, name: str) -> np.ndarray:
    """``(n, seq_len + 1)`` uint8 windows at a stride of ``seq_len``: each byte is a target once."""
    n = (len(text) - 1) // seq_len
    if n < 1:
        raise DataError(fix(f"lm: the {name} text has {len(text)} bytes, fewer than one window of seq_len+1 = "
                            f"{seq_len + 1}.", "use a larger corpus or --text-bytes, or a smaller --seq-len"
                            f"{' (or longer held-out files)' if name.startswith('held-out') else ''}."))
    data = np.frombuffer(text, np.uint8)
    starts = np.arange(n) * seq_len
    return data[starts[:, None] + np.arange(seq_len + 1)[None, :]]


def split_files(text_dir: str | Path | None = None) -> tuple[list[Path], list[Path]]:
    """``(train, held_out)`` files of the corpus: sorted index ``i`` is held out when ``i % 20 == 0``."""
    files = text_files(text_dir)
    held = [p for i, p in enumerate(files) if i % HELD_OUT_EVERY == 0]
    train = [p for i, p in enumerate(files) if i % HELD_OUT_EVERY != 0]
    return train, held


def load_text(text_dir: str | Path | None = None, text_bytes: int = TEXT_BYTES) -> tuple[bytes, bytes]:
    """``(train, held_out)`` bytes of the corpus with the fixed split described above."""
    train, held = split_files(text_dir)
    return _read(train, text_bytes), _read(held, max(text_bytes // 10, 1))


def _held_out_name(held: list[Path]) -> str:
    """The held-out text named by its files: "the held-out text has 3 bytes" did not say that it is
    the first file in sorted order (and every 20th), so a short first file read as a mystery."""
    shown = ", ".join(p.name for p in held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
    return f"held-out (the files at sorted positions 0, {HELD_OUT_EVERY}, {2 * HELD_OUT_EVERY}...: {shown})"


# ---------------------------------------------------------------- task
def lm_functions(cfg: LMConfig):
    """``(model, init, loss_fn)``: ``loss_fn(params, batch, rng) -> (nats per byte, metrics)``."""
    model = TransformerLM(cfg)

    def init(rng):
        return model.init(rng, jnp.zeros((1, cfg.seq_len), jnp.int32))["params"]

    def loss_fn(params, batch, rng):
        tokens = batch["tokens"].astype(jnp.int32)
        logits = model.apply({"params": params}, tokens[:, :-1])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        return loss, {"bits_per_byte": loss / math.log(2)}

    return model, init, loss_fn


def make(
    data_dir: str | None = None,
    layers: int = 2,
    d_model: int = 64,
    heads: int = 4,
    seq_len: int = 64,
    precision: str = "f32",
    remat: str = "none",
    text_dir: str | None = None,
    text_bytes: int = TEXT_BYTES,
    scan_unroll: int | None = None,
) -> Task:
    """The lm task. ``data_dir`` is not used (the corpus is ``text_dir``, or the stdlib)."""
    cfg = LMConfig(layers=layers, d_model=d_model, heads=heads, seq_len=seq_len, precision=precision, remat=remat,
                   scan_unroll=scan_unroll)
    if isinstance(text_bytes, bool) or not isinstance(text_bytes, int) or text_bytes < 1:
        raise ConfigError(fix(f"lm: text_bytes={text_bytes!r} must be a whole number >= 1.", "e.g. --text-bytes 1000000."))
    train_files, held_files = split_files(text_dir)
    train, held_out = _read(train_files, text_bytes), _read(held_files, max(text_bytes // 10, 1))
    _, init, loss_fn = lm_functions(cfg)
    return Task(
        name="lm",
        init=init,
        loss_fn=loss_fn,
        train_data={"tokens": windows(train, seq_len, "training")},
        eval_data={"tokens": windows(held_out, seq_len, _held_out_name(held_files))},
        defaults=DEFAULTS,
    )
