# The mla engineer's GPU-queue job (run from a copy of the tree: .helper/mla): the MLA GPU tests,
# then the MLA decode launch sweep and `kvfit bench kernels` on the DeepSeek-V2-Lite shape.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-mla
mkdir -p "$OUT_DIR"
t() { local s=$SECONDS; timeout "$@"; echo "[rc=$? ${SECONDS}s total, $((SECONDS-s))s this]"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
t ${T_TESTS:-45} python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/gpu/test_mla_triton.py \
  > "$OUT_DIR/gpu_tests.log" 2>&1; tail -15 "$OUT_DIR/gpu_tests.log"
t ${T_SWEEP:-30} python3 benchmarks/kernels/mla_sweep.py --points ${POINTS:-bfloat16:4:32768,fp8_e4m3:4:32768,bfloat16:64:2048,fp8_e4m3:64:2048} \
  --variants "${VARIANTS:-}" --json "$OUT_DIR/sweep.json"
