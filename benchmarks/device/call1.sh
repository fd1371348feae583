# GPU call 1: all GPU tests (Triton kernels, fi backend, CUDA graphs, end to end; FlashInfer JIT
# builds happen here and are kept as AOT parts), then a sweep of our decode launch variants.
source benchmarks/device/setup.sh
L=/tmp/logs; mkdir -p $L
timeout 330 python3 -m pytest -q -n 12 -p no:cacheprovider --tb=short -rf tests/gpu > $L/pytest.log 2>&1
echo "pytest rc=$? at $SECONDS s"; grep -E "passed|failed|error" $L/pytest.log | tail -3; grep -E "^(FAILED|ERROR)" $L/pytest.log | cut -c1-300 | head -40
timeout 120 python3 -m kvfit.bench.kernels --explore --batches 32 --contexts 16384 --no-prefill --out $L/explore > $L/explore.log 2>&1
echo "explore rc=$? at $SECONDS s"; grep -v "^  variant" $L/explore.log | tail -14
bash benchmarks/device/save_fi_cache.sh > $L/save.log 2>&1; tail -3 $L/save.log
tar -czf $OUT/logs.tar.gz -C /tmp logs
