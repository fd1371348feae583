#!/usr/bin/env bash
# The test command (CI runs this): CPU tests; GPU tests skip without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 -m pytest -q -m "not slow" "$@"
