# GPU call 6 (final tree): all GPU tests incl. the fused norm/RoPE/act kernels, then the seed
# table (triton backend, CUDA graphs) to measure what the fused kernels did to batch-1 decode.
source benchmarks/device/setup.sh
timeout 210 python3 -m pytest -q -n 8 -p no:cacheprovider --tb=short -rf tests/gpu > $OUT/pytest.log 2>&1
echo "pytest rc=$? at $SECONDS s"; grep -E "passed|failed" $OUT/pytest.log | tail -2; grep -E "^(FAILED|ERROR)" $OUT/pytest.log | cut -c1-250 | head -20
timeout 170 python3 -m kvfit.bench.seed --kv-dtypes bfloat16,fp8_e4m3 --contexts 1024,16384 --batches 1,64 --steps 32 --prefill-len 8192 --out $OUT/seed > $OUT/seed.log 2>&1
echo "seed rc=$? at $SECONDS s"; grep -E "^\||kernels|roofline" $OUT/seed.log | head -30; tail -3 $OUT/seed.log
