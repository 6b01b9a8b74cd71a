"""GPU checks of `pdserve preflight`: peer-to-peer between the prefill and decode GPUs, and the UCX
transport a NIXL READ really takes between them (the probe in `pdserve.preflight.probe`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

# Transports of "remote memory read" between GPUs, best first. tcp is the silent fallback (h200-facts).
FAST_GPU_READ = ("cuda_ipc",)
RDMA = ("rc_mlx5", "rc_verbs", "dc_mlx5", "ud_mlx5", "ud_verbs", "gdr_copy")
SLOW = ("tcp",)


@dataclass
class P2PResult:
    status: str  # "ok" | "not-ok" | "unknown"
    detail: str
    source: str  # "nvml" | "nvidia-smi" | "same-gpu" | ""


def parse_topo_p2p(text: str) -> dict[tuple[str, str], str]:
    """Parse `nvidia-smi topo -p2p r` into {(row GPU, column GPU): code} with codes X, OK, CNS, GNS, TNS, NS, U.

    The matrix is tab-separated: a header row `GPU0 GPU1 ...`, then one row per GPU (`GPU0 X OK ...`),
    then a blank line and the legend.
    """
    header: list[str] | None = None
    matrix: dict[tuple[str, str], str] = {}
    for raw in text.splitlines():
        words = raw.split()
        if not words:
            if header and matrix:
                break  # the legend follows the matrix
            continue
        if header is None:
            if all(re.fullmatch(r"GPU\d+", w) for w in words):
                header = words
            continue
        if not re.fullmatch(r"GPU\d+", words[0]):
            break
        for col, code in zip(header, words[1:], strict=False):
            matrix[(words[0], col)] = code
    return matrix


P2P_CODES = {
    "OK": "status OK", "CNS": "chipset not supported", "GNS": "GPU not supported",
    "TNS": "topology not supported", "NS": "not supported", "U": "unknown", "X": "same GPU",
}


def p2p_status(a: str, b: str) -> P2PResult:
    """Peer-to-peer READ status between physical GPUs `a` and `b` (indices as nvidia-smi numbers them)."""
    if a == b:
        return P2PResult("ok", f"GPU {a} serves both: CUDA IPC within one device", "same-gpu")
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        pynvml = None
    if pynvml is not None and a.isdigit() and b.isdigit():
        try:
            pynvml.nvmlInit()
            try:
                ha, hb = pynvml.nvmlDeviceGetHandleByIndex(int(a)), pynvml.nvmlDeviceGetHandleByIndex(int(b))
                status = pynvml.nvmlDeviceGetP2PStatus(ha, hb, pynvml.NVML_P2P_CAPS_INDEX_READ)
            finally:
                pynvml.nvmlShutdown()
            ok = status == pynvml.NVML_P2P_STATUS_OK
            return P2PResult("ok" if ok else "not-ok",
                             f"NVML P2P read GPU {a} <-> GPU {b}: {'OK' if ok else f'status {status}'}", "nvml")
        except Exception as e:  # NVML raises its own NVMLError types
            nvml_error = f"NVML failed ({e}); "
    else:
        nvml_error = "" if pynvml is not None else "pynvml not installed; "
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return P2PResult("unknown", nvml_error + "nvidia-smi not found", "")
    try:
        out = subprocess.run([smi, "topo", "-p2p", "r"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return P2PResult("unknown", nvml_error + f"nvidia-smi topo -p2p r failed: {e}", "")
    matrix = parse_topo_p2p(out.stdout)
    code = matrix.get((f"GPU{a}", f"GPU{b}"))
    if code is None:
        return P2PResult("unknown", nvml_error + f"GPU{a}/GPU{b} not in `nvidia-smi topo -p2p r` output", "")
    return P2PResult("ok" if code == "OK" else "not-ok",
                     f"nvidia-smi topo -p2p r: GPU{a} -> GPU{b} = {code} ({P2P_CODES.get(code, code)})",
                     "nvidia-smi")


@dataclass
class ProbeResult:
    ran: bool
    ok: bool = False
    transports: list[tuple[str, str]] = field(default_factory=list)
    gbps: float | None = None
    error: str | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def read_transports(self) -> list[str]:
        return sorted({t for _, t in self.transports})

    def verdict(self) -> tuple[str, str]:
        """("pass"|"fail"|"skip", why) for a GPU-to-GPU pull on one host."""
        if not self.ran:
            return "skip", self.error or "probe not run"
        if not self.ok:
            return "fail", f"NIXL probe READ failed: {self.error}"
        names = [t.split("/")[0] for t in self.read_transports]
        rate = f" at {self.gbps:.2f} GB/s" if self.gbps else ""
        if any(n.startswith(FAST_GPU_READ) for n in names) and not any(n in SLOW for n in names):
            return "pass", f"READ uses {', '.join(self.read_transports)}{rate}"
        if any(n in SLOW for n in names):
            hint = ""
            if self.env.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "").lower() not in ("y", "yes", "1", "on"):
                hint = "; set UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y in the instances' environment"
            return "fail", f"READ falls back to {', '.join(self.read_transports)}{rate} (not CUDA IPC){hint}"
        if not names:
            return "skip", f"probe READ ok{rate} but UCX printed no protocol table (UCX_PROTO_INFO unsupported?)"
        return "pass", f"READ uses {', '.join(self.read_transports)}{rate}"


def run_probe(target_gpu: str, initiator_gpu: str, env_overrides: dict[str, str], *, timeout: float = 120.0,
              size_mib: float = 64.0, mem: str = "vram") -> ProbeResult:
    """Run the two-process NIXL READ probe with UCX_PROTO_INFO=y and the given UCX settings."""
    env = dict(os.environ)
    env.update(env_overrides)
    env["UCX_PROTO_INFO"] = "y"
    used = {k: v for k, v in env.items() if k.startswith("UCX_") and k != "UCX_PROTO_INFO"}
    argv = [sys.executable, "-m", "pdserve.preflight.probe", "--mem", mem, "--size-mib", str(size_mib),
            "--timeout", str(timeout / 2)]
    if mem == "vram":
        argv += ["--target-gpu", target_gpu, "--initiator-gpu", initiator_gpu]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    except subprocess.TimeoutExpired:
        return ProbeResult(True, error=f"probe did not finish within {timeout:g}s", env=used)
    line = next((ln for ln in reversed(out.stdout.splitlines()) if ln.startswith("PROBE_RESULT ")), None)
    if line is None:
        tail = " | ".join((out.stderr or out.stdout).strip().splitlines()[-3:])
        if "not importable" in tail or "No module named" in tail:
            return ProbeResult(False, error=f"probe cannot run here: {tail}", env=used)
        return ProbeResult(True, error=f"probe exited with {out.returncode}: {tail}", env=used)
    data: dict[str, Any] = json.loads(line[len("PROBE_RESULT "):])
    return ProbeResult(
        True, ok=bool(data.get("ok")), transports=[(a, b) for a, b in data.get("read_transports", [])],
        gbps=data.get("gbps"), error=data.get("error"), env=used,
    )
