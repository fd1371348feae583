# The mla2 engineer's GPU-queue job, round B (from a copy of the tree: .helper/mla2; 80 s slot):
# 1. in parallel: the MLA GPU tests (test_mla_triton.py runs decode_config's default launch;
#    test_mla_decode_swap.py the swapped-kernel variants) in three pytest processes, and end to
#    end `kvfit bench seed` on DeepSeek-V2-Lite cut to 8 layers (bf16 vs fp8 latents, 16k,
#    batch 1 and 32; its timing may overlap the tests' small kernels);
# 2. alone on the GPU: the decode sweep, default launch vs the row kernel (ROWS_VAR) and the
#    runner-up (BF_VARS / F8_VARS) at 128k+ tokens.
export PYTHONUNBUFFERED=1
mkdir -p "$OUT_DIR"
t() { local s=$SECONDS; timeout "$@"; echo "[rc=$? ${SECONDS}s total, $((SECONDS-s))s this]"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
S=benchmarks/kernels/mla_sweep.py
PTS=${PTS:-bfloat16:4:32768,fp8_e4m3:4:32768,bfloat16:32:16384,fp8_e4m3:32:16384}
BF_VARS=${BF_VARS:-r:32:8:2}
F8_VARS=${F8_VARS:-r:64:8:3}
( t ${T_WARM:-40} python3 $S --points $PTS --variants "$BF_VARS" --fp8-variants "$F8_VARS" --warm \
    > "$OUT_DIR/warm.log" 2>&1 ) &
IFS='|' read -r -a GROUPS_K <<< "${TEST_GROUPS:-decode_kernel or store_latent or swapped|prefill_kernel or float32 or torch_backend|graph or engine}"
i=0
for k in "${GROUPS_K[@]}"; do
  ( t ${T_TESTS:-50} python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_mla_triton.py \
      tests/gpu/test_mla_decode_swap.py -k "$k" > "$OUT_DIR/gpu_tests_$i.log" 2>&1
    echo "== tests group $i ($k)"; tail -4 "$OUT_DIR/gpu_tests_$i.log" ) &
  i=$((i + 1))
done
( t ${T_SEED:-56} python3 -m kvfit.bench.seed --model ${SEED_MODEL:-benchmarks/gpu/deepseek-v2-lite-8layers.json} \
  --kv-dtypes ${SEED_DTYPES:-bfloat16,fp8_e4m3} --contexts ${SEED_CONTEXTS:-16384} \
  --batches ${SEED_BATCHES:-1,32} --steps ${SEED_STEPS:-12} --prefill-len ${SEED_PREFILL:-1024} \
  --out "$OUT_DIR/seed" > "$OUT_DIR/seed.log" 2>&1; echo "== seed"; grep -E "decode b=|prefill [0-9]|Error|error" "$OUT_DIR/seed.log" | tail -12 ) &
wait
t ${T_SWEEP:-20} python3 $S --points $PTS --variants "$BF_VARS" --fp8-variants "$F8_VARS" --rep ${REP:-100} \
  --json "$OUT_DIR/sweep.json" > "$OUT_DIR/sweep.log" 2>&1
echo "== sweep"; grep -E "GPU|TB/s|Error" "$OUT_DIR/sweep.log"
echo "== seed table"; grep -E "^\|" "$OUT_DIR/seed.log"
true
