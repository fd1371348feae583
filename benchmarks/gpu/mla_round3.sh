# The mla engineer's third GPU-queue job (from a copy of the tree: .helper/mla): the MLA decode
# launch sweep (more tiles, warps and stages), then ncu of one bf16 and one fp8 decode launch
# (stall reasons, bank conflicts, occupancy; clocks left alone).
export PYTHONUNBUFFERED=1
mkdir -p "$OUT_DIR"
t() { local s=$SECONDS; timeout "$@"; echo "[rc=$? ${SECONDS}s total, $((SECONDS-s))s this]"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
t ${T_SWEEP:-40} python3 benchmarks/kernels/mla_sweep.py \
  --points ${SWEEP_POINTS:-bfloat16:64:2048,fp8_e4m3:64:2048} \
  --variants "${SWEEP_VARIANTS:-32:4:3,64:4:3,32:8:4,16:4:3}" --json "$OUT_DIR/sweep.json"
if command -v ncu >/dev/null; then
  for kv in bfloat16 fp8_e4m3; do
    t ${T_NCU:-22} ncu --clock-control none --kernel-name regex:_mla_attn --launch-skip 2 \
      --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats \
      --section MemoryWorkloadAnalysis_Tables python3 benchmarks/kernels/ncu_mla.py $kv 64 2048 \
      > "$OUT_DIR/ncu_$kv.txt" 2>&1
    grep -E "Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers|Block Limit|Warp Cycles Per Issued|Stall|bank|Shared" "$OUT_DIR/ncu_$kv.txt" | head -30
  done
else
  echo "no ncu on this machine"
fi
true
