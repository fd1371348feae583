# The mla2 engineer's GPU-queue job, round B (from a copy of the tree: .helper/mla2; 75 s slot):
# 1. end to end `kvfit bench seed` on DeepSeek-V2-Lite cut to 8 layers (bf16 vs fp8 latents,
#    16k, batch 1 and 32) ALONE on the GPU except for the short decode-kernel tests of the new
#    default launch, which run during the seed's start-up (model build, graph capture);
# 2. then the remaining MLA GPU tests (graphs, engine, prefill, torch backend) in the time left;
# 3. a short decode sweep if time is left.
export PYTHONUNBUFFERED=1
mkdir -p "$OUT_DIR"
t() { local s=$SECONDS; timeout "$@"; echo "[rc=$? ${SECONDS}s total, $((SECONDS-s))s this]"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
F="tests/gpu/test_mla_triton.py tests/gpu/test_mla_decode_swap.py"
( t ${T_T0:-20} python3 -m pytest -q -p no:cacheprovider -m gpu $F -k "${TESTS_0:-test_mla_decode_kernel or store_latent}" \
    > "$OUT_DIR/gpu_tests_0.log" 2>&1; echo "== tests 0"; tail -3 "$OUT_DIR/gpu_tests_0.log" ) &
t ${T_SEED:-50} python3 -m kvfit.bench.seed --model ${SEED_MODEL:-benchmarks/gpu/deepseek-v2-lite-8layers.json} \
  --kv-dtypes ${SEED_DTYPES:-bfloat16,fp8_e4m3} --contexts ${SEED_CONTEXTS:-16384} \
  --batches ${SEED_BATCHES:-1,32} --steps ${SEED_STEPS:-10} --prefill-len ${SEED_PREFILL:-1024} \
  --out "$OUT_DIR/seed" > "$OUT_DIR/seed.log" 2>&1
echo "== seed"; grep -E "decode b=|prefill [0-9]|Error|error" "$OUT_DIR/seed.log" | tail -12
wait
i=1
for k in "${TESTS_1:-graph or engine}" "${TESTS_2:-prefill_kernel or float32 or torch_backend}"; do
  ( t $((73 - SECONDS)) python3 -m pytest -q -p no:cacheprovider -m gpu $F -k "$k" \
      > "$OUT_DIR/gpu_tests_$i.log" 2>&1; echo "== tests $i ($k)"; tail -3 "$OUT_DIR/gpu_tests_$i.log" ) &
  i=$((i + 1))
done
wait
echo "== seed table"; grep -E "^\|" "$OUT_DIR/seed.log"
# 3. time permitting: more 4-warp hoisted launches (2 and 3 programs per SM) against the default
if [ $SECONDS -lt ${SWEEP_BEFORE:-52} ]; then
  t $((74 - SECONDS)) python3 benchmarks/kernels/mla_sweep.py --points ${PTS:-bfloat16:4:32768,bfloat16:32:16384} \
    --variants "${VARS:-sh:32:4:3:2,sh:32:4:2:3,sh:32:4:5:1}" --rep 60 --json "$OUT_DIR/sweep.json" \
    > "$OUT_DIR/sweep.log" 2>&1
  echo "== sweep"; grep -E "GPU|TB/s|Error" "$OUT_DIR/sweep.log"
fi
true
