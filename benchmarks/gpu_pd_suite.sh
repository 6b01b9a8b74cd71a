#!/usr/bin/env bash
# P/D measurements on a GPU host, in one device call (stages are bounded; logs land in $OUT):
#   topology   nvidia-smi's P2P matrix (the seed's check)
#   kv         NIXL READ of an 8k-token Llama-3.1-8B-shaped prompt vs a raw copy: same GPU, and GPU1 -> GPU0
#              (contiguous = coalesced descriptors, whole 2 MiB blocks scattered, 1 MiB blocks scattered)
#   pd1        bench_pd: 1P1D sharing GPU 0 vs collocated on GPU 0 (TTFT added by the handoff)
#   pd2        bench_pd: P on GPU 0, D on GPU 1 vs collocated on GPU 0
#   preflight  pdserve up (1P1D over GPUs 0 and 1) + pdserve preflight against it
#   preflight1 the same with P and D sharing GPU 0
#   compare    pdserve bench compare: collocated:2 (one replica per GPU) vs 1p1d (P on GPU 0, D on GPU 1),
#              seed workload (random 8192 in / 256 out, ignore-eos, goodput ttft:2000 tpot:30)
#   compare1   the same on one GPU: one collocated replica vs 1P1D sharing GPU 0, each side given the same
#              GPU memory: the replica GPU_MEM (default 0.84), P and D half of it each (`pdserve bench
#              compare` refuses targets given unequal resources)
# Usage: bash benchmarks/gpu_pd_suite.sh STAGE... (default: topology kv pd1 pd2)
# Env: TOK (tokenizer folder for the dummy model's servers), RATES, NUM_PROMPTS, MODEL (compare stages:
# a packaged dummy shape, default Llama-3.1-8B), COMPARE_DIR (compare stages' output folder),
# COMPARE_TIMEOUT (seconds, default 560), IN_LEN / OUT_LEN / GOODPUT (compare stages' workload, default the
# seed's 8192 / 256 / "ttft:2000 tpot:30"; the RAG shape: IN_LEN=28000 OUT_LEN=650 GOODPUT="ttft:2500 tpot:45"),
# GPU_MEM (compare1: each side's GPU memory, default 0.84).
set -u
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
TOK=${TOK:-.whl/smol-tok}
NGPU=$(nvidia-smi -L | wc -l)
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(topology kv pd1 pd2)
SERVE_ARGS=(--serve-arg=--tokenizer "--serve-arg=$TOK" --serve-arg=--max-num-seqs --serve-arg=64)

# pdserve up a 1P1D (with these `pdserve up` arguments), then pdserve preflight against its proxy.
live_preflight() {
  # shellcheck disable=SC2086 # $1 is a list of arguments
  python3 -m pdserve up --topology 1p1d --model "${MODEL:-Llama-3.1-8B}" $1 --log-dir "$OUT/up-logs" \
    --serve-arg=--load-format --serve-arg=dummy --serve-arg=--tokenizer "--serve-arg=$TOK" \
    --startup-timeout 300 > "$OUT/up.txt" 2>&1 &
  local up=$! proxy
  for _ in $(seq 300); do grep -q PDSERVE_READY "$OUT/up.txt" && break; kill -0 $up 2>/dev/null || break; sleep 1; done
  proxy=$(grep -o 'PDSERVE_READY proxy=[^ ]*' "$OUT/up.txt" | head -1 | cut -d= -f2)
  if [ -n "$proxy" ]; then
    timeout 180 python3 -m pdserve preflight --proxy "$proxy" --long-prompt-tokens 8192 2>&1 | tee "$OUT/preflight.txt"
  else
    tail -30 "$OUT/up.txt"
  fi
  kill -TERM $up; wait $up
}

# pdserve bench compare on the seed's workload: COLLOCATED_TOPOLOGY vs 1p1d, with `pdserve up` arguments.
seed_compare() {
  local up="$2 --serve-arg=--load-format --serve-arg=dummy --serve-arg=--no-enable-prefix-caching \
    --serve-arg=--tokenizer --serve-arg=$TOK --startup-timeout 400"
  timeout "${COMPARE_TIMEOUT:-560}" python3 -m pdserve bench compare --launch "collocated=$1" --launch pd=1p1d \
    --launch-args "--model ${MODEL:-Llama-3.1-8B} $up" --model "${MODEL:-Llama-3.1-8B}" --tokenizer "$TOK" \
    --dataset-name random --random-input-len "${IN_LEN:-8192}" --random-output-len "${OUT_LEN:-256}" --ignore-eos \
    --num-prompts "${NUM_PROMPTS:-24}" --request-rates "${RATES:-0.4,1,2}" \
    --percentile-metrics ttft,tpot,itl --metric-percentiles 50,99 --goodput ${GOODPUT:-ttft:2000 tpot:30} \
    --transfer-check-url auto --output-dir "$3" --disable-tqdm 2>&1 | tail -40
}

for stage in "${stages[@]}"; do
  echo "=== $stage $(date -u +%H:%M:%S)"
  case $stage in
    topology)
      nvidia-smi topo -m 2>&1 | tee "$OUT/topo.txt"
      nvidia-smi topo -p2p r 2>&1 | tee -a "$OUT/topo.txt" ;;
    kv)
      for dev in "cuda:0" "cuda:1"; do
        [ "$dev" = "cuda:1" ] && [ "$NGPU" -lt 2 ] && continue
        for mode in "" "--scatter" "--scatter --block-size 8"; do
          echo "--- producer $dev -> consumer cuda:0 $mode"
          timeout 120 python3 benchmarks/bench_kv_transfer.py --tokens 8192 --device cuda:0 \
            --producer-device "$dev" --iters 10 $mode 2>&1 | grep -v "^\[" | tail -8
        done
      done 2>&1 | tee "$OUT/kv.txt" ;;
    pd1)
      timeout 300 python3 benchmarks/bench_pd.py --model Llama-3.1-8B --load-format dummy --gpu \
        --prompt-len 8192 --output-len 64 --num-requests 5 "${SERVE_ARGS[@]}" 2>&1 | tail -24 | tee "$OUT/pd1.txt" ;;
    pd2)
      [ "$NGPU" -lt 2 ] && continue
      timeout 300 python3 benchmarks/bench_pd.py --model Llama-3.1-8B --load-format dummy --gpus 0,1 \
        --prompt-len 8192 --output-len 64 --num-requests 5 "${SERVE_ARGS[@]}" 2>&1 | tail -12 | tee "$OUT/pd2.txt" ;;
    preflight)
      # A live 1P1D (P on GPU 0, D on GPU 1), then the seed's go/no-go checks against it.
      live_preflight "--gpus 0,1" ;;
    preflight1)
      # The same with P and D sharing GPU 0.
      live_preflight "--gpus 0 --serve-arg=--gpu-memory-utilization --serve-arg=0.42" ;;
    compare)
      # one collocated replica per GPU vs P on GPU 0, D on GPU 1
      seed_compare collocated:2 "--gpus 0,1" "${COMPARE_DIR:-$OUT/compare}" ;;
    compare1)
      # one GPU: one collocated replica vs P and D sharing it, the same memory on both sides (per role)
      mem=${GPU_MEM:-0.84}
      half=$(python3 -c "print(round($mem / 2, 4))")
      seed_compare collocated:1 "--gpus 0 --collocated-arg=--gpu-memory-utilization=$mem \
        --prefill-arg=--gpu-memory-utilization=$half --decode-arg=--gpu-memory-utilization=$half" \
        "${COMPARE_DIR:-$OUT/compare1}" ;;
  esac
done
