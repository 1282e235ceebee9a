"""Run a spmdkit command in this process, then print peak and final RSS (MiB) and page faults.

usage: python rss_cli.py train --task lm ...   (SPMDKIT_HOST_ALLOCATOR decides the allocator)
With RSS_TRIM=1 in the environment it then calls glibc's malloc_trim(0) and prints VmRSS again
(how much of the end RSS is free memory held in the heap). With RSS_SAMPLE=S it prints VmRSS
every S seconds while the command runs.
"""
import ctypes, json, os, resource, sys, time

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
if os.environ.get("RSS_SAMPLE"):
    import threading

    def sample(every=float(os.environ["RSS_SAMPLE"])):
        while True:
            time.sleep(every)
            print(f"RSSJSON t={time.perf_counter() - t:.0f}s VmRSS={status()['VmRSS']}", file=sys.stderr, flush=True)

    threading.Thread(target=sample, daemon=True).start()
rc = cli.main(sys.argv[1:])
wall = time.perf_counter() - t
ru = resource.getrusage(resource.RUSAGE_SELF)
print("RSSJSON " + json.dumps({"rc": rc, **status(), "minflt": ru.ru_minflt, "wall_s": round(wall, 1), "cpu_s": round(ru.ru_utime + ru.ru_stime, 1),
                               "host_memory": str(host_memory())}), file=sys.stderr)
if os.environ.get("RSS_TRIM") == "1":
    ctypes.CDLL(None).malloc_trim(0)
    print("RSSJSON after malloc_trim(0) " + json.dumps(status()), file=sys.stderr)
