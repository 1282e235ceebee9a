"""Run a spmdkit command in this process, then print peak and final RSS (MiB) and page faults.

usage: python rss_cli.py train --task lm ...   (SPMDKIT_HOST_ALLOCATOR decides the allocator)
"""
import json, resource, sys, time

import spmdkit._cli as cli
from spmdkit._host_memory import host_memory


def status():
    out = {}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in ("VmHWM", "VmRSS"):
            out[k] = int(v.split()[0]) // 1024
    return out


t = time.perf_counter()
rc = cli.main(sys.argv[1:])
wall = time.perf_counter() - t
ru = resource.getrusage(resource.RUSAGE_SELF)
print("RSSJSON " + json.dumps({"rc": rc, **status(), "minflt": ru.ru_minflt, "wall_s": round(wall, 1),
                               "host_memory": str(host_memory())}), file=sys.stderr)
