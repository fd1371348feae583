#!/bin/bash
# b1v round A: batch-invariance probe (cuBLAS vs rows_gemm), GPU tests, first timing
set -u
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
el "probe: invariance"
timeout 30 python3 benchmarks/kernels/rows_gemm_probe.py --parts inv --json "$OUT_DIR/inv.json" 2>&1 | tail -20
el "pytest"
timeout 25 python3 -m pytest -q -x -m gpu tests/gpu/test_rows_gemm_cuda.py -k "float64 or invariant" 2>&1 | tail -15
el "probe: speed"
timeout 30 python3 benchmarks/kernels/rows_gemm_probe.py --parts time --time-ms 1,64,256 --reps 20 \
  --tiles "16,16,256,4,4;16,32,256,4,4;16,64,128,4,3;16,16,512,4,3;64,64,64,4,3" --json "$OUT_DIR/time.json" 2>&1 | tail -40
el "done"
