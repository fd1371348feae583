# Sourced by benchmarks/gpu/reproduce.sh on the GPU machine, from the repository root.
# Installs the FlashInfer wheel bundle that /work/shared/device/make-bundle.sh builds into
# .device/whl/ (when present) under /tmp/site, and sets the environment every run needs:
# this tree's src/ first on PYTHONPATH, FlashInfer JIT-compiled for sm_90 only, unbuffered output.
# FlashInfer modules JIT-built by an earlier run can be carried as .device/fiaot/fiaot.part.*
# (a split .tar.xz of NAME/NAME.so); they are unpacked as FlashInfer's AOT modules.
if ls .device/whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .device/whl/*.whl || return 1
fi
export PYTHONPATH=$PWD/src:/tmp/site FLASHINFER_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws
if ls .device/fiaot/fiaot.part.* >/dev/null 2>&1; then
  mkdir -p /tmp/site/flashinfer/data/aot
  cat .device/fiaot/fiaot.part.* | tar -xJ -C /tmp/site/flashinfer/data/aot
  echo "AOT FlashInfer modules: $(ls /tmp/site/flashinfer/data/aot | wc -l)"
fi
python3 -c "import flashinfer" 2>/dev/null || echo "FlashInfer does not import: fi rows will be skipped"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used,memory.total \
  --format=csv,noheader
