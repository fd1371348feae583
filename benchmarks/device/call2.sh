# GPU call 2: all GPU tests; ncu of the decode kernel versions; the variant sweep; the full grid.
source benchmarks/device/setup.sh
L=/tmp/logs; mkdir -p $L
timeout 200 python3 -m pytest -q -n 8 -p no:cacheprovider --tb=short -rf tests/gpu > $L/pytest.log 2>&1
echo "pytest rc=$? at $SECONDS s"; grep -E "passed|failed" $L/pytest.log | tail -2; grep -E "^(FAILED|ERROR)" $L/pytest.log | cut -c1-250 | head -30
for v in bf16 fp8_v1 fp8_v2; do
  timeout 60 ncu --clock-control none -k regex:_decode_split --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section MemoryWorkloadAnalysis \
    --metrics smsp__inst_executed.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__sass_inst_executed_op_shared_ld.sum \
    python3 benchmarks/kernels/ncu_decode.py $v > $L/ncu_$v.txt 2>&1
  echo "ncu $v rc=$? at $SECONDS s"; grep -E "Duration|Memory Throughput|DRAM Throughput|Issue Slots Busy|Executed Ipc A|smsp__inst_executed.sum|bank_conflicts|Achieved Occupancy|No Eligible|Stall" $L/ncu_$v.txt | head -14
done
timeout 120 python3 -m kvfit.bench.kernels --explore --batches 32 --contexts 16384 --no-prefill --out $L/explore > $L/explore.log 2>&1
echo "explore rc=$? at $SECONDS s"; grep -v "^  variant" $L/explore.log | tail -12
timeout 200 python3 -m kvfit.bench.kernels --out $L/grid > $L/grid.log 2>&1
echo "grid rc=$? at $SECONDS s"; grep -E "speedup|prefill|copy" $L/grid.log | tail -30
tar -czf $OUT/logs.tar.gz -C /tmp logs
