# The mla engineer's GPU-queue job (run from a copy of the tree: .helper/mla): the MLA GPU tests
# in three concurrent pytest processes (Triton compiles are CPU-bound), then MLA decode launch
# sweeps on the DeepSeek-V2-Lite shape (benchmarks/kernels/mla_sweep.py), one at a time.
# Times per part: T_TESTS, T_SWEEP (seconds); sweep points/variants: BF16_*/FP8_* below.
export PYTHONUNBUFFERED=1
mkdir -p "$OUT_DIR"
t() { local s=$SECONDS; timeout "$@"; echo "[rc=$? ${SECONDS}s total, $((SECONDS-s))s this]"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
F=tests/gpu/test_mla_triton.py
GROUPS_K=("${TESTS_A:-decode_kernel or store_latent}" "${TESTS_B:-prefill_kernel or float32 or torch_backend}" "${TESTS_C:-graph or engine}")
i=0
for k in "${GROUPS_K[@]}"; do
  ( t ${T_TESTS:-45} python3 -m pytest -q -p no:cacheprovider -m gpu $F -k "$k" \
      > "$OUT_DIR/gpu_tests_$i.log" 2>&1; echo "== group $i ($k)"; tail -12 "$OUT_DIR/gpu_tests_$i.log" ) &
  i=$((i + 1))
done
wait
t ${T_SWEEP:-20} python3 benchmarks/kernels/mla_sweep.py \
  --points ${BF16_POINTS:-bfloat16:4:32768,bfloat16:64:2048} --variants "${BF16_VARIANTS:-}" \
  --json "$OUT_DIR/sweep_bf16.json"
t ${T_SWEEP:-20} python3 benchmarks/kernels/mla_sweep.py \
  --points ${FP8_POINTS:-fp8_e4m3:4:32768,fp8_e4m3:64:2048} --variants "${FP8_VARIANTS:-}" \
  --json "$OUT_DIR/sweep_fp8.json"
