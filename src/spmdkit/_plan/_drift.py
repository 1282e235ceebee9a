"""Whether this machine's links changed between pricing a plan and measuring it.

The ``cpu`` target times its collectives once, when the plan starts; measuring the candidates
takes minutes more. A machine whose links change meanwhile (a shared host moving its cores,
another job taking the memory bus) measures the collective-heavy candidates at another price
than the plan gave them, and their measured order follows the machine, not the layouts. So
the all-reduce the plan was priced with is timed again just before the rounds and just after
them, and the measurement says when it moved.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

PROBE_BYTES = 2**20
CHANGED = 1.5  # a factor between the priced and a re-timed all-reduce that marks the links as changed


def _seconds(link: Any, n: int, nbytes: int = PROBE_BYTES) -> float:
    from spmdkit._target import steps_and_wire

    steps, wire = steps_and_wire("all_reduce", n, nbytes)
    return steps * link.alpha + wire * link.beta


def priced_link(about: dict[str, Any]) -> tuple[float, float] | None:
    """The loop all-reduce's (alpha, beta) a plan was priced with when its target was this
    machine measured at plan time (``about``: the plan's ``target``), else None: a target file
    describes other hardware, or this one at another time, on purpose."""
    if not str(about.get("source", "")).startswith("measured at plan time"):
        return None
    link = about.get("file", {}).get("collectives", {}).get("all_reduce", {}).get("intra_host")
    return (link["alpha"], link["beta"]) if link else None


def links_seen(priced: tuple[float, float], n: int, before: Any, after: Any) -> dict[str, Any]:
    """What a ``PROBE_BYTES`` all-reduce over ``n`` devices cost as priced, and as timed before
    and after the rounds (``Link``s or None), and whether either is ``CHANGED`` times apart.

    Example:
        >>> from spmdkit._target import Link
        >>> seen = links_seen((1e-5, 1e-9), 8, Link(1e-5, 1.1e-9), Link(1e-5, 2.5e-10))
        >>> round(seen["priced_s"] * 1e6), round(seen["after_rounds_s"] * 1e6), seen["changed"]
        (1975, 599, True)
    """
    from spmdkit._target import Link

    priced_s = _seconds(Link(*priced), n)
    seen = {"bytes": PROBE_BYTES, "devices": n, "priced_s": priced_s,
            "before_rounds_s": _seconds(before, n) if before else None,
            "after_rounds_s": _seconds(after, n) if after else None}
    timed = [s for s in (seen["before_rounds_s"], seen["after_rounds_s"]) if s]
    seen["changed"] = any(max(s, priced_s) > CHANGED * min(s, priced_s) for s in timed)
    return seen


def watched(about: dict[str, Any], n: int, rounds: int, measure: Callable[[], dict[str, Any]],
            time_link: Callable[[int], Any] | None = None) -> dict[str, Any]:
    """``measure()``'s result with ``links`` (:func:`links_seen`) when the plan was priced with
    this machine's links measured at its start (:func:`priced_link`); ``measure()`` alone else.
    ``time_link(n)``: the all-reduce's ``Link`` now (default: as the ``cpu`` target times it).
    A Ctrl-C while timing it is a :class:`MeasureInterrupted` of the ``rounds``, as in them."""
    from spmdkit._plan._report import MeasureInterrupted

    priced = priced_link(about)
    if priced is None or n < 2:
        return measure()
    if time_link is None:
        from spmdkit._target import measure_collective

        time_link = lambda k: measure_collective("all_reduce", k)  # noqa: E731
    try:
        before = time_link(n)
    except KeyboardInterrupt:
        raise MeasureInterrupted(None, 0, rounds) from None
    measured = measure()
    try:
        after = time_link(n)
    except KeyboardInterrupt:  # every round is measured: keep them, not marked as cut short
        stop = MeasureInterrupted(measured, rounds, rounds)
        measured.pop("interrupted", None)
        raise stop from None
    measured["links"] = links_seen(priced, n, before, after)
    return measured


def links_line(seen: dict[str, Any]) -> str:
    """The line ``spmdkit plan --measure`` prints about :func:`links_seen`."""
    times = [f"{seen[key] * 1e3:.3f} ms {when}" for when, key in (("just before the rounds", "before_rounds_s"),
                                                                    ("just after them", "after_rounds_s")) if seen[key]]
    line = (f"this machine's links while measuring: a {seen['bytes'] // 2**20} MiB all-reduce over {seen['devices']} "
            f"devices, priced at {seen['priced_s'] * 1e3:.3f} ms, took " + " and ".join(times))
    if seen["changed"]:
        line += (f" - more than {CHANGED:g} times apart: the machine changed between pricing and measuring, so the "
                 "measured order of candidates that differ in their collectives follows the machine as much as the "
                 "layouts; plan and measure again")
    return line
