# GPU call 8 (session 2): kernel tests with token-minor V pages, then decode variants.
source benchmarks/device/setup.sh
timeout 330 python3 -m pytest -q -n 12 -p no:cacheprovider --tb=short -rf tests/gpu/test_kernels.py tests/gpu/test_cuda_graph.py tests/gpu/test_e2e_backends.py > $OUT/pytest.log 2>&1
echo "pytest rc=$? at $SECONDS s"; grep -E "passed|failed" $OUT/pytest.log | tail -2; grep -E "^(FAILED|ERROR)|^E  " $OUT/pytest.log | cut -c1-250 | head -24
timeout $((560 - SECONDS)) python3 benchmarks/kernels/explore_vt.py > $OUT/explore_vt.log 2>&1
grep -v Warn $OUT/explore_vt.log | sed -E 's/mr=None/mr=-/; s/ smem=[0-9]+//; s/err=([0-9.e-]+)/e=\1/; s/ +/ /g; s/\[[0-9]+s\]//' | cut -c1-140
