#!/usr/bin/env bash
# An outside load generator against `pdserve proxy`, unchanged: NVIDIA AIPerf's standard streaming chat
# benchmark on a local 1P1D (`pdserve up`, embedded SmolLM2-135M unless MODEL is set).
#
#   bash benchmarks/aiperf_chat.sh [OUT_DIR]
#
# AIPerf lives in its own venv (AIPERF_VENV, default /tmp/aiperf-venv; created with aiperf==0.13.0 from PyPI
# when missing): its dependencies are not pdserve's. Env: MODEL, CONCURRENCY (4), REQUESTS (48),
# ISL (128), OSL (64), PDSERVE (the pdserve command, default: .venv/bin/pdserve or pdserve on PATH), PY.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-$(mktemp -d /tmp/aiperf-chat.XXXXXX)}
VENV=${AIPERF_VENV:-/tmp/aiperf-venv}
CONCURRENCY=${CONCURRENCY:-4}
REQUESTS=${REQUESTS:-48}
ISL=${ISL:-128}
OSL=${OSL:-64}
PDSERVE=${PDSERVE:-$( [ -x .venv/bin/pdserve ] && echo .venv/bin/pdserve || echo pdserve )}
mkdir -p "$OUT"

if [ ! -x "$VENV/bin/aiperf" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q aiperf==0.13.0
fi

# The model folder (for AIPerf's synthetic prompts, tokenized with the served model's tokenizer), resolved by
# the python that runs pdserve.
PY=${PY:-$(dirname "$(command -v "$PDSERVE")")/python}
MODEL_DIR=$("$PY" -c 'import sys; from pdserve.model.default_model import resolve_model; print(resolve_model(sys.argv[1] or None))' "${MODEL:-}")

"$PDSERVE" up "$MODEL_DIR" --topology 1p1d --port 0 --log-dir "$OUT/logs" > "$OUT/up.log" 2>&1 &
UP_PID=$!
trap 'kill -TERM "$UP_PID" 2>/dev/null; wait "$UP_PID" 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  grep -q PDSERVE_READY "$OUT/up.log" && break
  kill -0 "$UP_PID" 2>/dev/null || { cat "$OUT/up.log"; exit 1; }
  sleep 0.5
done
PROXY=$(grep -o 'PDSERVE_READY proxy=[^ ]*' "$OUT/up.log" | head -1 | cut -d= -f2)
NAME=$(curl -s "$PROXY/v1/models" | python3 -c "import json, sys; print(json.load(sys.stdin)['data'][0]['id'])")
echo "proxy $PROXY serving $NAME; aiperf output in $OUT" >&2

"$VENV/bin/aiperf" profile \
  --model "$NAME" --url "$PROXY" --endpoint-type chat --streaming \
  --tokenizer "$MODEL_DIR" \
  --synthetic-input-tokens-mean "$ISL" --synthetic-input-tokens-stddev 0 \
  --output-tokens-mean "$OSL" --output-tokens-stddev 0 \
  --extra-inputs ignore_eos:true --extra-inputs "min_tokens:$OSL" \
  --concurrency "$CONCURRENCY" --request-count "$REQUESTS" --warmup-request-count 2 \
  --artifact-dir "$OUT/artifacts" --ui-type none 2>&1 | tee "$OUT/aiperf.txt"
curl -s "$PROXY/metrics" | grep -E '^pdserve_proxy_requests_total' | tee "$OUT/proxy-paths.txt"
