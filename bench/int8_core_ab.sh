#!/bin/bash
# In-process A/B of the core's int8 and float32 forward across source trees (bench only):
#   bench/int8_core_ab.sh "B K D N[,B K D N...]" CALLS TREE... [-- OPTIONS of int8_core_ab]
# bench/core_ab.sh with bench/native/int8_core_ab.cc. Example, this tree against main:
#   git worktree add --detach /tmp/main main && bench/int8_core_ab.sh "64 128 512 262144" 300 /tmp/main .
exec "$(dirname "$0")/core_ab.sh" int8_core_ab "$@"
