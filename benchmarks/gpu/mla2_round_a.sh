# The mla2 engineer's GPU-queue job, round A (from a copy of the tree: .helper/mla2; 80 s slot):
# 1. in parallel: one process per (latent dtype, variant) compiling it into the Triton cache
#    (mla_sweep.py --warm at the timed points) and the swapped-kernel GPU tests;
# 2. alone on the GPU: the timed decode sweep (rows kernel default vs the swapped variants) at
#    batch x context = 128k tokens;
# 3. if ncu reads counters here: one bf16 and one fp8 launch of the swapped kernel.
export PYTHONUNBUFFERED=1
mkdir -p "$OUT_DIR"
t() { local s=$SECONDS; timeout "$@"; echo "[rc=$? ${SECONDS}s total, $((SECONDS-s))s this]"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
BF_PTS=${BF_PTS:-bfloat16:4:32768,bfloat16:32:16384}
F8_PTS=${F8_PTS:-fp8_e4m3:4:32768,fp8_e4m3:32:16384}
BF_VARS=${BF_VARS:-sh:32:8:4:1,sh:32:8:3:2,sh:16:4:4:3,sh:32:8:5:1,sh:16:8:4:2,sh:16:4:6:2,sh:32:4:4:1,sh:16:4:5:2}
F8_VARS=${F8_VARS:-sh:32:8:4:2,sh:16:4:4:3,sh:32:8:5:1,sh:16:8:4:2,sh:16:4:6:2,sh:64:8:3:1,sh:32:4:4:2}
S=benchmarks/kernels/mla_sweep.py
( t ${T_WARM:-30} python3 $S --points $BF_PTS --warm > "$OUT_DIR/warm_bf_default.log" 2>&1 ) &
( t ${T_WARM:-30} python3 $S --points $F8_PTS --warm > "$OUT_DIR/warm_f8_default.log" 2>&1 ) &
for v in ${BF_VARS//,/ }; do
  ( t ${T_WARM:-30} python3 $S --points $BF_PTS --variants $v --no-default --warm \
      > "$OUT_DIR/warm_bf_${v//:/_}.log" 2>&1 ) &
done
for v in ${F8_VARS//,/ }; do
  ( t ${T_WARM:-30} python3 $S --points $F8_PTS --variants $v --no-default --warm \
      > "$OUT_DIR/warm_f8_${v//:/_}.log" 2>&1 ) &
done
i=0
for k in "${TA:-bfloat16 and not graph}" "${TB:-fp8_e4m3 and not graph}" "${TC:-fp8_e5m2 or graph}"; do
  ( t ${T_TESTS:-30} python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_mla_decode_swap.py \
      -k "$k" > "$OUT_DIR/gpu_tests_$i.log" 2>&1; echo "== tests ($k)"; tail -4 "$OUT_DIR/gpu_tests_$i.log" ) &
  i=$((i + 1))
done
wait
grep -h -E "Error|error" "$OUT_DIR"/warm_*.log | head -8
t ${T_SWEEP:-27} python3 $S --points $BF_PTS,$F8_PTS --variants "$BF_VARS" --fp8-variants "$F8_VARS" --rep ${REP:-100} \
  --json "$OUT_DIR/sweep.json" > "$OUT_DIR/sweep.log" 2>&1
STALLS=$(for r in long_scoreboard short_scoreboard barrier wait mio_throttle lg_throttle math_pipe_throttle not_selected selected dispatch_stall no_instruction; do
  printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' $r; done)
# bf16 with the stall-reason metrics, fp8 with the sections only (in case a metric name is
# refused there)
for kv in "bfloat16 16 ${NCU_VAR:-sh:32:8:4} M" "fp8_e4m3 32 ${NCU_VAR8:-sh:32:8:4} -"; do
  set -- $kv
  M=(); [ "$4" = M ] && M=(--metrics "${STALLS%,}")
  if [ $SECONDS -lt ${NCU_BEFORE:-58} ] && command -v ncu >/dev/null; then
    t $((72 - SECONDS)) ncu --clock-control none --kernel-name regex:_mla_decode_swap --launch-skip 2 \
      --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats \
      "${M[@]}" python3 benchmarks/kernels/ncu_mla.py $1 4 32768 $2 $3 > "$OUT_DIR/ncu_$1.txt" 2>&1
    echo "== ncu $kv"; grep -E "Duration|DRAM Throughput|Achieved Occupancy|Warp Cycles Per Issued|stalled|ERR|rc=" "$OUT_DIR/ncu_$1.txt" | head -20
  fi
done
echo "== sweep"; grep -E "GPU|TB/s|Error" "$OUT_DIR/sweep.log"
true
