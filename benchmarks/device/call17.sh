# GPU call 17 (session 3): kernel tests after the prefill rewrite and the chosen launches; the
# fp8 decode variants at the points that missed 3 TB/s (64-d heads, Llama 8 x 16k) at pages of
# 16 and 32; prefill launches for 256-d heads (no FlashInfer: its 256-d JIT is not cached).
source benchmarks/device/setup.sh > /dev/null 2>&1
timeout 200 python3 -m pytest -q -n 14 -p no:cacheprovider --tb=short -rf tests/gpu/test_kernels.py tests/gpu/test_e2e_backends.py > $OUT/tests.log 2>&1
echo "tests rc=$? at $SECONDS s"; tail -15 $OUT/tests.log
for ps in 16 32; do
  PAGE=$ps timeout 110 python3 benchmarks/kernels/explore_vt.py small > $OUT/vt_small_p$ps.log 2>&1
  mv $OUT/explore_vt.json $OUT/vt_small_p$ps.json
  echo "vt page $ps rc=$? at $SECONDS s"; grep -E "TB/s|failed" $OUT/vt_small_p$ps.log | cut -c1-190
done
NO_FI=1 LAYOUTS=gemma3-4b CTXS=4096,16384 timeout 80 python3 benchmarks/kernels/explore_prefill.py > $OUT/prefill256.log 2>&1
echo "prefill256 rc=$? at $SECONDS s"; cut -c1-160 $OUT/prefill256.log
