# GPU call 3: GPU tests, fp8 decode variants (register cap), decode grid with the best fp8
# variant, and the seed table (Qwen3-1.7B shape, random weights) with the HF baseline.
source benchmarks/device/setup.sh
L=/tmp/logs; mkdir -p $L
timeout 150 python3 -m pytest -q -n 8 -p no:cacheprovider --tb=short -rf tests/gpu > $L/pytest.log 2>&1
echo "pytest rc=$? at $SECONDS s"; grep -E "passed|failed" $L/pytest.log | tail -2; grep -E "^(FAILED|ERROR)" $L/pytest.log | cut -c1-250 | head -20
timeout 90 python3 -m kvfit.bench.kernels --explore --kv-dtypes fp8_e4m3 --batches 32 --contexts 16384 --no-prefill --no-fi --out $L/explore > $L/explore.log 2>&1
echo "explore rc=$? at $SECONDS s"; grep -E "^decode" $L/explore.log
BEST=$(python3 benchmarks/kernels/best_variant.py $L/explore/kernels.json); echo "best fp8 cfg: $BEST"
timeout 170 python3 -m kvfit.bench.kernels --no-prefill --fp8-cfg "$BEST" --out $L/grid > $L/grid.log 2>&1
echo "grid rc=$? at $SECONDS s"; grep -E "speedup" $L/grid.log | tr '\n' ' '; echo
timeout 200 python3 -m kvfit.bench.seed --baseline hf --out $L/seed > $L/seed.log 2>&1
echo "seed rc=$? at $SECONDS s"; tail -16 $L/seed.log
tar -czf $OUT/logs.tar.gz -C /tmp logs
