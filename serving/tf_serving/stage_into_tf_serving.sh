#!/usr/bin/env bash
# Stages pkm_serve's op sources into a TensorFlow Serving checkout and links the
# op into tensorflow_model_server (TF Serving's custom-op guide, steps 1-2):
#
#   serving/tf_serving/stage_into_tf_serving.sh PKM_SERVE_ROOT TF_SERVING_ROOT
#
# Idempotent: a second run refreshes the sources and leaves the BUILD edit alone.
set -euo pipefail
if [[ $# -ne 2 ]]; then
  echo "usage: $0 PKM_SERVE_ROOT TF_SERVING_ROOT" >&2
  exit 2
fi
src=$(cd "$1" && pwd)
dst=$(cd "$2" && pwd)
servers_build="$dst/tensorflow_serving/model_servers/BUILD"
if [[ ! -f "$servers_build" ]]; then
  echo "error: $servers_build not found: is $dst a TensorFlow Serving checkout?" >&2
  exit 1
fi
for d in core tf cuda; do
  if [[ ! -d "$src/kernels/$d" ]]; then
    echo "error: $src/kernels/$d not found: is $src the pkm_serve repository?" >&2
    exit 1
  fi
done

ops="$dst/tensorflow_serving/custom_ops/pkm"
rm -rf "$ops"
mkdir -p "$ops/kernels"
for d in core tf cuda; do
  mkdir -p "$ops/kernels/$d"
  # Sources and headers only: no Makefile fragments, no tests.
  find "$src/kernels/$d" -maxdepth 1 -type f \( -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) \
    ! -name '*_test.cc' -exec cp {} "$ops/kernels/$d/" \;
done
# The source and flag lists BUILD loads (the same file the Makefile and the root BUILD read).
cp "$src/kernels/sources.bzl" "$ops/kernels/sources.bzl"
cp "$src/serving/tf_serving/BUILD.pkm_ops" "$ops/BUILD"

label='"//tensorflow_serving/custom_ops/pkm:pkm_ops"'
if grep -qF "$label" "$servers_build"; then
  echo "already linked: $label in $servers_build"
else
  # Prepend our target to whatever SUPPORTED_TENSORFLOW_OPS is built from.
  if ! grep -q '^SUPPORTED_TENSORFLOW_OPS = ' "$servers_build"; then
    echo "error: no 'SUPPORTED_TENSORFLOW_OPS = ' line in $servers_build; add $label to it by hand" >&2
    exit 1
  fi
  sed -i "s|^SUPPORTED_TENSORFLOW_OPS = |SUPPORTED_TENSORFLOW_OPS = [$label] + |" "$servers_build"
  echo "linked $label into SUPPORTED_TENSORFLOW_OPS ($servers_build)"
fi
echo "staged pkm ops into $ops"
