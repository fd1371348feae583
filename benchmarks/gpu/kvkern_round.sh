#!/usr/bin/env bash
# One GPU job of the int8/K-centering kernels (issue 14): the GPU tests split into contiguous
# chunks run by parallel pytest processes (Triton compiles on the host's cores in parallel), then
# the 8-bit decode timing table and the fused-vs-unfused rotation store.
# Usage: OUT_DIR=dir bash benchmarks/gpu/kvkern_round.sh [test-s] [decode-bench-s] [store-bench-s]
set -u
OUT_DIR=${OUT_DIR:-/tmp/kvkern}
mkdir -p "$OUT_DIR"
T_TESTS=${1:-80}
T_BENCH=${2:-45}
T_STORE=${3:-15}
CHUNKS=${CHUNKS:-14}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
ids="$OUT_DIR/test_ids.txt"
{
  python3 -m pytest --collect-only -q -m gpu -p no:cacheprovider \
    tests/gpu/test_int8_kernels.py tests/gpu/test_decode_packed.py
  python3 -m pytest --collect-only -q -m gpu -p no:cacheprovider tests/gpu/test_kernels.py \
    tests/gpu/test_rope_store.py -k "store or rope or (test_decode and fp8_e4m3) or \
(test_prefill_backend and fp8_e4m3) or poisoned or backend_decode_steps"
} 2>/dev/null | grep "::" > "$ids"
n=$(wc -l < "$ids")
echo "$n GPU tests in $CHUNKS parallel chunks"
per=$(( (n + CHUNKS - 1) / CHUNKS ))
for ((c = 0; c < CHUNKS; c++)); do
  mapfile -t chunk < <(sed -n "$((c * per + 1)),$(((c + 1) * per))p" "$ids")
  [ ${#chunk[@]} -eq 0 ] && continue
  ( timeout "$T_TESTS" python3 -m pytest -v --tb=short -m gpu -p no:cacheprovider "${chunk[@]}" \
      > "$OUT_DIR/pytest_$c.txt" 2>&1; echo "rc=$?" >> "$OUT_DIR/pytest_$c.txt" ) &
done
wait
echo "== pytest summaries (rc=124: the chunk ran out of time)"
for f in "$OUT_DIR"/pytest_*.txt; do
  echo "-- $(basename "$f"): $(grep -cE "PASSED" "$f") passed, $(grep -cE "::[^ ]+ (FAILED|ERROR)" "$f") failed $(tail -1 "$f")"
  grep -E "(FAILED|ERROR)" "$f" | grep "::" | head -8
done
echo "== 8-bit decode (CUDA-graph replay)"
timeout "$T_BENCH" python3 benchmarks/kernels/int8_decode.py --quick 2>&1 | tee "$OUT_DIR/int8_decode.txt"
echo "== RoPE + rotated int8 store: fused vs unfused (CUDA-graph replay)"
timeout "$T_STORE" python3 benchmarks/kernels/rotation_store.py 2>&1 | tee "$OUT_DIR/rotation_store.txt"
