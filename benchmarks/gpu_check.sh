#!/usr/bin/env bash
# The paper config on one GPU: tokens/s and MFU of the train step and the forward pass, against
# the bf16 matmul peak measured in the same run and against a ~790 TFLOP/s H200 bf16 peak, with
# memory. Sized to finish within 5 minutes on one H200 (compiles included).
#
#   bash benchmarks/gpu_check.sh [extra config overrides, e.g. data.batch_size=32]
#
# bfloat16 compute (float32 params), n=2048, batch 16, remat dots (configs/paper.py);
# cuDNN attention and XLA attention side by side. Prints the bench JSON.
set -euo pipefail
cd "$(dirname "$0")/.."

python -c 'import jax, sys; b = jax.default_backend(); print(jax.devices()); \
sys.exit(0 if b == "gpu" else f"gpu_check.sh needs a GPU; JAX runs on {b!r}")'

overrides="model.dtype=bfloat16,data.batch_size=16${1:+,$1}"
timeout 290 python -m benchmarks.bench \
  --config "configs/paper.py:${overrides}" \
  --programs train,forward --repeats 5 \
  --variant model.attention=cudnn --variant model.attention=xla \
  --peak_dtype bfloat16 --peak_size 8192 --nominal_peak_tflops 790
