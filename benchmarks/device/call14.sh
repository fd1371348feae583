# GPU call 14 (session 2): decide the fp8 defaults. Kernel grid at pages of 32 (ours vs FlashInfer),
# and the seed decode with fp8 KV at pages of 32 through the triton and the fi backends.
source benchmarks/device/setup.sh > /dev/null 2>&1
timeout 110 python3 -m kvfit.bench.kernels --page-size 32 --batches 8,32,128 --contexts 4096,16384,65536 --no-prefill --out $OUT/grid32 > $OUT/grid32.log 2>&1
echo "grid rc=$? at $SECONDS s"
for be in triton fi; do
  timeout 80 python3 -m kvfit.bench.seed --kv-dtypes fp8_e4m3 --contexts 16384,32768 --batches 16,64 --steps 24 --prefill-len 2048 --page-size 32 --attention-backend $be --out $OUT/seed32_$be > $OUT/seed32_$be.log 2>&1
  echo "seed $be rc=$? at $SECONDS s"; grep -E "^\| decode|^\| prefill" $OUT/seed32_$be.log
done
