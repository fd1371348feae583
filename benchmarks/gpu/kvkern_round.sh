#!/usr/bin/env bash
# One GPU job of the int8/K-centering kernels (issue 14): GPU tests in parallel groups (Triton
# compiles on the host's cores in parallel), then the 8-bit decode timing table.
# Usage: OUT_DIR=dir bash benchmarks/gpu/kvkern_round.sh [test-s] [decode-bench-s] [store-bench-s]
set -u
OUT_DIR=${OUT_DIR:-/tmp/kvkern}
mkdir -p "$OUT_DIR"
T_TESTS=${1:-95}
T_BENCH=${2:-45}
T_STORE=${3:-20}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
I8=tests/gpu/test_int8_kernels.py
run() {  # name, pytest args...
  local name=$1; shift
  ( timeout "$T_TESTS" python3 -m pytest -q -m gpu -p no:cacheprovider "$@" \
      > "$OUT_DIR/pytest_$name.txt" 2>&1; echo "rc=$?" >> "$OUT_DIR/pytest_$name.txt" ) &
}
run i8store $I8 -k "store or rope"
run i8dec_hnd $I8 -k "test_int8_decode and HND"
run i8dec_hdn $I8 -k "test_int8_decode and HDN"
run i8prefill $I8 -k "test_int8_prefill"
run i8misc $I8 -k "window_and_softcap or graph_replay"
run i8backend $I8 -k "backend_steps or torch_reference"
run i8model $I8 -k "model_graph"
run packed tests/gpu/test_decode_packed.py
run reg_store tests/gpu/test_kernels.py tests/gpu/test_rope_store.py -k "store or rope"
run reg_decode tests/gpu/test_kernels.py -k "test_decode and fp8_e4m3"
run reg_prefill tests/gpu/test_kernels.py -k "(test_prefill_backend and fp8_e4m3) or poisoned or backend_decode_steps"
wait
echo "== pytest summaries"
for f in "$OUT_DIR"/pytest_*.txt; do
  echo "-- $(basename "$f"): $(grep -E '(passed|failed|error)' "$f" | tail -1) $(tail -1 "$f")"
  grep -E "^(FAILED|ERROR)" "$f" | head -8
done
echo "== 8-bit decode (CUDA-graph replay)"
timeout "$T_BENCH" python3 benchmarks/kernels/int8_decode.py --quick 2>&1 | tee "$OUT_DIR/int8_decode.txt"
echo "== RoPE + rotated int8 store: fused vs unfused (CUDA-graph replay)"
timeout "$T_STORE" python3 benchmarks/kernels/rotation_store.py 2>&1 | tee "$OUT_DIR/rotation_store.txt"
