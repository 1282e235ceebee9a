"""One of the two processes that measure the ``inter_host`` link for ``spmdkit calibrate``.

Started by :func:`spmdkit._calibrate.run_two_processes` under ``spmdkit launch -n 2
--host-devices-per-process 1``; the processes join through ``jax.distributed`` and time
the collectives over their 2 devices. Process 0 writes the points as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--sizes", type=int, nargs="+", required=True)
    p.add_argument("--kinds", nargs="+", required=True)
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--target-seconds", type=float, required=True)
    p.add_argument("--timeout", type=int, default=100)
    p.add_argument("--reps", nargs="*", default=[], metavar="KIND:BYTES:REPS",
                   help="repetitions to use instead of probing (a calibration replayed by --check)")
    a = p.parse_args(argv)

    import spmdkit
    from spmdkit._atomic import replace_text
    from spmdkit._launch import initialize_distributed

    spmdkit.use_host_devices(1)  # before any JAX work: one device per process
    initialize_distributed(timeout_s=a.timeout)
    import jax

    from spmdkit._calibrate_measure import measure_collectives

    reps = {(kind, int(nbytes)): int(r) for kind, nbytes, r in (item.split(":") for item in a.reps)}
    points, warnings = measure_collectives(jax.devices(), [jax.device_count()], a.sizes, a.kinds, "inter_host",
                                           rounds=a.rounds, target_s=a.target_seconds, reps=reps)
    # Whether this runtime runs a combined all-reduce as one call per operand (gloo does): the
    # planner then pays alpha per operand on this link (``per_operand`` in the target).
    from spmdkit._plan._processes import measure_process_links

    ratio = measure_process_links(kinds=("all_reduce",))["per_operand_ratio"]
    for p in points:
        p["per_operand_ratio"] = ratio
    if jax.process_index() == 0:
        replace_text(a.out, json.dumps({"measurements": points, "warnings": warnings,
                                        "processes": jax.process_count(), "devices": jax.device_count()}))


if __name__ == "__main__":
    main()
