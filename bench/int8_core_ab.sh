#!/bin/bash
# In-process A/B of the core's int8 and float32 forward across source trees (bench only):
#   bench/int8_core_ab.sh "B K D N[,B K D N...]" CALLS TREE... [-- OPTIONS of int8_core_ab]
# Each TREE (a checkout of this repository, e.g. a `git worktree` of another commit) has its
# kernels/core built as one shared library (all symbols bound locally, so the builds do not mix);
# bench/native/int8_core_ab.cc then times them in one process. Example, this tree against main:
#   git worktree add --detach /tmp/main main && bench/int8_core_ab.sh "64 128 512 262144" 300 /tmp/main .
set -euo pipefail
shape=$1; calls=$2; shift 2
trees=(); opts=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; opts=("$@"); break; fi
  trees+=("$1"); shift
done
here=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
libs=()
for i in "${!trees[@]}"; do
  src=$(cd "${trees[$i]}" && pwd); mkdir -p "$work/$i"
  for f in "$src"/kernels/core/*.cc; do
    case $f in *_test.cc|*/reference.cc) continue;; esac
    g++ -std=c++17 -O3 -DNDEBUG -fPIC -I"$src" -c "$f" -o "$work/$i/$(basename "${f%.cc}").o"
  done
  g++ -shared -Wl,-Bsymbolic "$work/$i"/*.o -o "$work/core_$i.so" -lpthread
  libs+=("$work/core_$i.so")
  echo "build $i: $src ($(git -C "$src" rev-parse --short HEAD 2>/dev/null || echo '?')$(git -C "$src" diff --quiet 2>/dev/null || echo ', modified'))"
done
g++ -std=c++17 -O2 -I"$here" "$here/bench/native/int8_core_ab.cc" -o "$work/int8_core_ab" -ldl
IFS=, read -ra shapes <<< "$shape"
for s in "${shapes[@]}"; do
  # shellcheck disable=SC2086
  "$work/int8_core_ab" $s "$calls" "${opts[@]}" -- "${libs[@]}"
done
