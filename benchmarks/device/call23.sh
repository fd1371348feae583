# GPU call 23 (session 3): ncu of the fp8 decode points that miss 3 TB/s: SmolLM heads (64-d) at
# 128 x 16k and 32 x 16k with the default HND tile, and Llama heads at 8 x 16k (token-minor, p32).
source benchmarks/device/setup.sh > /dev/null 2>&1
run() {
  timeout 50 ncu --clock-control none -k regex:_decode --launch-skip 3 --launch-count 2 \
    --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \
    --section MemoryWorkloadAnalysis --metrics smsp__inst_executed.sum \
    python3 benchmarks/kernels/ncu_decode.py "$@" > $OUT/ncu_$1_$2_$3.txt 2>&1
  echo "ncu $* rc=$? at $SECONDS s"; grep -E "DecodeConfig|  _decode|Duration|DRAM Throughput|L2 Cache Throughput|Issue Slots Busy|smsp__inst_executed.sum|Achieved Occupancy|No Eligible|Grid Size|Waves Per SM" $OUT/ncu_$1_$2_$3.txt | sed 's/  */ /g' | head -24
}
run fp8_hnd smollm2 128 16384 16
run fp8_hnd smollm2 32 16384 16
run fp8_vt llama-3.1-8b 8 16384 32
