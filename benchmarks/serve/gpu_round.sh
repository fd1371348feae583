#!/usr/bin/env bash
# serve2's GPU queue job, round C (run from the helper copy's root, OUT_DIR set, src on
# PYTHONPATH): kvfit bench serve --offline with per-step logs of both runs; httptools (a declared
# dependency the GPU image lacks) from the carried wheel; the short table last.
set -u
OUT_DIR=${OUT_DIR:-/tmp/serve2_out}
mkdir -p "$OUT_DIR"
M=src/kvfit/bench/configs/qwen3-1.7b.json
T0=$(date +%s)
el() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
HT=/tmp/serve2_httptools
if ! python3 -c "import httptools" 2>/dev/null && ls wheels/httptools-*.whl >/dev/null 2>&1; then
    python3 -m zipfile -e wheels/httptools-*.whl $HT && export PYTHONPATH=$PYTHONPATH:$HT
fi
python3 -c "import httptools; print('httptools', httptools.__version__)" 2>&1 | tail -1
el "serve --offline"
timeout ${SERVE_S:-76} python3 -m kvfit.bench.serve --model $M --load-format dummy \
    --kv-dtype fp8_e4m3 --num-prompts 256 --input-len 1024 --output-len 256 \
    --max-concurrency 64 --offline --step-log "$OUT_DIR/steps" \
    --result-json "$OUT_DIR/serve.json" > "$OUT_DIR/serve.txt" 2>&1
echo "rc=$?"
el "done"
grep -v "^INFO\|^WARNING\|^\[\|^20" "$OUT_DIR/serve.txt" | tail -34
[ -f "$OUT_DIR/steps.server.json" ] && [ -f "$OUT_DIR/steps.offline.json" ] && \
    python3 benchmarks/serve/compare_steps.py "$OUT_DIR/steps.server.json" \
        "$OUT_DIR/steps.offline.json" --bucket-ms 250 > "$OUT_DIR/compare_steps.txt" 2>&1
grep -E "^==|decode-only|decode rows" "$OUT_DIR/compare_steps.txt" 2>/dev/null
python3 benchmarks/serve/round_table.py "$OUT_DIR"
