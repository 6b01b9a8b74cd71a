#!/usr/bin/env bash
# Issue 42's GPU wave in ONE device call: install the carried wheels, then run sections one after another, each
# under its own `timeout`, a failed one not stopping the rest, all within one wall-clock budget.
#
#   bash benchmarks/gpu_wave.sh                      # from the repo root on the GPU machine, `.whl` carried
#   SECTIONS=correct,suite,pd1 bash benchmarks/gpu_wave.sh
#   WAVE_PRINT=1 bash benchmarks/gpu_wave.sh         # print each section's command and budget, run nothing
#
# Sections (SECTIONS picks them and their order; default: correct,suite,speccheck,spec,pd1,multiturn; a section
# that does not fit the time left is skipped, so the order is the priority):
#   correct    the GPU correctness suite (gpu_suite.py: kernels vs float32 SDPA, the tiny engines vs
#              transformers, the 8B-shape logits), with the same-run ceilings
#   suite      the GPU unit tests of the KV digests' fused kernel (tests/test_kv_digest_gpu.py, first, <= 60 s), then
#              issue 42 step 1's engine figures with same-run ceilings (gpu_suite.py, cheapest first): P1 decode
#              b1, P2 decode b64 2k, P3 prefill 8k, long prompts 8k / 32k / 64k (triton and triton-cudnn)
#   digest     the digest kernel's tests, then the KV digests' cost against the same run's NIXL READ (VRAM, CUDA
#              IPC) at 1k/4k/16k tokens on the Llama-3.1-8B shape (bench_kv_transfer.py --digest both): the fused
#              kernel, the torch reduction, the producer's hold. Not in the default SECTIONS: SECTIONS=digest
#   speccheck  the verify kernel and verify CUDA graphs vs eager vs plain decode (pdserve.testing.spec_verify_check)
#   spec       the verify step's cost against a plain graph step (gpu_spec_verify_cost.py, batch 1/4/16, K=4)
#   specitl    ngram ITL on the 8B shape, verify graphs vs eager vs plain (gpu_spec_ngram_itl.py)
#   pd1        the pull handoff, 1P1D sharing the GPU vs collocated (gpu_pd_suite.sh pd1: +ms from the first
#              token, early decode leg, by recompute)
#   pushcheck  gpu-push's CUDA-event seam check and WRITE costs (gpu_push_check.py, test_push_layer_ready.py)
#   push       pull vs push rows on the GPU (bench_pd_push.py --gpu, 8k and 256; PUSH_ARGS for gpu-push's full set)
#   multiturn  the pull-or-recompute choice per turn (bench_multiturn.py, 8B shape, P and D sharing the GPU, fixed
#              answers of 64 and 640 tokens: histories on both sides of the break-even; 3 conversations one after
#              another, as the cost model prices a turn alone; mode on-pull measures the reads the cost model
#              declined; a turn flagged WRONG chose the slower way)
#
# Env: WAVE_BUDGET_S (the whole command's wall budget, default 520: the device call's 600 s limit less the
# wheels' install and a margin), BUDGET_<SECTION> (a section's cap in seconds, e.g. BUDGET_PD1=200),
# WHEELS (default .whl), TOK (tokenizer folder for the dummy model's servers, default $WHEELS/smol-tok),
# SUITE_ONLY (gpu_suite.py section names for `suite`), SPEC_ARGS, PUSH_ARGS, MULTITURN_ARGS (replace the
# default arguments of those sections' scripts).
#
# What comes back (the device returns at most 8 files): $OUT/wave.log (every section's output), $OUT/wave.json
# (each section's status, seconds and the JSON it wrote), $OUT/wave.md (the tables), $OUT/logs.tar.gz (server
# and step logs, plots). They are rewritten after every section, so a run cut short still returns what ran.
set -u
T0=$(date +%s)
ROOT=$(pwd)
OUT=${OUT:-$(mktemp -d -t wave-out.XXXXXX)}
WORK=${WAVE_WORK:-$(mktemp -d -t wave.XXXXXX)}
SITE=${WAVE_SITE:-$(mktemp -d -t wave-site.XXXXXX)}  # the carried wheels are installed here
WHEELS=${WHEELS:-.whl}
TOK=${TOK:-$ROOT/$WHEELS/smol-tok}
BUDGET=${WAVE_BUDGET_S:-520}
SECTIONS=${SECTIONS:-correct,suite,speccheck,spec,pd1,multiturn}
[ -z "${WAVE_PRINT:-}" ] && rm -rf "$WORK"  # a second wave on a warm machine must not fold in the first's files
mkdir -p "$OUT" "$WORK"
: > "$WORK/sections.tsv"
LOG=$OUT/wave.log
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y  # NIXL READ over CUDA IPC, not TCP (h200-facts.md); pdserve sets it too

# section name -> its cap in seconds (estimates from BENCHMARKS.md's recorded section times, in comments)
declare -A CAP=(
  [correct]=150    # correctness_kernels 8-10 s, correctness_engines 24-40 s, correctness_8b ~30 s, + imports/JIT
  [suite]=200      # digest kernel tests ~30 s; engine_init 6-23 s, P1 2, P2 8, P3 1, long 8k 3 / 32k 8 / 64k 23 s,
                   # + imports/JIT, warm-ups
  [digest]=200     # kernel tests ~30 s; a producer process (CUDA + NIXL init ~30 s), 10 x 3 sizes x digests off/on
  [speccheck]=150  # spec-graphs' estimate: ~90 s with a cold Triton cache (kernel cases, tiny engines)
  [spec]=130       # one 8B engine (graphs) + 3 batches x (prefill 2k tokens each, timed steps); spec-graphs: 60-90 s
  [specitl]=120    # spec-graphs' estimate: 60-90 s
  [pd1]=200        # collocated, then P and D: three 8B dummy servers started, 4 rounds of 5 x 8k requests
  [pushcheck]=120  # gpu-push's estimate: 30-45 s incl. CUDA init of two processes, + its unit tests ~10 s
  [push]=240       # 8B dummy servers for collocated, pull and both push modes, 8k and 256 (gpu-push: ~4 min all)
  [multiturn]=250  # modes on + on-pull: P + D + proxy (8B dummy) twice (~30 s each to serve, prefill cost measured),
                   # 3 conversations x 4 turns one after another with answers of 64 and of 640 tokens (~50 s of
                   # decode a mode at ~5.7 ms a token), then 18 turns' recompute timings (~15 s); 162 s side by side
)
declare -A MIN=([correct]=60 [suite]=60 [digest]=90 [speccheck]=60 [spec]=50 [specitl]=50 [pd1]=90 [pushcheck]=45 [push]=120
                [multiturn]=80)

left() { echo $(( BUDGET - ($(date +%s) - T0) )); }

collect() {
  python3 benchmarks/gpu_wave_collect.py --work "$WORK" --out "$OUT" >/dev/null 2>>"$LOG" || true
}

# run_section NAME CMD...: under `timeout min(cap, time left)`, output teed to the section's and the wave's log
run_section() {
  local name=$1; shift
  local cap_var="BUDGET_${name^^}"
  local cap=${!cap_var:-${CAP[$name]:-120}}
  local rem; rem=$(left)
  local t=$(( cap < rem - 5 ? cap : rem - 5 ))
  local dir=$WORK/$name
  mkdir -p "$dir"
  if [ -n "${WAVE_PRINT:-}" ]; then
    printf '%s (cap %ss): %s\n' "$name" "$cap" "$*"; return 0
  fi
  if [ "$t" -lt "${MIN[$name]:-30}" ]; then
    echo "=== $name: skipped, ${rem}s left of the wave's ${BUDGET}s (needs ${MIN[$name]:-30})" | tee -a "$LOG"
    printf '%s\tskipped\t0\t%s\n' "$name" "$cap" >> "$WORK/sections.tsv"
    collect; return 0
  fi
  echo "=== $name $(date -u +%H:%M:%S), budget ${t}s: $*" | tee -a "$LOG"
  local s0; s0=$(date +%s)
  ( cd "$ROOT" && mkdir -p "$dir/tmp" && export TMPDIR="$dir/tmp" SECTION_BUDGET_S="$t" && timeout -k 10 "$t" "$@" ) 2>&1 | tee "$dir/stdout.txt" >> "$LOG"
  local rc=${PIPESTATUS[0]}
  local secs=$(( $(date +%s) - s0 ))
  local status=ok
  [ "$rc" -ne 0 ] && status="rc=$rc"
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && status="timeout"
  echo "=== $name: $status in ${secs}s" | tee -a "$LOG"
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$secs" "$t" >> "$WORK/sections.tsv"
  reap "$name"
  collect
}

# A section's processes are done when it returns (`timeout` signals its whole process group); a server that left
# its group and outlived it would hold GPU memory the next section needs: end it by its pid.
reap() {
  local pids; pids=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' ')
  [ -z "$pids" ] && return 0
  echo "=== $1 left GPU processes behind: $(echo $pids | tr '\n' ' ')- ending them" | tee -a "$LOG"
  for pid in $pids; do kill -TERM "$pid" 2>/dev/null; done
  sleep 3
  for pid in $pids; do kill -KILL "$pid" 2>/dev/null; done
}

# needs SECTION FILE: a section whose script another branch brings runs only once that branch is merged
needs() {
  [ -f "$2" ] && return 0
  echo "=== $1: skipped, $2 is not in this checkout (not merged yet)" | tee -a "$LOG"
  printf '%s\tmissing\t0\t0\n' "$1" >> "$WORK/sections.tsv"
  return 1
}

# -- the carried wheels (device README: pip --target a scratch dir, PYTHONPATH) --------------------------------
if [ -z "${WAVE_PRINT:-}" ]; then
  {
    echo "=== wave $(date -u +%FT%TZ) sections=$SECTIONS budget=${BUDGET}s commit=$(git rev-parse --short HEAD 2>/dev/null)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$WHEELS"/*.whl 2>&1 | grep -v "^WARNING: Target directory" | tail -5
    echo "wheels installed in $(( $(date +%s) - T0 ))s"
  } 2>&1 | tee -a "$LOG"
fi
export PYTHONPATH=$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}
if [ -z "${WAVE_PRINT:-}" ] && ! python3 -c "import cryptography, fastapi, nixl_cu13, pdserve.server" >> "$LOG" 2>&1; then
  echo "=== the carried wheels do not import: see above" | tee -a "$LOG"
fi

SUITE_ONLY=${SUITE_ONLY:-p1_decode_b1,p2_decode_b64_2k,p3_prefill_1x8192,long_context_8192,long_context_32768,long_context_65536}
# gpu_suite.py stops starting sections 15 s before the section's timeout, so that it writes its summary
# shellcheck disable=SC2016 # expanded by the inner shell, where run_section set SECTION_BUDGET_S
SUITE='exec python3 benchmarks/gpu_suite.py --out "$1" --budget-s $((SECTION_BUDGET_S - 15 - SECONDS)) --only "$2"'
# the KV digests' fused-kernel tests run first in `suite` (SECONDS, bash's own clock, then shortens the suite's budget)
DIGEST_TESTS='timeout -k 5 60 python3 -m pytest -q -p no:cacheprovider tests/test_kv_digest_gpu.py; '
IFS=, read -r -a want <<< "$SECTIONS"
for sec in "${want[@]}"; do
  case $sec in
    correct)
      run_section correct bash -c "$SUITE" _ "$WORK/correct" correctness_kernels,correctness_engines,correctness_8b ;;
    suite)
      run_section suite bash -c "$DIGEST_TESTS$SUITE" _ "$WORK/suite" "$SUITE_ONLY" ;;
    digest)
      # the kernel's tests first (the same as in `suite`), so that the figures come from a checked kernel
      run_section digest bash -c "${DIGEST_TESTS}exec python3 benchmarks/bench_kv_transfer.py --device cuda \
        --tokens 1024,4096,16384 --digest both --iters 10 --json $WORK/digest/bench_kv_transfer_digest.json" ;;
    speccheck)
      # spec-graphs' READY: the multi-query verify kernel vs float32 SDPA (drafts padded to K, bf16 and fp8 pools),
      # then tiny engines: verify CUDA graphs == eager verify == plain greedy decode (exit 1 on any failure)
      needs speccheck pdserve/testing/spec_verify_check.py && \
        run_section speccheck python3 -m pdserve.testing.spec_verify_check ;;
    spec)
      # the verify step vs a plain graph step (spec-graphs keeps these arguments; its columns add the verify
      # graph, uneven drafts and eager verify in one run; "(eager!)" = the graphs did not replay)
      # shellcheck disable=SC2086 # SPEC_ARGS is a list of arguments
      run_section spec python3 benchmarks/gpu_spec_verify_cost.py \
        ${SPEC_ARGS:---model Llama-3.1-8B --batch 1,4,16 --context 2048 --k 4} ;;
    specitl)
      # spec-graphs' READY: ngram ITL, 8B shape, repetitive prompts, plain vs ngram with verify graphs vs eager
      needs specitl benchmarks/gpu_spec_ngram_itl.py && run_section specitl python3 benchmarks/gpu_spec_ngram_itl.py \
        --model Llama-3.1-8B --batch 1,4 --k 4 --max-tokens 96 ;;
    pd1)
      run_section pd1 env OUT="$WORK/pd1" TOK="$TOK" bash benchmarks/gpu_pd_suite.sh pd1 ;;
    pushcheck)
      # gpu-push's READY: the CUDA-event seam's correctness and one request's WRITE time by descriptor shape (no
      # servers; exit 0 = PASS), then its GPU unit tests
      if needs pushcheck benchmarks/gpu_push_check.py; then
        run_section pushcheck bash -c "python3 benchmarks/gpu_push_check.py; rc=\$?; \
          timeout 60 python3 -m pytest -q tests/test_push_layer_ready.py; exit \$rc"
      fi ;;
    push)
      # gpu-push's READY: pull vs whole-request push vs layer-pipelined push vs collocated (bench_pd_push.py reads
      # SECTION_BUDGET_S and skips what would not finish). Its full set (8192,32768,256 over CUDA IPC, then 8192
      # over TCP: ~3.5-4.5 min): BUDGET_PUSH=330 PUSH_ARGS="--gpu ... --prompt-len 8192,32768,256
      # --tcp-prompt-lens 8192 --output-len 32 --num-requests 3 ..."
      # shellcheck disable=SC2086
      needs push benchmarks/bench_pd_push.py && run_section push python3 benchmarks/bench_pd_push.py \
        ${PUSH_ARGS:---gpu --model Llama-3.1-8B --load-format dummy --prompt-len 8192,256 --tcp-prompt-lens= \
        --output-len 32 --num-requests 3 --serve-arg=--tokenizer --serve-arg=$TOK --json $WORK/push/push-gpu.json} ;;
    multiturn)
      # shellcheck disable=SC2086
      run_section multiturn python3 benchmarks/bench_multiturn.py \
        ${MULTITURN_ARGS:---model Llama-3.1-8B --serve-arg=--load-format --serve-arg=dummy \
        --serve-arg=--gpu-memory-utilization --serve-arg=0.4 --tokenizer $TOK --modes on,on-pull \
        --answer-len 64,640 --turns 4 --conversations 3 --max-concurrency 1 \
        --proxy-arg=--kv-history-bandwidth --proxy-arg=cuda-ipc \
        --out-dir $WORK/multiturn} ;;
    *)
      echo "=== unknown section $sec (correct suite digest speccheck spec specitl pd1 pushcheck push multiturn)" | tee -a "$LOG" ;;
  esac
done
[ -z "${WAVE_PRINT:-}" ] && echo "=== wave done in $(( $(date +%s) - T0 ))s" | tee -a "$LOG"
collect
exit 0
