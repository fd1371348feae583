# GPU call 11 (session 2): the kernel table (decode + prefill vs FlashInfer) with the final
# defaults (token-minor V for fp8 128-d heads, HND for 64-d; prefill rows per dtype/head size).
source benchmarks/device/setup.sh
timeout 120 python3 -m pytest -q -n 12 -p no:cacheprovider --tb=short -rf tests/gpu/test_kernels.py -k "prefill_poisoned or backend_decode" > $OUT/pytest.log 2>&1
echo "pytest rc=$? at $SECONDS s"; grep -E "passed|failed" $OUT/pytest.log | tail -2; grep -E "^(FAILED|ERROR)|^E  " $OUT/pytest.log | cut -c1-250 | head
timeout 300 python3 -m kvfit.bench.kernels --out $OUT/kernels > $OUT/kernels.log 2>&1
echo "kernels rc=$? at $SECONDS s"; grep -E "^prefill smollm" $OUT/kernels.log | sed -E 's/ +/ /g'
grep -E "^decode" $OUT/kernels.log | awk '{print $2, $3, $4, $5, $9, $10, $17, $18}' | head -100
