# GPU call 22 (session 3): final code: end-to-end greedy equality, CUDA graphs, SWA/MLA on CUDA,
# fused kernels (the chunk store with read-back is in every fp8 triton prefill step here).
source benchmarks/device/setup.sh > /dev/null 2>&1
timeout 200 python3 -m pytest -q -n 14 -p no:cacheprovider --tb=short -rf tests/gpu/test_e2e_backends.py tests/gpu/test_cuda_graph.py tests/gpu/test_swa_mla_cuda.py tests/gpu/test_fused_kernels.py > $OUT/tests.log 2>&1
echo "tests rc=$? at $SECONDS s"; tail -4 $OUT/tests.log
