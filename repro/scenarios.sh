#!/bin/bash
# Each scenario: probe.py's status vs real page faults per call, and `spmdkit devices --json`'s host_memory.
# usage: PY=/work/venv-new/bin/python bash scenarios.sh
PY=${PY:-/work/venv-new/bin/python}; HERE=$(dirname "$0"); SPMDKIT=$(dirname $PY)/spmdkit
JE=${JE:-/tmp/hh/je/usr/lib/x86_64-linux-gnu/libjemalloc.so.2}
run() {
  local name=$1; shift
  echo "== $name"
  env -u MALLOC_ARENA_MAX -u MALLOC_MMAP_MAX_ -u MALLOC_TRIM_THRESHOLD_ -u SPMDKIT_HOST_ALLOCATOR -u GLIBC_TUNABLES \
    "$@" timeout 120 nice -n 10 $PY $HERE/probe.py 2>&1 | tail -1
  env -u MALLOC_ARENA_MAX -u MALLOC_MMAP_MAX_ -u MALLOC_TRIM_THRESHOLD_ -u SPMDKIT_HOST_ALLOCATOR -u GLIBC_TUNABLES \
    "$@" timeout 120 nice -n 10 $SPMDKIT devices --json 2>&1 | grep -A3 -E '"host_memory"|rror' | tr -s ' \n' ' '; echo
}
run "jemalloc LD_PRELOAD" LD_PRELOAD=$JE
run "MALLOC_ARENA_MAX=2" MALLOC_ARENA_MAX=2
run "SPMDKIT_HOST_ALLOCATOR=''" SPMDKIT_HOST_ALLOCATOR=
run "SYSTEM" SPMDKIT_HOST_ALLOCATOR=SYSTEM
run "off" SPMDKIT_HOST_ALLOCATOR=off
run "'reuse '" "SPMDKIT_HOST_ALLOCATOR=reuse "
run "TUNABLES arena_max=8" GLIBC_TUNABLES=glibc.malloc.arena_max=8
run "TUNABLES mmap_threshold=4096" GLIBC_TUNABLES=glibc.malloc.mmap_threshold=4096
run "env all three" MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647
run "env three + TUNABLES first (mmap_max=65536)" GLIBC_TUNABLES=glibc.malloc.mmap_max=65536 MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647
run "env three + TUNABLES last" MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647 GLIBC_TUNABLES=glibc.malloc.mmap_max=65536
# a child of a reusing process (inherited MALLOC_*) that opts out: really reused, was reported "system default"
run "inherited MALLOC_* + SPMDKIT_HOST_ALLOCATOR=system" MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647 SPMDKIT_HOST_ALLOCATOR=system
