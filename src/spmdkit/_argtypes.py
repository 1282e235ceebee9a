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
    if not text.strip():  # "$DIR " of an unset variable: a folder named by blanks, made without a word
        raise argparse.ArgumentTypeError(f"expected a path, got only blanks {text!r} (an unset shell variable?)")
    # A name past the file system's 255 bytes was a raw OSError (File name too long) from the
    # first look at the path, exit code 1, in data write, train --data/--out and the rest.
    longest = max(text.split("/"), key=lambda name: len(name.encode(errors="surrogateescape")))
    if len(longest.encode(errors="surrogateescape")) > 255:
        raise argparse.ArgumentTypeError(f"a name in the path is {len(longest.encode(errors='surrogateescape'))} "
                                         f"bytes ({longest[:20]}...); file systems take at most 255: shorten it")
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
