# The mla engineer's second GPU-queue job (from a copy of the tree: .helper/mla):
# 1. the MLA GPU tests (three concurrent pytest processes) and, at the same time, end to end on
#    the DeepSeek-V2-Lite shape cut to 8 layers (benchmarks/gpu/deepseek-v2-lite-8layers.json:
#    every layer as V2-Lite's, random weights) with `kvfit bench seed` (bf16 vs fp8 latents,
#    triton backend, CUDA graphs) -- its decode timing may overlap the tests' small kernels;
# 2. then, alone on the GPU, the MLA decode launch sweep (benchmarks/kernels/mla_sweep.py).
export PYTHONUNBUFFERED=1
mkdir -p "$OUT_DIR"
t() { local s=$SECONDS; timeout "$@"; echo "[rc=$? ${SECONDS}s total, $((SECONDS-s))s this]"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
F=tests/gpu/test_mla_triton.py
IFS='|' read -r -a GROUPS_K <<< "${TEST_GROUPS:-decode_kernel or store_latent|prefill_kernel or float32 or torch_backend|graph or engine}"
i=0
for k in "${GROUPS_K[@]}"; do
  ( t ${T_TESTS:-40} python3 -m pytest -q -p no:cacheprovider -m gpu $F -k "$k" \
      > "$OUT_DIR/gpu_tests_$i.log" 2>&1; echo "== tests group $i ($k)"; tail -8 "$OUT_DIR/gpu_tests_$i.log" ) &
  i=$((i + 1))
done
( t ${T_SEED:-58} python3 -m kvfit.bench.seed --model ${SEED_MODEL:-benchmarks/gpu/deepseek-v2-lite-8layers.json} \
  --kv-dtypes ${SEED_DTYPES:-bfloat16,fp8_e4m3} --contexts ${SEED_CONTEXTS:-16384} \
  --batches ${SEED_BATCHES:-1,32} --steps ${SEED_STEPS:-12} --prefill-len ${SEED_PREFILL:-1024} \
  --out "$OUT_DIR/seed" > "$OUT_DIR/seed.log" 2>&1; echo "== seed"; grep -E "decode b=|prefill [0-9]|Error|error" "$OUT_DIR/seed.log" | tail -12 ) &
wait
t ${T_SWEEP:-24} python3 benchmarks/kernels/mla_sweep.py \
  --points ${SWEEP_POINTS:-bfloat16:4:32768,fp8_e4m3:4:32768,bfloat16:64:2048,fp8_e4m3:64:2048} \
  --variants "${SWEEP_VARIANTS:-}" --json "$OUT_DIR/sweep.json"
echo "== seed table"; grep -E "^\|" "$OUT_DIR/seed.log"
true
