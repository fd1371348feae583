# GPU call 13 (session 2): fp8 decode at pages of 32 and 64 tokens (token-minor V rows of 32/64
# bytes instead of 16), Qwen3 and Llama heads; then the kernel tests at pages of 32.
source benchmarks/device/setup.sh > /dev/null 2>&1
for ps in 32 64; do
  timeout 100 python3 -m kvfit.bench.kernels --page-size $ps --layouts qwen3-1.7b,llama-3.1-8b --batches 32,128 --contexts 16384 --no-prefill --no-fi --out $OUT/ps$ps > $OUT/ps$ps.log 2>&1
  grep -E "^decode" $OUT/ps$ps.log
done
timeout 200 python3 -m pytest -q -n 14 -p no:cacheprovider --tb=short -rf tests/gpu/test_kernels.py -k "32"
