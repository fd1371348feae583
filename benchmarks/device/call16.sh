# GPU call 16 (session 3): the prefill kernel with unmasked interior tiles and heaviest-first
# blocks: its tests against the torch reference, then the launch sweep (5 stages overlap the
# block-table tile loads) against FlashInfer fa2 at 1k/4k/16k prompts.
source benchmarks/device/setup.sh > /dev/null 2>&1
timeout 200 python3 -m pytest -q -n 14 -p no:cacheprovider --tb=short -rf tests/gpu/test_kernels.py -k "prefill" 2>&1 | tail -8
echo "tests done at $SECONDS s"
timeout 330 python3 benchmarks/kernels/explore_prefill.py > $OUT/explore_prefill.log 2>&1
echo "explore rc=$? at $SECONDS s"; cat $OUT/explore_prefill.log | cut -c1-200
