#!/usr/bin/env bash
# Issue 16's GPU round in ONE call on a 2-GPU machine (`nvidia-h200-x2`), cold, in under 10
# minutes:
#   1. the tensor-parallel GPU tests whose CUDA graphs hold the all-reduces (triton, every model
#      family: Llama, Gemma 2/3, DeepSeek-V2), TP=2 against TP=1;
#   2. `kvfit bench seed` on the Llama-3.1-8B shape (random weights) at TP=1 and at TP=2, bf16
#      and fp8_e4m3: batch-1 decode, batch 64 at 1k/8k/16k, prefill, KV tokens;
#   3. the table of issue 16 (benchmarks/tp/tp_table.py: TP=2 / TP=1 against 1.6x, 1.7x, 2x)
#      and `kvfit plan` at TP=1/2;
#   4. the rest of tests/gpu/test_tensor_parallel_cuda.py (eager, FlashInfer, reference backend)
#      with the time left.
# Run from anywhere in the repository (or a copy of it):  bash benchmarks/gpu/tp_round.sh
# Writes under $OUT_DIR (default ./out/tp_round): *.log, tp1/ and tp2/ (seed.json, seed.md),
# table.md. Each step has a timeout (seconds, overridable: T_TESTS1, T_SEED1, T_SEED2,
# T_TESTS2) and the whole run stops starting steps after TOTAL_S (default 570).
# NVLink multicast stays off (the device docs: it can take the host's GPUs out of service).
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT_DIR=${OUT_DIR:-$PWD/out/tp_round}
mkdir -p "$OUT_DIR"
TOTAL_S=${TOTAL_S:-570}
BACKEND=${BACKEND:-triton}  # no JIT compile on a cold machine (FlashInfer's fp8 would)
CFG=src/kvfit/bench/configs/llama-3.1-8b.json
START=$SECONDS

# step NAME SECONDS CMD...: run CMD under `timeout` (never past TOTAL_S), log to NAME.log
step() {
  local name=$1 want=$2
  shift 2
  local left=$((TOTAL_S - (SECONDS - START)))
  if [ "$left" -lt 20 ]; then
    echo "== $name: skipped, ${left}s left of ${TOTAL_S}s"
    return 0
  fi
  local limit=$((want < left ? want : left))
  echo "== $name (limit ${limit}s, $((SECONDS - START))s elapsed)"
  timeout -k 10 "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT_DIR/$name.log"
  echo "== $name: rc=$rc$([ $rc = 124 ] && echo ' (cut by its time limit)')"
}

nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total --format=csv,noheader
GPUS=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
echo "GPUs: $GPUS; NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE; backend $BACKEND"
if [ "$GPUS" -lt 2 ]; then
  echo "tp_round needs 2 GPUs (this machine has $GPUS): nothing run"
  exit 0
fi

TESTS=tests/gpu/test_tensor_parallel_cuda.py
step tests_graphs "${T_TESTS1:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider -rs \
  "$TESTS" -k "(triton and False) or graphs"
SEED=(python3 -m kvfit.cli bench seed --model "$CFG" --kv-dtypes bfloat16,fp8_e4m3
      --contexts 1024,8192,16384 --batches 1,64 --steps 32 --prefill-len 8192
      --attention-backend "$BACKEND")
step seed_tp1 "${T_SEED1:-150}" "${SEED[@]}" --tensor-parallel-size 1 --out "$OUT_DIR/tp1"
step seed_tp2 "${T_SEED2:-170}" "${SEED[@]}" --tensor-parallel-size 2 --out "$OUT_DIR/tp2"
for tp in 1 2; do
  python3 -m kvfit.cli plan --model "$CFG" --kv-dtype bfloat16 fp8_e4m3 \
    --tp-size $tp --memory 100GiB --max-model-len 16800 --attention-backend "$BACKEND" \
    > "$OUT_DIR/plan_tp$tp.log" 2>&1
  grep -E "^- KV cache|^\| (bfloat16|fp8_e4m3) " "$OUT_DIR/plan_tp$tp.log" | cut -c1-220
done
echo
echo "== issue 16: Llama-3.1-8B shape, random weights, $BACKEND, TP=2 against TP=1 ($(date -u +%F), $(git rev-parse --short HEAD 2>/dev/null || echo 'commit unknown'))"
if [ -f "$OUT_DIR/tp1/seed.json" ] && [ -f "$OUT_DIR/tp2/seed.json" ]; then
  python3 benchmarks/tp/tp_table.py "$OUT_DIR/tp1/seed.json" "$OUT_DIR/tp2/seed.json" \
    | tee "$OUT_DIR/table.md"
else
  echo "no table: a seed run did not finish (see seed_tp1.log / seed_tp2.log)"
fi
for f in "$OUT_DIR"/tp1/seed.md "$OUT_DIR"/tp2/seed.md; do
  [ -f "$f" ] && { echo; echo "$f:"; cat "$f"; }
done
step tests_rest "${T_TESTS2:-600}" python3 -m pytest -q -m gpu -p no:cacheprovider -rs \
  "$TESTS" -k "not ((triton and False) or graphs)"

echo "total $((SECONDS - START)) s"
