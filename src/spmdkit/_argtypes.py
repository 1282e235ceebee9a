"""Value types of the command line's flags that more than one command's parser uses."""

from __future__ import annotations

import argparse


def path_arg(text: str) -> str:
    """A file or directory flag's value, refused when empty.

    An empty value is what ``--config "$CONFIG"`` passes when the shell variable is unset:
    ``--config ""`` trained with the defaults, ``--out ""`` wrote into the current directory
    and ``spmdkit checkpoints ""`` listed it, none with a word.

    >>> path_arg("runs/a")
    'runs/a'
    """
    if text == "":
        raise argparse.ArgumentTypeError("expected a path, got an empty string (an unset shell variable?)")
    return text


def nonblank_arg(text: str) -> str:
    """A flag's value that must say something (``--rules``, ``--mesh``): ``--rules ""`` was taken
    as not given, so a sharded run used the ``dp`` preset without a word.

    >>> nonblank_arg("fsdp+tp")
    'fsdp+tp'
    """
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a value, got {text!r} (an unset shell variable?)")
    return text
