#!/bin/bash
# b1v GPU round A (80 s slot): batch invariance of cuBLAS vs rows_gemm rows (is a row a function
# of the tile? of the split?), rows_gemm speed and tile/split sweep against cuBLAS and the
# batch-1 GEMV, a step's chain of products with PDL off/on, then the model-level GPU test.
# Kernels are compiled first in 14 processes.
set -u
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
TILES="16,16,256,4,4;16,16,256,4,4,0,2;16,16,256,4,4,0,4;16,16,512,4,3,0,2;16,16,128,4,4,0,4;16,32,256,4,4;16,32,256,4,4,0,2;16,64,128,4,3;16,128,128,4,3,1;32,64,128,4,3;64,64,64,4,3;64,128,64,4,3,1;64,128,64,8,3;64,64,64,4,3,0,2;64,64,128,4,3,0,4;128,64,64,8,3,0,2"
INV="16,16,256,4,4;16,64,128,4,3;64,64,64,4,3;128,64,64,8,3;16,128,128,4,3,1;64,128,64,4,3,1;16,16,256,4,4,0,2"
el "precompile"
timeout 20 python3 benchmarks/kernels/rows_precompile.py --model-shapes --pdl off,on --tiles "$TILES" \
  --variants plain,norm_add,gated --workers 15 2>&1 | tail -4
el "probe: invariance, speed, then a step's chain of products (best tiles) with PDL off/on"
timeout 24 python3 benchmarks/kernels/rows_gemm_probe.py --parts inv,time,chain --ms 1,2,3,8,33,64,256 \
  --time-ms 1,64,256 --reps 20 --tiles "$TILES" --inv-tiles "$INV" --json "$OUT_DIR/probe.json" 2>&1 \
  | grep -v "^  tile" | tail -40
el "pytest"
timeout $((78 - $(date +%s) + T0)) python3 -m pytest -q -m gpu tests/gpu/test_rows_gemm_cuda.py \
  -k "request_logits and True" -v -x --tb=short 2>&1 | grep -E "PASS|FAIL|Error|assert|error" | tail -20
el "done"
