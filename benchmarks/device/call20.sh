# GPU call 20 (session 3): the page-row chunk store for token-minor V in prefill steps: its
# bit-exactness tests and the backend/e2e tests, then the whole-model prefill step profile.
source benchmarks/device/setup.sh > /dev/null 2>&1
timeout 150 python3 -m pytest -q -n 14 -p no:cacheprovider --tb=short -rf tests/gpu/test_kernels.py -k "store or prefill" > $OUT/tests.log 2>&1
echo "kernel tests rc=$? at $SECONDS s"; tail -4 $OUT/tests.log
timeout 100 python3 -m pytest -q -n 14 -p no:cacheprovider --tb=short -rf tests/gpu/test_e2e_backends.py tests/gpu/test_cuda_graph.py > $OUT/tests2.log 2>&1
echo "e2e/graph tests rc=$? at $SECONDS s"; tail -4 $OUT/tests2.log
timeout 120 python3 benchmarks/kernels/profile_prefill_step.py fp8_e4m3:triton bfloat16:triton bfloat16:fi > $OUT/profile.log 2>&1
echo "profile rc=$? at $SECONDS s"; grep -E "^==|_store_kv|_store_chunks|_prefill|BatchPrefill|Self CUDA time total" $OUT/profile.log | cut -c1-60,100-200
