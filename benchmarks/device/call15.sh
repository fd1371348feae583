# GPU call 15 (session 2): the seed table with the new defaults (no --attention-backend, no
# --page-size: auto picks triton + pages of 32 for fp8, fi + pages of 16 for bf16), e2e tests.
source benchmarks/device/setup.sh > /dev/null 2>&1
timeout 150 python3 -m kvfit.bench.seed --kv-dtypes bfloat16,fp8_e4m3 --contexts 16384,32768 --batches 16,64 --steps 24 --prefill-len 2048 --out $OUT/seed > $OUT/seed.log 2>&1
echo "seed rc=$? at $SECONDS s"; grep -E "^\|" $OUT/seed.log
timeout 60 python3 -m pytest -q -n 4 -p no:cacheprovider --tb=short tests/gpu/test_e2e_backends.py 2>&1 | tail -2
