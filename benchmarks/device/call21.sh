# GPU call 21 (session 3): chunk store writing whole 16-byte V row vectors (read-back of the
# slice's other positions): bit-exactness + backend tests, then the prefill step profile.
source benchmarks/device/setup.sh > /dev/null 2>&1
timeout 150 python3 -m pytest -q -n 14 -p no:cacheprovider --tb=short -rf tests/gpu/test_kernels.py -k "store or prefill_backend" > $OUT/tests.log 2>&1
echo "kernel tests rc=$? at $SECONDS s"; tail -4 $OUT/tests.log
timeout 90 python3 benchmarks/kernels/profile_prefill_step.py fp8_e4m3:triton bfloat16:triton > $OUT/profile.log 2>&1
echo "profile rc=$? at $SECONDS s"; grep -E "^==|_store_kv|_store_chunks|_prefill|Self CUDA time total" $OUT/profile.log | cut -c1-60,100-200
