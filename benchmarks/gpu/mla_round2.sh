# The mla engineer's second GPU-queue job: the MLA GPU tests (concurrent groups, T_TESTS), then
# end to end on the DeepSeek-V2-Lite shape with random weights (`kvfit bench seed`, bf16 vs fp8
# latents, triton backend, CUDA graphs; T_SEED), then optional extra commands (EXTRA).
export PYTHONUNBUFFERED=1
mkdir -p "$OUT_DIR"
t() { local s=$SECONDS; timeout "$@"; echo "[rc=$? ${SECONDS}s total, $((SECONDS-s))s this]"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
F=tests/gpu/test_mla_triton.py
IFS='|' read -r -a GROUPS_K <<< "${TEST_GROUPS:-decode_kernel or store_latent|prefill_kernel or float32 or torch_backend|graph or engine}"
i=0
for k in "${GROUPS_K[@]}"; do
  ( t ${T_TESTS:-30} python3 -m pytest -q -p no:cacheprovider -m gpu $F -k "$k" \
      > "$OUT_DIR/gpu_tests_$i.log" 2>&1; echo "== group $i ($k)"; tail -8 "$OUT_DIR/gpu_tests_$i.log" ) &
  i=$((i + 1))
done
wait
t ${T_SEED:-55} python3 -m kvfit.bench.seed --model src/kvfit/bench/configs/deepseek-v2-lite.json \
  --kv-dtypes ${SEED_DTYPES:-bfloat16,fp8_e4m3} --contexts ${SEED_CONTEXTS:-16384} \
  --batches ${SEED_BATCHES:-1,16} --steps ${SEED_STEPS:-16} --prefill-len ${SEED_PREFILL:-2048} \
  --out "$OUT_DIR/seed" > "$OUT_DIR/seed.log" 2>&1
grep -E "^\||decode b=|prefill|Error|error" "$OUT_DIR/seed.log" | tail -20
[ -n "$EXTRA" ] && eval "$EXTRA"
true
