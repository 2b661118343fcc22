#!/bin/bash
# One source tree's kernels/core as a shared library, for the bench timers that dlopen core builds
# (bench/core_ab.sh, bench/core_sweep.py):
#   bench/build_core.sh TREE OUT.so
# With the tree's own core flags (PKM_CXXSTD and PKM_CORE_COPTS of its kernels/sources.bzl; -O3
# -DNDEBUG where it has none) but its symbols left visible (the timers look the forward up by name),
# all bound locally (-Bsymbolic) so that two builds loaded in one process do not mix.
set -euo pipefail
src=$(cd "$1" && pwd); out=$2
here=$(cd "$(dirname "$0")/.." && pwd)
flags=$(python3 "$here/kernels/bzl_to_make.py" "$src/kernels/sources.bzl" 2>/dev/null |
        sed -n 's/^PKM_\(CXXSTD\|CORE_COPTS\) := //p' | tr '\n' ' ' | sed 's/-fvisibility=hidden//')
[[ $flags == *-O* ]] || flags="-std=c++17 -O3 -DNDEBUG"
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
pids=()
for f in "$src"/kernels/core/*.cc; do
  case $f in *_test.cc|*/reference.cc) continue;; esac
  # shellcheck disable=SC2086
  g++ $flags -w -fPIC -I"$src" -c "$f" -o "$work/$(basename "${f%.cc}").o" & pids+=($!)
  if [ ${#pids[@]} -ge "$(nproc)" ]; then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
done
for p in "${pids[@]}"; do wait "$p"; done
g++ -shared -Wl,-Bsymbolic "$work"/*.o -o "$out" -lpthread
