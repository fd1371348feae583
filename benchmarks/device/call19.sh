# GPU call 19 (session 3): ncu of the prefill kernel at 2 and 5 stages (bf16, fp8 token-minor),
# then the seed table with no flags at all (auto backend: fi for bf16, triton for fp8; auto
# page size: 16 / 32).
source benchmarks/device/setup.sh > /dev/null 2>&1
for v in bf16_s2 bf16 fp8_s2 fp8; do
  timeout 60 ncu --clock-control none -k regex:_prefill --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section Occupancy --section ComputeWorkloadAnalysis \
    --metrics smsp__inst_executed.sum \
    python3 benchmarks/kernels/ncu_prefill.py $v > $OUT/ncu_prefill_$v.txt 2>&1
  echo "ncu $v rc=$? at $SECONDS s"; grep -E "PrefillConfig|Duration|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy|Executed Ipc A|smsp__inst_executed.sum|Achieved Occupancy|No Eligible|Registers Per|Stall|Warp Cycles Per Issued" $OUT/ncu_prefill_$v.txt | head -14
done
timeout 160 python3 -m kvfit.bench.seed --kv-dtypes bfloat16,fp8_e4m3 --contexts 16384,32768 --batches 16,64 --steps 24 --prefill-len 2048 --out $OUT/seed > $OUT/seed.log 2>&1
echo "seed rc=$? at $SECONDS s"; grep -E "^\|" $OUT/seed.log
