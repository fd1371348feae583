#!/usr/bin/env bash
# serve2's GPU queue job (run from the helper copy's root, OUT_DIR set, src on PYTHONPATH):
# server vs offline with per-step logs, the cached-prefix TTFT probe's profile, and the HTTP
# path with a fake engine (this tree's server against src_base's, merge backlogs).
set -u
OUT_DIR=${OUT_DIR:-/tmp/serve2_out}
mkdir -p "$OUT_DIR"
M=src/kvfit/bench/configs/qwen3-1.7b.json
T0=$(date +%s)
el() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
nproc; nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
el "serve (the offline run of the same requests is in the probe job's engine)"
timeout ${SERVE_S:-28} python3 -m kvfit.bench.serve --model $M --load-format dummy \
    --kv-dtype fp8_e4m3 --num-prompts 256 --input-len 1024 --output-len 256 \
    --max-concurrency 64 --step-log "$OUT_DIR/steps" \
    --result-json "$OUT_DIR/serve.json" > "$OUT_DIR/serve.txt" 2>&1
echo "rc=$?"; grep -v "^INFO\|^WARNING\|^\[" "$OUT_DIR/serve.txt" | tail -42
el "offline run + probe profile"
timeout ${PROBE_S:-30} python3 benchmarks/serve/profile_probe.py --model $M --kv-dtype fp8_e4m3 \
    --out-dir "$OUT_DIR" --repeats 5 --offline-serve-log "$OUT_DIR/steps.offline.json" \
    > "$OUT_DIR/probe.txt" 2>&1
echo "rc=$?"; grep -v "^INFO\|^WARNING" "$OUT_DIR/probe.txt" | head -150
[ -f "$OUT_DIR/steps.server.json" ] && [ -f "$OUT_DIR/steps.offline.json" ] && \
    python3 benchmarks/serve/compare_steps.py "$OUT_DIR/steps.server.json" \
        "$OUT_DIR/steps.offline.json" --bucket-ms 250 2>&1 | tee "$OUT_DIR/compare_steps.txt" | head -60
el "fake engine HTTP path"
fake() {  # $1 = label, $2 = PYTHONPATH src dir, rest = extra flags
    local label=$1 src=$2; shift 2
    PYTHONPATH=$src:${PYTHONPATH:-} timeout 5 python3 benchmarks/serve/http_path.py \
        --mode process --step-ms 3 --host-ms 0.2 --num-prompts 128 --concurrency 64 \
        --output-len 128 --input-len 1024 "$@" > "$OUT_DIR/fake_$label.txt" 2>&1
    echo "$label rc=$?: $(grep -E 'server process CPU' "$OUT_DIR/fake_$label.txt") $(grep -E 'Median TTFT' "$OUT_DIR/fake_$label.txt") $(grep -E '^mode=' "$OUT_DIR/fake_$label.txt")"
}
UVL=/tmp/serve2_uvloop
if ! python3 -c "import uvloop" 2>/dev/null && ls wheels/uvloop-*.whl >/dev/null 2>&1; then
    python3 -m zipfile -e wheels/uvloop-*.whl $UVL
fi
[ -d src_base ] && fake base src_base
fake new src
[ -d $UVL ] && fake new_uvloop src:$UVL
fake new_merge2 src --merge-backlog 2
el "done"
