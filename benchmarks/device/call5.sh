# GPU call 5: wave-aware split counts: decode tests, the decode grid (ours, no FI), seed e2e.
source benchmarks/device/setup.sh
L=/tmp/logs; mkdir -p $L
timeout 100 python3 -m pytest -q -n 8 -p no:cacheprovider --tb=short -rf tests/gpu -k "decode or graph or e2e" > $L/pytest.log 2>&1
echo "pytest rc=$? at $SECONDS s"; grep -E "passed|failed" $L/pytest.log | tail -2; grep -E "^(FAILED|ERROR)" $L/pytest.log | cut -c1-250 | head
timeout 100 python3 -m kvfit.bench.kernels --no-prefill --no-fi --batches 1,8,16,32,128 --contexts 16384,65536 --out $L/grid > $L/grid.log 2>&1
echo "grid rc=$? at $SECONDS s"; grep -E "^decode|speedup" $L/grid.log | cut -c1-120
timeout 100 python3 -m kvfit.bench.seed --kv-dtypes bfloat16,fp8_e4m3 --contexts 16384,32768 --batches 16,64 --steps 24 --prefill-len 2048 --out $L/seed > $L/seed.log 2>&1
echo "seed rc=$? at $SECONDS s"; grep -E "^\|" $L/seed.log
tar -czf $OUT/logs.tar.gz -C /tmp logs
