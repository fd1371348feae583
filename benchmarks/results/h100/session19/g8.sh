source benchmarks/gpu/setup.sh
cp .helper/g8.sh $OUT/
cd benchmarks/kernels
OUT_DIR=$OUT timeout 120 python3 decode_sweep.py --jobs 12 $(grep -v '^#' ../../.helper/g8_variants.txt) > $OUT/sweep.txt 2>&1
cd ../..
grep -v Warn $OUT/sweep.txt | tail -60
timeout 100 python3 -m pytest -q -n 8 tests/gpu/test_decode_8bit_gluon.py > $OUT/test.txt 2>&1
tail -30 $OUT/test.txt
