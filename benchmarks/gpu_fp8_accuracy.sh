#!/usr/bin/env bash
# fp8 KV accuracy on the GPU with the real embedded model (issue 42 part 3), across two device calls.
#
# The model's GGUF (98 MB) with .whl (30 MB) and the tree (7 MB) is over one call's 64 MiB carry, so it
# travels in four parts over three calls made back to back: ignored paths already on a warm device machine
# are kept between calls, so each call finds what the earlier ones carried. `prepare` (here) splits it into
# .fp8a/ (parts 0 and 1), .fp8b/ (part 2 and the md5) and .fp8c/ (part 3). `run` (the third call)
# reassembles and checks the GGUF, converts it with pdserve's own converter and runs bench_kv_fp8_accuracy.py
# with the bf16 model (every fp8 format) and with the float32 model (e4m3), then gpu_spec_ngram_itl.py on the
# same real weights (the 8B shape's dummy weights never draft).
#
#   bash benchmarks/gpu_fp8_accuracy.sh prepare                    # CPU box, writes .fp8a/ .fp8b/ .fp8c/
#   bash benchmarks/gpu_fp8_accuracy.sh noop                       # device call 1, carry [".fp8a"]
#   bash benchmarks/gpu_fp8_accuracy.sh noop                       # device call 2, carry [".whl", ".fp8b"]
#   OUT=$OUT bash benchmarks/gpu_fp8_accuracy.sh run               # device call 3, carry [".fp8c"]
set -euo pipefail
case ${1:-} in
  prepare)
    gguf=$(.venv/bin/python -c "from pdserve.model.default_model import find_embedded_gguf as f; print(f())")
    rm -rf .fp8a .fp8b .fp8c && mkdir -p .fp8a .fp8b .fp8c
    split -n 4 -d "$gguf" .fp8a/part
    mv .fp8a/part02 .fp8b/ && mv .fp8a/part03 .fp8c/
    md5sum "$gguf" | cut -d' ' -f1 > .fp8b/md5
    du -sb .fp8a .fp8b .fp8c ;;
  noop)
    ls -ld .whl .fp8a .fp8b .fp8c 2>&1 ;;
  run)
    OUT=${OUT:-$(mktemp -d)}
    site=$(mktemp -d) && work=$(mktemp -d)
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl 2>&1 | tail -n 2
    export PYTHONPATH=$site:$(pwd)
    cat .fp8a/part00 .fp8a/part01 .fp8b/part02 .fp8c/part03 > "$work/model.gguf"
    [ "$(md5sum "$work/model.gguf" | cut -d' ' -f1)" = "$(cat .fp8b/md5)" ] || { echo "GGUF md5 mismatch"; exit 1; }
    python3 -c "import sys; from pdserve.model.default_model import convert_gguf_to_hf as c; \
      c(sys.argv[1], sys.argv[2])" "$work/model.gguf" "$work/hf"
    python3 benchmarks/bench_kv_fp8_accuracy.py --device cuda --model "$work/hf" --num-prompts 50 \
      --max-tokens 64 --json "$OUT/accuracy_bf16.json" 2>&1 | tail -n 8
    python3 benchmarks/bench_kv_fp8_accuracy.py --device cuda --dtype float32 --model "$work/hf" \
      --formats fp8_e4m3 --num-prompts 50 --max-tokens 64 --json "$OUT/accuracy_fp32.json" 2>&1 | tail -n 8
    # ngram ITL with real weights: the 8B shape's dummy weights never produce a continuation that the prompt
    # lookup finds, so the speculation row needs a model that copies its repetitive prompt
    timeout 150 python3 benchmarks/gpu_spec_ngram_itl.py --model "$work/hf" --load-format auto --batch 1,4,16 \
      --k 4 --max-tokens 96 --rounds 3 2>&1 | tail -n 14 ;;
  *) echo "usage: $0 prepare|noop|run" >&2; exit 2 ;;
esac
