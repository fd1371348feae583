# GPU call 4: GPU tests again (store fix); kernels per decode step; end-to-end decode at 16k/32k
# with both our triton backend and fi (bf16 vs fp8_e4m3, CUDA graphs).
source benchmarks/device/setup.sh
L=/tmp/logs; mkdir -p $L
timeout 120 python3 -m pytest -q -n 8 -p no:cacheprovider --tb=short -rf tests/gpu > $L/pytest.log 2>&1
echo "pytest rc=$? at $SECONDS s"; grep -E "passed|failed" $L/pytest.log | tail -2; grep -E "^(FAILED|ERROR)" $L/pytest.log | cut -c1-250 | head -20
timeout 60 python3 benchmarks/kernels/count_kernels.py > $L/count.log 2>&1; echo "count rc=$?"; cat $L/count.log | tail -16
for be in triton fi; do
  timeout 150 python3 -m kvfit.bench.seed --attention-backend $be --kv-dtypes bfloat16,fp8_e4m3 --contexts 16384,32768 --batches 1,16,64 --steps 24 --out $L/seed_$be > $L/seed_$be.log 2>&1
  echo "seed $be rc=$? at $SECONDS s"; grep -E "^\|" $L/seed_$be.log
done
tar -czf $OUT/logs.tar.gz -C /tmp logs
