#!/bin/bash
# b1v GPU round B (08:50, 75-s slot): the GPU tests the merge relies on, in 8 pytest workers
# holding a lock, while three runners start: this branch (bf16, fp8) and main (main_src/, the
# tree this branch started from: its seed timing syncs every step, so it also reports the steps
# back to back); then each measures alone.
set -u
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
LOCK=/tmp/b1v_gpu.lock
BAR=/tmp/b1v_barrier
rm -rf "$LOCK" "$BAR"
SEL="float64 or rows_are or (request_logits and (64-True or None-False-bfloat16-triton)) or graph_decode or backends_agree or model_cuda or (overlap and True)"
python3 -c "import fcntl,subprocess,sys; f=open(sys.argv[1],'a+'); fcntl.flock(f,fcntl.LOCK_EX); sys.exit(subprocess.call(sys.argv[2:]))" \
  "$LOCK" timeout 46 python3 -m pytest -n 8 -m gpu -p no:cacheprovider -rfE --tb=short \
  tests/gpu/test_rows_gemm_cuda.py tests/gpu/test_cuda_graph.py tests/gpu/test_e2e_backends.py \
  tests/gpu/test_fused_kernels.py tests/gpu/test_overlap_cuda.py -k "$SEL" \
  > "$OUT_DIR/pytest.txt" 2>&1 &
TESTS=$!
sleep 1
run() {  # label, pythonpath, extra args
  PYTHONPATH="$2" timeout $((73 - $(date +%s) + T0)) python3 benchmarks/engine/ab_decode_step.py \
    --label "$1" --points 1x1024,64x1024,1x16384 --steps 32 --repeats 3 --lock "$LOCK" \
    --barrier "$BAR:4" "${@:3}" > "$OUT_DIR/ab_$1.txt" 2>&1 &
}
run fp8 "$PWD/src:/tmp/site" --kv-dtypes fp8_e4m3 --overlapped
run bf16 "$PWD/src:/tmp/site" --kv-dtypes bfloat16 --overlapped
run main_fp8 "$PWD/main_src:/tmp/site" --kv-dtypes fp8_e4m3 --overlapped --one-token off
run main_bf16 "$PWD/main_src:/tmp/site" --kv-dtypes bfloat16 --overlapped --one-token off
wait $TESTS
el "tests done"
grep -E "passed|failed|FAILED|ERROR" "$OUT_DIR/pytest.txt" | cut -c1-240 | tail -25
tail -c 600 "$OUT_DIR/pytest.txt"
wait
el "benchmarks done"
for f in "$OUT_DIR"/ab_*.txt; do echo "== $(basename $f)"; grep -E "tok/s|host graphs|kernels/step" "$f" | cut -c1-160; done
el "done"
