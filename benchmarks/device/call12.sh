# GPU call 12 (session 2): ncu of the v4 fp8 decode (token-minor V) next to the HND fp8 tile.
source benchmarks/device/setup.sh > /dev/null 2>&1
for v in fp8_vt fp8_hnd; do
  timeout 100 ncu --clock-control none -k regex:_decode_split --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section MemoryWorkloadAnalysis \
    --metrics smsp__inst_executed.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__sass_inst_executed_op_shared_ld.sum \
    python3 benchmarks/kernels/ncu_decode.py $v > $OUT/ncu_$v.txt 2>&1
  echo "ncu $v rc=$? at $SECONDS s"; grep -E "DecodeConfig|Duration|Memory Throughput|DRAM Throughput|Issue Slots Busy|Executed Ipc A|smsp__inst_executed.sum|bank_conflicts|op_shared_ld|Achieved Occupancy|Theoretical Occupancy|No Eligible|Registers Per" $OUT/ncu_$v.txt | head -16
done
