#!/usr/bin/env bash
# serve2's GPU queue job (run from the helper copy's root, OUT_DIR set, src on PYTHONPATH):
# server run with per-step logs; the same requests offline with a step log + the cached-prefix
# TTFT probe's profile (one engine); the HTTP path with a fake engine (src_base vs src);
# the short table last.
set -u
OUT_DIR=${OUT_DIR:-/tmp/serve2_out}
mkdir -p "$OUT_DIR"
M=src/kvfit/bench/configs/qwen3-1.7b.json
T0=$(date +%s)
el() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
nproc; nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
python3 -c "import uvloop, httptools; print('uvloop', uvloop.__version__)" 2>&1 | tail -1
el "serve"
timeout ${SERVE_S:-28} python3 -m kvfit.bench.serve --model $M --load-format dummy \
    --kv-dtype fp8_e4m3 --num-prompts 256 --input-len 1024 --output-len 256 \
    --max-concurrency 64 --step-log "$OUT_DIR/steps" \
    --result-json "$OUT_DIR/serve.json" > "$OUT_DIR/serve.txt" 2>&1
echo "rc=$?"; grep -v "^INFO\|^WARNING\|^\[" "$OUT_DIR/serve.txt" | tail -30
el "offline run + probe profile"
timeout ${PROBE_S:-30} python3 benchmarks/serve/profile_probe.py --model $M --kv-dtype fp8_e4m3 \
    --out-dir "$OUT_DIR" --repeats 5 --offline-serve-log "$OUT_DIR/steps.offline.json" \
    > "$OUT_DIR/probe.txt" 2>&1
echo "rc=$?"; grep -v "^INFO\|^WARNING" "$OUT_DIR/probe.txt" | head -120
[ -f "$OUT_DIR/steps.server.json" ] && [ -f "$OUT_DIR/steps.offline.json" ] && \
    python3 benchmarks/serve/compare_steps.py "$OUT_DIR/steps.server.json" \
        "$OUT_DIR/steps.offline.json" --bucket-ms 250 > "$OUT_DIR/compare_steps.txt" 2>&1
head -12 "$OUT_DIR/compare_steps.txt" 2>/dev/null
el "fake engine HTTP path"
fake() {  # $1 = label, $2 = PYTHONPATH src dir, rest = extra flags
    local label=$1 src=$2; shift 2
    PYTHONPATH=$src:${PYTHONPATH:-} timeout 6 python3 benchmarks/serve/http_path.py \
        --mode process --step-ms 3 --host-ms 0.2 --num-prompts 128 --concurrency 64 \
        --output-len 128 --input-len 1024 "$@" > "$OUT_DIR/fake_$label.txt" 2>&1
    echo "$label rc=$?: $(grep -E 'server process CPU' "$OUT_DIR/fake_$label.txt") $(grep -E 'Median TTFT' "$OUT_DIR/fake_$label.txt") $(grep -E '^mode=' "$OUT_DIR/fake_$label.txt")"
}
fake new src
[ -d src_base ] && fake base src_base
el "done"
cat "$OUT_DIR/compare_steps.txt" 2>/dev/null | sed -n 1,4p
grep -E "^probe|syncs in|profiled cached|^execute|^random batch|^offline serve" "$OUT_DIR/probe.txt"
python3 benchmarks/serve/round_table.py "$OUT_DIR"
