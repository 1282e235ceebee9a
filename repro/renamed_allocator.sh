#!/bin/bash
# jemalloc preloaded under a file name without "jemalloc": spmdkit said "reused (set by spmdkit in
# this process)" while jemalloc served malloc and every call faulted ~19,000 pages.
# usage: bash renamed_allocator.sh   (needs the libjemalloc2 .deb in /var/cache/apt/archives)
set -e
D=$(mktemp -d); dpkg -x /var/cache/apt/archives/libjemalloc2_5.3.0-1_amd64.deb $D
cp $D/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 $D/libfast.so
env -u MALLOC_ARENA_MAX -u MALLOC_MMAP_MAX_ -u MALLOC_TRIM_THRESHOLD_ -u SPMDKIT_HOST_ALLOCATOR \
  LD_PRELOAD=$D/libfast.so timeout 120 ${PY:-/work/venv-new/bin/python} $(dirname "$0")/probe.py | tail -1
rm -rf $D
