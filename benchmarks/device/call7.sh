# GPU call 7: the fused-kernel and end-to-end GPU tests after the test fixes of call 6's findings.
source benchmarks/device/setup.sh
timeout 150 python3 -m pytest -q -n 8 -p no:cacheprovider --tb=short -rf tests/gpu/test_fused_kernels.py tests/gpu/test_e2e_backends.py tests/gpu/test_cuda_graph.py > $OUT/pytest.log 2>&1
echo "pytest rc=$? at $SECONDS s"; grep -E "passed|failed" $OUT/pytest.log | tail -2; grep -E "^(FAILED|ERROR)|^E  " $OUT/pytest.log | cut -c1-300 | head -30
