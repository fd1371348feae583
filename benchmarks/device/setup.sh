# Sourced at the start of every GPU-machine call: FlashInfer wheels, env, carried AOT .so files.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .device/whl/*.whl || exit 1
export PYTHONPATH=$PWD/src:/tmp/site FLASHINFER_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws
if ls .device/fiaot/fiaot.part.* >/dev/null 2>&1; then
  mkdir -p /tmp/site/flashinfer/data/aot
  cat .device/fiaot/fiaot.part.* | tar -xJ -C /tmp/site/flashinfer/data/aot
  echo "AOT FlashInfer modules: $(ls /tmp/site/flashinfer/data/aot | wc -l)"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used,memory.total --format=csv,noheader
