#!/bin/bash
# b1v GPU round A (80 s slot): batch invariance of cuBLAS vs rows_gemm rows (and is a row a
# function of the tile?), rows_gemm speed and tile sweep against cuBLAS and the batch-1 GEMV,
# then the GPU tests of the invariant path. Kernels are compiled first in 14 processes.
set -u
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
TILES="16,16,256,4,4;16,16,512,4,3;16,16,512,4,4;16,16,256,4,6;16,32,256,4,4;16,64,128,4,3;16,64,256,4,3,1;16,128,128,4,3,1;32,64,128,4,3;64,64,64,4,3;64,128,64,8,3;128,64,64,8,3;64,128,64,4,3,1"
INV="16,16,256,4,4;16,64,128,4,3;64,64,64,4,3;128,64,64,8,3;16,128,128,4,3,1;64,128,64,4,3,1"
el "precompile"
timeout 24 python3 benchmarks/kernels/rows_precompile.py --model-shapes --pdl off,on --tiles "$TILES" \
  --variants plain,norm_add,gated --workers 14 2>&1 | tail -3
el "probe: invariance, speed, a step's chain of products with PDL off/on"
timeout 31 python3 benchmarks/kernels/rows_gemm_probe.py --parts inv,time,chain --ms 1,2,3,8,33,64,256 \
  --time-ms 1,64,256 --reps 20 --tiles "$TILES" --inv-tiles "$INV" --json "$OUT_DIR/probe.json" 2>&1 | tail -40
el "pytest"
timeout 22 python3 -m pytest -q -m gpu tests/gpu/test_rows_gemm_cuda.py -k request_logits -v -x --tb=short 2>&1 | grep -v "^$" | tail -30
el "done"
