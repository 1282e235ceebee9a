"""What an all-reduce and an all-gather over each group size of 8 simulated devices in one
process add to a trip between computation, against the price of the link a loop of nothing but
collectives measures (BENCHMARKS.md, "plan", run z): why the cpu target of a lone process
prices each group size by a link timed between computation.

    python tools/inprocess_groups.py          # ROUNDS=15 KIB=4,64,256,1024 by default

Each case is a loop of 10 trips on all 8 devices: a (64 x 256) @ (256 x 256) matmul per device,
then the collective over groups of 2, 4 or 8 devices (each waiting for the other), or the same
arithmetic without it; the cases in rotated rounds. Printed per kind, group and payload: what the
collective added per trip (the median over rounds of with minus without), the loop link's price
(alpha-beta from ``measure_collective`` over all 8 devices, scaled by the ring's steps) and
their ratio.
"""

import os
import statistics

import jax

jax.config.update("jax_num_cpu_devices", 8)

from spmdkit._target import Target, _between_case, _interleaved, collective_time, measure_collective  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", 15))
SIZES = tuple(int(k) * 1024 for k in os.environ.get("KIB", "4,64,256,1024").split(","))
KINDS = ("all_reduce", "all_gather")


def main():
    loops = {kind: measure_collective(kind, 8) for kind in KINDS}
    target = Target("loop", "measure_collective", 8, {"float32": 1e12}, 1e11, {"intra_host": loops["all_reduce"]},
                    collectives={kind: {"intra_host": link} for kind, link in loops.items()})
    devices = [jax.local_devices()[:8]]
    cases = {(g, kind, size): _between_case(kind, devices, g, size)
             for g in (2, 4, 8) for size in SIZES for kind in (None, *KINDS)}
    rounds = _interleaved(cases, ROUNDS)
    print(f"{ROUNDS} rounds; the loop's links: " + ", ".join(f"{k} {ab.alpha:.3g} s + {ab.beta:.3g} s/B"
                                                            for k, ab in loops.items()))
    for kind in KINDS:
        for g in (2, 4, 8):
            for size in SIZES:
                added = [a - b for a, b in zip(rounds[(g, kind, size)], rounds[(g, None, size)])]
                q = statistics.quantiles(added, n=4)
                priced = collective_time(target, kind, size, g, "intra_host")
                print(f"{kind:10s} group {g} {size // 1024:5d} KiB: adds {statistics.median(added) * 1e6:7.1f} us "
                      f"(IQR {q[0] * 1e6:.0f}-{q[2] * 1e6:.0f}), loop link prices {priced * 1e6:7.1f} us, "
                      f"ratio {statistics.median(added) / priced:.2f}")


if __name__ == "__main__":
    main()
