# GPU call 18 (session 3): GPU tests after the prefill rewrite (incl. the 16-bit token-minor fix
# for pages < 8), the prefill table at the engine's page sizes, and the seed table with the
# default flags (auto backend and page size).
source benchmarks/device/setup.sh > /dev/null 2>&1
timeout 230 python3 -m pytest -q -n 14 -p no:cacheprovider --tb=short -rf tests/gpu/test_kernels.py tests/gpu/test_cuda_graph.py tests/gpu/test_flashinfer.py tests/gpu/test_swa_mla_cuda.py tests/gpu/test_fused_kernels.py tests/gpu/test_e2e_backends.py > $OUT/tests.log 2>&1
echo "tests rc=$? at $SECONDS s"; tail -6 $OUT/tests.log
timeout 120 python3 -m kvfit.bench.kernels --no-decode --out $OUT/prefill > $OUT/prefill.log 2>&1
echo "prefill rc=$? at $SECONDS s"; grep -E "^prefill" $OUT/prefill.log
timeout 150 python3 -m kvfit.bench.seed --kv-dtypes bfloat16,fp8_e4m3 --contexts 16384,32768 --batches 16,64 --steps 24 --prefill-len 2048 --out $OUT/seed > $OUT/seed.log 2>&1
echo "seed rc=$? at $SECONDS s"; grep -E "^\||backend|page" $OUT/seed.log | head -30
