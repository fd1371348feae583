#!/usr/bin/env bash
# session 20, call B: GPU tests, the sweep of this tree and of the base (HEAD before the s8 keys),
# int8 end to end with the Gluon kernel on/off (this tree)
set -uo pipefail
source benchmarks/gpu/setup.sh
R=$PWD; mkdir -p $OUT/new $OUT/base
timeout 150 python3 -m pytest -q -n 8 -p no:cacheprovider --tb=short -rf tests/gpu/test_decode_8bit_gluon.py tests/gpu/test_int4_decode.py tests/gpu/test_mla_decode_gluon.py > $OUT/tests.log 2>&1
tail -4 $OUT/tests.log
V=$(grep -v '^#' benchmarks/gpu/gluon_8bit_s20.txt)
(cd benchmarks/kernels && OUT_DIR=$OUT/new timeout 120 python3 decode_sweep.py --jobs 14 $V > $OUT/sweep_new.log 2>&1)
cat $OUT/sweep_new.log
B=$(grep -v '^#' benchmarks/gpu/gluon_8bit_s20.txt | grep "int8.*gluon=1$")
(cd .helper/base/benchmarks/kernels && PYTHONPATH=$R/.helper/base/src:/tmp/site OUT_DIR=$OUT/base timeout 90 python3 decode_sweep.py --jobs 14 $B > $OUT/sweep_base.log 2>&1)
cat $OUT/sweep_base.log
G=$(nvidia-smi --query-gpu=name --format=csv,noheader)
on="{'$G': {('fp8', 64), ('fp8', 128), ('fp8', 256), ('int8', 64), ('int8', 128), ('int8', 256)}}"
for v in off on; do
  K="kvfit.kernels.decode_8bit_gluon:DEFAULT_ON={}"; [ $v = on ] && K="kvfit.kernels.decode_8bit_gluon:DEFAULT_ON=$on"
  timeout 100 python3 benchmarks/engine/with_knobs.py "$K" - bench seed --kv-dtypes fp8_e4m3,int8 --contexts 16384 --batches 64 --steps 16 --prefill-len 1024 --attention-backend triton > $OUT/seed_$v.log 2>&1
  grep -E "^\|" $OUT/seed_$v.log
done
