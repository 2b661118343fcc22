#!/bin/bash
# In-process A/B of the core across source trees (bench only):
#   bench/core_ab.sh PROGRAM "B K D N[,B K D N...]" CALLS TREE... [-- OPTIONS of PROGRAM]
# PROGRAM is one of bench/native's timers that dlopen core builds: int8_core_ab (the int8 and
# float32 forward; bench/int8_core_ab.sh) or backward_core_ab (the dense float32 backward).
# Each TREE (a checkout of this repository, e.g. a `git worktree` of another commit) has its
# kernels/core built as one shared library (bench/build_core.sh);
# PROGRAM then times them in one process. Example, this tree against main:
#   git worktree add --detach /tmp/main main && bench/core_ab.sh backward_core_ab "2048 128 512 65536" 20 /tmp/main .
set -euo pipefail
program=$1; shape=$2; calls=$3; shift 3
case $program in int8_core_ab|backward_core_ab) ;; *) echo "core_ab.sh: unknown program $program" >&2; exit 2;; esac
trees=(); opts=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; opts=("$@"); break; fi
  trees+=("$1"); shift
done
here=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
libs=()
for i in "${!trees[@]}"; do
  src=$(cd "${trees[$i]}" && pwd)
  "$here/bench/build_core.sh" "$src" "$work/core_$i.so"
  libs+=("$work/core_$i.so")
  echo "build $i: $src ($(git -C "$src" rev-parse --short HEAD 2>/dev/null || echo '?')$(git -C "$src" diff --quiet 2>/dev/null || echo ', modified'))"
done
g++ -std=c++17 -O2 -I"$here" "$here/bench/native/$program.cc" -o "$work/$program" -ldl -lpthread
IFS=, read -ra shapes <<< "$shape"
for s in "${shapes[@]}"; do
  # shellcheck disable=SC2086
  "$work/$program" $s "$calls" "${opts[@]}" -- "${libs[@]}"
done
