#!/usr/bin/env bash
# session 20, call E: on an H200 the gluon-8bit reproduction; on an H100 the kernel's GPU tests
# and the int8 / fp8 Gluon points after the address work (32-bit scale offsets, page index and slot per tile token)
G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "GPU: $G"
if [[ "$G" == *H200* ]]; then
  OUT=$OUT bash benchmarks/gpu/reproduce.sh gluon-8bit
else
  source benchmarks/gpu/setup.sh
  python3 -m pytest -q -n 8 -p no:cacheprovider --tb=short -rf tests/gpu/test_decode_8bit_gluon.py > $OUT/tests.log 2>&1
  tail -3 $OUT/tests.log
  cd benchmarks/kernels && OUT_DIR=$OUT timeout 120 python3 decode_sweep.py --jobs 14 \
    qwen3-1.7b:32x16384:fp8_e4m3:32:HDN qwen3-1.7b:32x16384:fp8_e4m3:32:HDN:gluon=1 \
    qwen3-1.7b:32x16384:int8:32:HDN qwen3-1.7b:32x16384:int8:32:HDN:gluon=1 qwen3-1.7b:128x16384:fp8_e4m3:32:HDN qwen3-1.7b:128x16384:fp8_e4m3:32:HDN:gluon=1 qwen3-1.7b:1x16384:fp8_e4m3:32:HDN qwen3-1.7b:1x16384:fp8_e4m3:32:HDN:gluon=1 qwen3-1.7b:1x16384:int8:32:HDN:gluon=1 \
    qwen3-1.7b:128x16384:int8:32:HDN:gluon=1 smollm2:128x16384:fp8_e4m3:16:HDN \
    smollm2:128x16384:fp8_e4m3:16:HDN:gluon=1 smollm2:128x16384:int8:16:HDN \
    smollm2:128x16384:int8:16:HDN:gluon=1 smollm2:32x16384:fp8_e4m3:16:HDN smollm2:32x16384:fp8_e4m3:16:HDN:gluon=1 smollm2:32x16384:int8:16:HDN \
    smollm2:32x16384:int8:16:HDN:gluon=1 llama-3.1-8b:8x16384:fp8_e4m3:32:HDN llama-3.1-8b:8x16384:fp8_e4m3:32:HDN:gluon=1 \
    llama-3.1-8b:8x16384:int8:32:HDN:gluon=1 d256:32x16384:fp8_e4m3:32:HDN d256:32x16384:fp8_e4m3:32:HDN:gluon=1 \
    d256:32x16384:int8:32:HDN:gluon=1 > $OUT/sweep.log 2>&1
  cat $OUT/sweep.log
fi
# the same Gluon variants from the committed kernel before the address work (7baf5b1)
if [[ "$G" != *H200* ]]; then
  R=/work/main; R=$(cd ../.. && pwd)
  B=$(grep -o "[a-z0-9.-]*:[0-9x]*:[a-z0-9_]*:[0-9]*:HDN:gluon=1" $R/.helper/s20d.sh | sort -u)
  mkdir -p $OUT/base; (cd $R/.helper/base/benchmarks/kernels && PYTHONPATH=$R/.helper/base/src:/tmp/site OUT_DIR=$OUT/base timeout 100 python3 decode_sweep.py --jobs 14 $B > $OUT/sweep_base.log 2>&1)
  cat $OUT/sweep_base.log
fi
