#!/bin/bash
# The int4 decode's GPU job (lead's queue): GPU kernel tests and the launch sweep in parallel
# compile processes first (Triton's cache), then the timed sweep alone on the GPU.
#   OUT_DIR=... bash benchmarks/kernels/int4_gpu_round.sh
set -u
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
el "start: $(nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader 2>&1)"
B=benchmarks/kernels/int4_decode_bench.py
(timeout 55 python3 -m pytest -q -s -m gpu tests/gpu/test_int4_decode.py -k "not 256 and not float32 and not folded" \
   > "$OUT_DIR/pytest_a.txt" 2>&1; echo "rc=$?" >> "$OUT_DIR/pytest_a.txt") &
(timeout 55 python3 -m pytest -q -s -m gpu tests/gpu/test_int4_decode.py -k "256 or float32 or folded" \
   > "$OUT_DIR/pytest_b.txt" 2>&1; echo "rc=$?" >> "$OUT_DIR/pytest_b.txt") &
N=11
for i in $(seq 0 $((N - 1))); do
  timeout 45 python3 $B --sweep --compile-only --part $i --parts $N > "$OUT_DIR/compile_$i.txt" 2>&1 &
done
wait
el "compiled + tests"
timeout 40 python3 $B --sweep --json "$OUT_DIR/sweep.json" --dump "$OUT_DIR/sass" > "$OUT_DIR/sweep.txt" 2>&1
el "sweep rc=$?"
for f in "$OUT_DIR"/compile_*.txt; do [ -s "$f" ] && { echo "== $f"; tail -5 "$f"; }; done
echo "== tests"; grep -h "rel\|error\|passed\|failed\|rc=" "$OUT_DIR"/pytest_*.txt | tail -30
echo "== sweep"; cat "$OUT_DIR/sweep.txt"
el "best effort in the slot's rest: the triton int4 backend's GPU tests, then ncu of the default launch"
timeout 45 python3 -m pytest -q -s -m gpu tests/gpu/test_int4_triton.py > "$OUT_DIR/pytest_triton.txt" 2>&1
grep -E "passed|failed|rel|identical|difference|Error|assert" "$OUT_DIR/pytest_triton.txt" | tail -25
el "ncu"
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
timeout 25 $NCU --clock-control none --kernel-name regex:_int4_decode_kernel --launch-skip 3 --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \
  python3 $B --only 0 > "$OUT_DIR/ncu.txt" 2>&1
grep -E "Duration|Throughput|Memory \[%\]|Executed Ipc|Issue Slots|Registers|Achieved Occupancy|Theoretical Occupancy|Stall|Warp Cycles|Block Limit" "$OUT_DIR/ncu.txt" | head -40
el "done"
