#!/usr/bin/env bash
# The GPU proof of issue 34 in one command; benchmarks/gpu_proof.py says what it runs and writes.
#   bash benchmarks/gpu_proof.sh [--only STEP...]   on the lent GPU machine, after gpu-unpack.sh (gpu-bundle.md)
#   bash benchmarks/gpu_proof.sh --cpu              the steps' CPU forms (CI): the driver proven end to end
# Wheels carried in .bundle/hf (transformers for GPT-2, which the bundle lacks) are unpacked beside the bundle.
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ ${1-} == --cpu ]]; then
  exec python3 benchmarks/gpu_proof.py "$@"  # the environment the tests run in (a venv)
fi
extra=()
if compgen -G ".bundle/hf/*.whl" >/dev/null; then
  mkdir -p /tmp/og/hf
  for wheel in .bundle/hf/*.whl; do python3 -m zipfile -e "$wheel" /tmp/og/hf; done
  extra=(--extra-path /tmp/og/hf)
fi
exec python3 benchmarks/gpu_proof.py "${extra[@]}" "$@"
