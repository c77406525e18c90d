#!/usr/bin/env bash
# One command installs minisparse's dependencies on a CPU or a GPU machine.
#   CPU: torch==2.13.0 is pinned in requirements.txt, so pip takes the CPU build where one
#        is available locally instead of pulling the CUDA wheels.
#   GPU: MINISPARSE_GPU=1 installs the CUDA set of requirements-gpu.txt (torch 2.11.0 with
#        sglang 0.5.16, which pins it) in place of requirements.txt's torch/transformers pins,
#        then flash-attn-4 (requirements-flash-attn.txt says why apart).
#        Or keep a CUDA build of torch that is already installed: MINISPARSE_KEEP_TORCH=1.
# DeepSpeed builds from source and needs torch at build time, hence the second step with
# --no-build-isolation; DS_BUILD_OPS=0 defers its CUDA ops to JIT builds on first use.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python}
if [ "${MINISPARSE_GPU:-0}" = "1" ]; then
  grep -v -e '^torch==' -e '^transformers==' requirements.txt > /tmp/minisparse-req.txt
  $PY -m pip install -r requirements-gpu.txt -r /tmp/minisparse-req.txt
  $PY -m pip install -r requirements-flash-attn.txt
elif [ "${MINISPARSE_KEEP_TORCH:-0}" = "1" ]; then
  grep -v '^torch==' requirements.txt > /tmp/minisparse-req.txt
  $PY -m pip install -r /tmp/minisparse-req.txt
else
  $PY -m pip install -r requirements.txt
fi
DS_BUILD_OPS=0 $PY -m pip install --no-build-isolation -r requirements-deepspeed.txt
# A CPU build of torch brings no Triton; install it so the Triton kernels' tests run on
# the CPU through Triton's interpreter (a CUDA build of torch ships its own Triton).
if $PY -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then
  $PY -m pip install triton==3.6.0
fi
