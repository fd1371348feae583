# GPU call 10 (session 2): tests after the layout-per-head-dim and fp8-prefill-in-f16 changes,
# prefill variants again, the prefill table with the new defaults, the seed table.
source benchmarks/device/setup.sh
timeout 200 python3 -m pytest -q -n 12 -p no:cacheprovider --tb=short -rf tests/gpu/test_kernels.py tests/gpu/test_cuda_graph.py tests/gpu/test_e2e_backends.py -k "prefill or graph or backend or store" > $OUT/pytest.log 2>&1
echo "pytest rc=$? at $SECONDS s"; grep -E "passed|failed" $OUT/pytest.log | tail -2; grep -E "^(FAILED|ERROR)|^E  " $OUT/pytest.log | cut -c1-250 | head -24
timeout 120 python3 benchmarks/kernels/explore_prefill.py > $OUT/explore_prefill.log 2>&1
echo "explore rc=$? at $SECONDS s"
grep fp8 $OUT/explore_prefill.log | sed -E 's/ +/ /g; s/\[[0-9]+s\]//; s/err-vs-default/e/' | cut -c1-130
timeout 90 python3 -m kvfit.bench.kernels --no-decode --out $OUT/kernels > $OUT/kernels.log 2>&1
echo "kernels rc=$? at $SECONDS s"; grep -E "^prefill" $OUT/kernels.log | sed -E 's/ +/ /g'
timeout $((560 - SECONDS)) python3 -m kvfit.bench.seed --kv-dtypes bfloat16,fp8_e4m3 --contexts 16384,32768 --batches 16,64 --steps 24 --prefill-len 2048 --attention-backend triton --out $OUT/seed > $OUT/seed.log 2>&1
echo "seed rc=$? at $SECONDS s"; grep -E "^\|" $OUT/seed.log | head -30
