# GPU call 9 (session 2): prefill variants vs FlashInfer, then the full kernel grid and the seed
# decode at 16k/32k with the token-minor fp8 V pages.
source benchmarks/device/setup.sh
timeout 250 python3 benchmarks/kernels/explore_prefill.py > $OUT/explore_prefill.log 2>&1
echo "explore rc=$? at $SECONDS s"
grep -v Warn $OUT/explore_prefill.log | sed -E 's/ +/ /g; s/\[[0-9]+s\]//; s/err-vs-default/e/' | cut -c1-130
timeout 150 python3 -m kvfit.bench.kernels --out $OUT/kernels > $OUT/kernels.log 2>&1
echo "kernels rc=$? at $SECONDS s"
timeout $((570 - SECONDS)) python3 -m kvfit.bench.seed --kv-dtypes bfloat16,fp8_e4m3 --contexts 16384,32768 --batches 16,64 --steps 24 --prefill-len 2048 --attention-backend triton --out $OUT/seed > $OUT/seed.log 2>&1
echo "seed rc=$? at $SECONDS s"; grep -E "^\|" $OUT/seed.log | head -30
