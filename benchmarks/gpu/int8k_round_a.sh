#!/bin/bash
# Round A of the 8-bit decode work (docs/kernels.md, "int8 decode at fp8 speed"): the decode
# variant sweep (benchmarks/kernels/decode_sweep.py, variants in int8k_round_a.txt), the int8
# vs fp8 prefill parts, and whether ncu is on the machine. Run from the repository root with
# PYTHONPATH=src; writes under $OUT_DIR.
set -u
OUT_DIR=${OUT_DIR:-/tmp/int8k}
mkdir -p "$OUT_DIR"
export OUT_DIR
here=$(cd "$(dirname "$0")/../.." && pwd)
echo "== ncu: $(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || echo none)"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
cd "$here/benchmarks/kernels"
timeout 52 python3 decode_sweep.py --jobs 12 $(grep -v '^#' "$here/benchmarks/gpu/int8k_round_a.txt")
timeout 15 python3 prefill_parts.py 1024
