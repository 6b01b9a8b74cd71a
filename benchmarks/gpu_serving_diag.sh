#!/usr/bin/env bash
# The GPU serving path under load, one GPU: a collocated `pdserve serve` with the step log on, driven
# by `pdserve bench` scenarios, each summarised from the step log (where each step's time went).
# Usage: bash benchmarks/gpu_serving_diag.sh [SCENARIO...]
#   SCENARIO = name:input_len:output_len:rate:num_prompts:temperature[:max_concurrency]
#   temperature "default" sends none (the server's default, 1.0: what `vllm bench serve` sends when
#   --temperature is not given). Default scenarios: the seed's 8192-in prompts at a low rate, sampled
#   and greedy.
# Env: TOK (tokenizer folder), MODEL (packaged dummy shape), SERVE_EXTRA (more `pdserve serve` flags;
# with TOPOLOGY, more `pdserve up` flags), TOPOLOGY (e.g. 1p1d: `pdserve up` instead, decode steps logged).
set -u
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
TOK=${TOK:-.whl/smol-tok}
MODEL=${MODEL:-Llama-3.1-8B}
PORT=${PORT:-8300}
scenarios=("$@")
[ ${#scenarios[@]} -eq 0 ] && scenarios=(sampled:8192:64:0.3:8:default greedy:8192:64:0.3:8:0)
clock() { python3 -c "import time; print(time.perf_counter())"; }

if [ -z "${TOPOLOGY:-}" ]; then
  STEPS="$OUT/steps.jsonl"
  PDSERVE_STEP_LOG="$STEPS" python3 -m pdserve serve "$MODEL" --load-format dummy --tokenizer "$TOK" \
    --no-enable-prefix-caching --host 127.0.0.1 --port "$PORT" ${SERVE_EXTRA:-} > "$OUT/serve.log" 2>&1 &
  server=$!
  URL="http://127.0.0.1:$PORT"
  for _ in $(seq 400); do
    curl -sf "$URL/health" > /dev/null && break
    kill -0 $server 2>/dev/null || break
    sleep 1
  done
else
  # TOPOLOGY=1p1d (GPUS, default 0: both on one GPU, each with GPU_MEM of it): the decode side's steps.
  STEPS="$OUT/steps-kv_consumer.jsonl"
  PDSERVE_STEP_LOG="$OUT/steps-{role}.jsonl" python3 -m pdserve up --topology "$TOPOLOGY" --model "$MODEL" \
    --gpus "${GPUS:-0}" --log-dir "$OUT/up-logs" --port "$PORT" --startup-timeout 400 \
    --serve-arg=--load-format --serve-arg=dummy --serve-arg=--tokenizer "--serve-arg=$TOK" \
    --serve-arg=--no-enable-prefix-caching "--serve-arg=--gpu-memory-utilization ${GPU_MEM:-0.9}" \
    ${SERVE_EXTRA:-} > "$OUT/serve.log" 2>&1 &
  server=$!
  for _ in $(seq 400); do grep -q PDSERVE_READY "$OUT/serve.log" && break; kill -0 $server 2>/dev/null || break; sleep 1; done
  URL=$(grep -o 'PDSERVE_READY proxy=[^ ]*' "$OUT/serve.log" | head -1 | cut -d= -f2)
fi
grep -i "graph\|threads\|error" "$OUT/serve.log" | head -5
if ! kill -0 $server 2>/dev/null; then tail -20 "$OUT/serve.log"; exit 1; fi
for sc in "${scenarios[@]}"; do
  IFS=: read -r name inlen outlen rate num temp conc <<< "$sc"
  extra=()
  [ "$temp" != default ] && extra+=(--temperature "$temp")
  [ -n "${conc:-}" ] && extra+=(--max-concurrency "$conc")
  t0=$(clock)
  timeout 300 python3 -m pdserve bench --base-url "$URL" --model "$MODEL" --tokenizer "$TOK" \
    --dataset-name random --random-input-len "$inlen" --random-output-len "$outlen" --ignore-eos \
    --num-prompts "$num" --request-rate "$rate" "${extra[@]}" \
    --percentile-metrics ttft,tpot,itl --metric-percentiles 50,99 --disable-tqdm > "$OUT/bench_$name.txt" 2>&1
  t1=$(clock)
  echo "=== $sc"
  grep -E "throughput \(|P50|P99|Successful" "$OUT/bench_$name.txt"
  python3 benchmarks/step_log_summary.py "$STEPS" --since "$t0" --until "$t1" | tee "$OUT/steps_$name.txt"
done
kill -TERM $server; wait $server
