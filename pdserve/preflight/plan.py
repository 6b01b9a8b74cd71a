"""`pdserve plan`: the KV transfer arithmetic of a P/D split, before anything is deployed.

bytes per token = layers x 2 (K and V) x KV heads x head_dim x bytes per element; the prompt's KV is that
times the prompt length; the wire time is that many bits over the link's bit rate. Units are explicit in
the output: 1 GB = 10^9 bytes, 1 GiB = 2^30 bytes, 1 Gb/s = 10^9 bit/s.

    pdserve plan llama-3.1-70b --prompt-len 10000 --bandwidth 400Gb/s
    pdserve plan ./my-model --prompt-len 8192 --bandwidth 50GB/s --bandwidth 0.5GB/s
    pdserve plan --layers 80 --kv-heads 8 --head-dim 128 --dtype bf16 --prompt-len 10000 --bandwidth 400Gb/s
    pdserve plan --instance http://127.0.0.1:8100 --prompt-len 4096     # a running instance's own KV shape
    pdserve plan llama-3.1-70b --prompt-len 10000 --prefill-tp 4 --decode-tp 8   # tensor-parallel P and D

A model's config gives the dtype of its released weights; a server's KV cache may differ (pdserve runs
float32 on CPU by default): plan against the instance (`--instance URL` reads its /pdserve/info) or say
`--dtype`.

With the workload and measured per-instance throughputs it also recommends a starting P:D split
(pdserve/preflight/ratio.py); with a model it adds the KV arithmetic of a prompt of --isl tokens:

    pdserve plan --isl 32000 --osl 400 --prefill-tps 40000 --decode-tps 1200 --instances 8
    pdserve plan llama-3.1-8b --isl 4000 --osl 8000 --prefill-tps 20000 --decode-tps 2500 --json > plan.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# bytes per element of the KV cache
DTYPE_BYTES: dict[str, float] = {
    "float32": 4, "fp32": 4, "f32": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2, "f16": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1,
}

# Well-known models whose KV shape is public (their config.json), so the arithmetic works offline.
# name -> (layers, kv heads, head_dim, dtype of the released weights)
KNOWN_MODELS: dict[str, tuple[int, int, int, str]] = {
    "llama-3.1-8b": (32, 8, 128, "bfloat16"),
    "llama-3.1-70b": (80, 8, 128, "bfloat16"),
    "llama-3.1-405b": (126, 8, 128, "bfloat16"),
    "qwen2.5-7b": (28, 4, 128, "bfloat16"),
    "qwen3-0.6b": (28, 8, 128, "bfloat16"),
    "qwen3-8b": (36, 8, 128, "bfloat16"),
    "smollm2-135m": (30, 3, 64, "bfloat16"),
}

# Reference links for `--bandwidth` presets and the defaults shown when none is given.
BANDWIDTH_PRESETS: dict[str, str] = {
    "rdma-400g": "400Gb/s",  # one 400 Gb/s RDMA NIC between hosts
    "cuda-ipc": "100GB/s",  # same host, CUDA IPC with one descriptor per ~1 MiB block (measured on H200)
    "cpu-dram": "5GB/s",  # host memory between processes on one box
    "tcp-fallback": "0.5GB/s",  # UCX over TCP: what a broken GPU path silently falls back to
}
DEFAULT_BANDWIDTHS = ("rdma-400g", "tcp-fallback")

_UNIT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*(?:/\s*s)?\s*$")
_PREFIXES = {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def parse_bandwidth(text: str) -> float:
    """A link rate like `400Gb/s`, `400Gbps`, `50GB/s`, `12GiB/s`, `100 Mbit/s` -> bytes per second.

    `b`/`bit` = bits, `B` = bytes; k/M/G/T are powers of 10, Ki/Mi/Gi/Ti powers of 2. A unit is required:
    a bare number is ambiguous between bits and bytes. Preset names (see BANDWIDTH_PRESETS) are accepted.
    """
    preset = BANDWIDTH_PRESETS.get(text.strip().lower())
    if preset is not None:
        text = preset
    m = _UNIT_RE.match(text)
    if not m or not m.group(2):
        raise ValueError(
            f"bandwidth {text!r}: give a number and a unit, e.g. 400Gb/s (bits), 50GB/s (bytes), 12GiB/s, "
            f"or a preset ({', '.join(BANDWIDTH_PRESETS)})"
        )
    value, unit = float(m.group(1)), m.group(2)
    if unit.endswith(("bps", "Bps")):  # 400Gbps, 50GBps
        unit = unit[:-2]
    for suffix, bits in (("bit", True), ("b", True), ("B", False), ("byte", False)):
        if unit.endswith(suffix) and unit[: -len(suffix)] in _PREFIXES:
            scale = _PREFIXES[unit[: -len(suffix)]]
            rate = value * scale / 8 if bits else value * scale
            if rate <= 0 or not math.isfinite(rate):
                raise ValueError(f"bandwidth {text!r} must be > 0")
            return rate
    raise ValueError(f"bandwidth {text!r}: unknown unit {unit!r} (use b/bit for bits, B for bytes, e.g. Gb/s, GB/s)")


def dtype_bytes(dtype: str) -> float:
    key = dtype.strip().lower().replace("torch.", "")
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(DTYPE_BYTES))}")
    return DTYPE_BYTES[key]


def canonical_dtype(dtype: str) -> str:
    key = dtype.strip().lower().replace("torch.", "")
    return {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "f16": "float16",
            "fp32": "float32", "f32": "float32", "fp8": "fp8_e4m3"}.get(key, key)


@dataclass(frozen=True)
class KVShape:
    source: str  # where the numbers came from
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # canonical name (bfloat16, float32, ...)
    dtype_note: str = ""  # a caveat printed with the plan (the dtype is a guess)

    @property
    def bytes_per_token(self) -> int:
        return int(self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes(self.dtype))


def _shape_from_config_dict(cfg: dict[str, Any], source: str) -> KVShape:
    # Multimodal configs nest the language model's settings under text_config.
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
    except KeyError as e:
        raise ValueError(f"{source}: config.json lacks {e.args[0]!r}") from None
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    dtype = canonical_dtype(str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"))
    return KVShape(source, layers, kv_heads, head_dim, dtype, _weights_dtype_note(dtype))


def _weights_dtype_note(dtype: str) -> str:
    return (f"{dtype} is the dtype of the model's weights; a server's KV cache may use another (pdserve on CPU: "
            "float32 by default). Give --dtype, or --instance URL to read a running instance's.")


def shape_from_instance(url: str, timeout: float = 10.0) -> tuple[KVShape, int]:
    """(KV shape, block size) of a running pdserve instance, from its GET /pdserve/info."""
    import httpx

    base = url.rstrip("/") if "://" in url else "http://" + url.rstrip("/")
    try:
        resp = httpx.get(base + "/pdserve/info", timeout=timeout, trust_env=False)
        resp.raise_for_status()
        info = resp.json()
        shape = KVShape(f"instance {base} (/pdserve/info)", int(info["num_layers"]), int(info["num_kv_heads"]),
                        int(info["head_dim"]),
                        canonical_dtype(str(info.get("kv_cache_dtype") or info["dtype"])))
        return shape, int(info.get("block_size") or 16)
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--instance {url}: cannot read its KV shape from /pdserve/info ({type(e).__name__}: {e})"
                         ) from None


def _known(name: str) -> tuple[int, int, int, str] | None:
    key = name.strip().lower().rsplit("/", 1)[-1]
    key = re.sub(r"-(instruct|chat|base|hf)$", "", key)
    key = key.replace("meta-llama-", "llama-")
    return KNOWN_MODELS.get(key)


def resolve_shape(model: str | None, *, layers: int | None = None, kv_heads: int | None = None,
                  head_dim: int | None = None, dtype: str | None = None) -> KVShape:
    """The KV shape from a model folder, a config.json, a known name, or explicit numbers.

    Explicit `layers`/`kv_heads`/`head_dim`/`dtype` override what the model says.
    """
    base: KVShape | None = None
    if model is not None:
        path = Path(model).expanduser()
        if path.is_file():
            base = _shape_from_config_dict(json.loads(path.read_text()), str(path))
        elif (path / "config.json").is_file():
            base = _shape_from_config_dict(json.loads((path / "config.json").read_text()), str(path / "config.json"))
        elif (known := _known(model)) is not None:
            base = KVShape(f"built-in table ({model})", *known, _weights_dtype_note(known[3]))
        else:
            from pdserve.model.default_model import MODELS, resolve_model

            if model not in MODELS:
                raise ValueError(
                    f"model {model!r}: not a folder with config.json, not a config.json file, and not a known "
                    f"name ({', '.join(sorted(set(KNOWN_MODELS) | set(MODELS)))}); or give --layers --kv-heads "
                    "--head-dim"
                )
            folder = resolve_model(model)
            base = _shape_from_config_dict(json.loads((folder / "config.json").read_text()), model)
    if base is None:
        missing = [n for n, v in (("--layers", layers), ("--kv-heads", kv_heads), ("--head-dim", head_dim)) if v is None]
        if missing:
            raise ValueError(f"give a MODEL or all of --layers --kv-heads --head-dim (missing {' '.join(missing)})")
        assert layers is not None and kv_heads is not None and head_dim is not None
        return KVShape("command line", layers, kv_heads, head_dim, canonical_dtype(dtype or "bfloat16"))
    shape = KVShape(
        base.source if all(v is None for v in (layers, kv_heads, head_dim)) else base.source + " + command line",
        layers if layers is not None else base.num_layers,
        kv_heads if kv_heads is not None else base.num_kv_heads,
        head_dim if head_dim is not None else base.head_dim,
        canonical_dtype(dtype) if dtype is not None else base.dtype,
        base.dtype_note if dtype is None else "",
    )
    dtype_bytes(shape.dtype)  # validate
    for name, v in (("layers", shape.num_layers), ("kv heads", shape.num_kv_heads), ("head_dim", shape.head_dim)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    return shape


@dataclass(frozen=True)
class LinkEstimate:
    bandwidth: str  # as given
    bytes_per_s: float
    wire_time_s: float


@dataclass(frozen=True)
class Plan:
    shape: KVShape
    prompt_len: int
    block_size: int
    bytes_per_token: int
    prompt_bytes: int
    bytes_per_block: int
    num_blocks: int
    links: list[LinkEstimate]
    tensor_parallel: Any = None  # a tp_plan.TPPlan when --prefill-tp/--decode-tp are given

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        if self.tensor_parallel is not None:
            out["tensor_parallel"] = self.tensor_parallel.to_json()
        out["shape"]["bytes_per_token"] = self.bytes_per_token
        out["units"] = {"GB": 10**9, "GiB": 2**30, "Gb/s": "10^9 bit/s", "KiB": 1024}
        return out


def make_plan(shape: KVShape, prompt_len: int, bandwidths: list[str], block_size: int = 16,
              prefill_tp: int | None = None, decode_tp: int | None = None) -> Plan:
    if prompt_len < 1:
        raise ValueError(f"--prompt-len must be >= 1, got {prompt_len}")
    if block_size < 1:
        raise ValueError(f"--block-size must be >= 1, got {block_size}")
    per_token = shape.bytes_per_token
    total = per_token * prompt_len
    links = []
    for bw in bandwidths:
        rate = parse_bandwidth(bw)
        links.append(LinkEstimate(bw, rate, total / rate))
    tp = None
    if prefill_tp is not None or decode_tp is not None:
        from pdserve.preflight.tp_plan import make_tp_plan

        tp = make_tp_plan(num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                          elem_bytes=dtype_bytes(shape.dtype), prompt_len=prompt_len, block_size=block_size,
                          prefill_tp=prefill_tp or 1, decode_tp=decode_tp or 1)
    return Plan(shape, prompt_len, block_size, per_token, total, per_token * block_size,
                -(-prompt_len // block_size), links, tp)


@dataclass(frozen=True)
class PullChoice:
    """Read a held prefix's KV from a peer, or recompute it: whichever `pull_or_recompute` finds cheaper."""

    pull: bool
    tokens: int  # prompt tokens the choice is about
    wire_s: float  # their KV over the link, plus the per-read overhead
    recompute_s: float  # computing them at the given prefill throughput

    def describe(self) -> str:
        verdict = "pull" if self.pull else "recompute"
        return (f"{verdict}: {self.tokens} tokens, wire {_duration(self.wire_s)} vs recompute "
                f"{_duration(self.recompute_s)}")


def pull_or_recompute(tokens: int, bytes_per_token: float, bandwidth_bytes_per_s: float,
                      prefill_tokens_per_s: float, overhead_s: float = 0.002,
                      recompute_s: float | None = None) -> PullChoice:
    """The arithmetic above applied to a prefix some peer holds: its KV over the link (plus `overhead_s` per
    read: the side-channel claim and release round trips) against recomputing it: `recompute_s` when the
    caller priced it (at the margin from the prefill instance's measured cost, types/prefill_cost.py),
    else at the prefill rate."""
    if tokens <= 0:
        return PullChoice(False, 0, 0.0, 0.0)
    wire = tokens * bytes_per_token / bandwidth_bytes_per_s + overhead_s
    recompute = tokens / prefill_tokens_per_s if recompute_s is None else recompute_s
    return PullChoice(wire < recompute, tokens, wire, recompute)


def _bytes(n: float) -> str:
    """`3,276,800,000 B = 3.28 GB = 3.05 GiB` style: decimal and binary side by side."""
    for dec, binary, d, b in ((10**9, 2**30, "GB", "GiB"), (10**6, 2**20, "MB", "MiB"), (10**3, 2**10, "kB", "KiB")):
        if n >= dec:
            return f"{n:,.0f} B = {n / dec:.3g} {d} = {n / binary:.3g} {b}"
    return f"{n:,.0f} B"


def _duration(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


def _rate(bps: float) -> str:
    return f"{bps * 8 / 1e9:.4g} Gb/s = {bps / 1e9:.4g} GB/s"


def format_plan(plan: Plan) -> str:
    s = plan.shape
    lines = [
        f"model:            {s.source}",
        f"KV shape:         {s.num_layers} layers x 2 (K,V) x {s.num_kv_heads} KV heads x {s.head_dim} head_dim "
        f"x {dtype_bytes(s.dtype):g} B ({s.dtype})",
        f"per token:        {_bytes(plan.bytes_per_token)}",
        f"prompt:           {plan.prompt_len:,} tokens -> {_bytes(plan.prompt_bytes)}",
        f"blocks:           {plan.num_blocks:,} blocks of {plan.block_size} tokens, {_bytes(plan.bytes_per_block)} each "
        "(pdserve moves one descriptor per block)",
        "wire time (bytes x 8 / bit rate, before protocol overhead):",
    ]
    for link in plan.links:
        lines.append(f"  {link.bandwidth:>14}  ({_rate(link.bytes_per_s)}):  {_duration(link.wire_time_s)}")
    if plan.tensor_parallel is not None:
        from pdserve.preflight.tp_plan import format_tp_plan

        lines += format_tp_plan(plan.tensor_parallel, [(link.bandwidth, link.bytes_per_s) for link in plan.links],
                                _bytes, _duration)
    lines.append("units: 1 kB = 10^3 B, 1 KiB = 2^10 B, 1 GB = 10^9 B, 1 GiB = 2^30 B, 1 Gb/s = 10^9 bit/s")
    if s.dtype_note:
        lines.append(f"note: {s.dtype_note}")
    per_token_kib = plan.bytes_per_token / 1024
    if per_token_kib == int(per_token_kib) and plan.prompt_len >= 1000:
        # The back-of-envelope form: "320 KiB/token x 10k tokens = 3.2 GB" reads KiB as 10^3 B (2.4% low).
        rough = per_token_kib * 1e3 * plan.prompt_len
        lines.append(
            f"rough form: {per_token_kib:g} KiB/token x {plan.prompt_len:,} tokens read as "
            f"{rough / 1e9:.3g} GB (KiB taken as 10^3 B, 2.4% low)"
            + "".join(f"; at {link.bandwidth}: {_duration(rough / link.bytes_per_s)}" for link in plan.links)
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("model", nargs="?", default=None,
                        help="model folder, config.json, or a known name (" + ", ".join(sorted(KNOWN_MODELS)) + ")")
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt length in tokens (default: --isl)")
    parser.add_argument(
        "--bandwidth", action="append", default=None, metavar="RATE",
        help="link rate, e.g. 400Gb/s (bits) or 50GB/s (bytes), or a preset: "
        + ", ".join(f"{k}={v}" for k, v in BANDWIDTH_PRESETS.items())
        + "; repeat to compare (default: " + ", ".join(DEFAULT_BANDWIDTHS) + ")",
    )
    parser.add_argument("--dtype", "--kv-cache-dtype", dest="dtype", default=None,
                        help="KV cache dtype: bf16, fp16, fp32, fp8 (= fp8_e4m3), fp8_e5m2 (default: the model's); "
                        "pdserve's fp8 cache adds 2 bytes of scale per token and KV head to what is shown")
    parser.add_argument("--layers", type=int, default=None, help="number of layers (overrides the model's)")
    parser.add_argument("--kv-heads", type=int, default=None, help="number of KV heads (overrides the model's)")
    parser.add_argument("--head-dim", type=int, default=None, help="head dimension (overrides the model's)")
    parser.add_argument("--instance", default=None, metavar="URL",
                        help="a running pdserve instance: its /pdserve/info gives layers, KV heads, head_dim, dtype "
                        "and block size (instead of MODEL)")
    parser.add_argument("--block-size", type=int, default=None,
                        help="KV block size in tokens (default: the instance's, else 16)")
    parser.add_argument("--prefill-tp", type=int, default=None, metavar="N",
                        help="tensor-parallel size of the prefill instance: which of its ranks each decode rank reads")
    parser.add_argument("--decode-tp", type=int, default=None, metavar="N",
                        help="tensor-parallel size of the decode instance (its ranks read in parallel, one link each)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    ratio = parser.add_argument_group("P:D ratio (the seed's rule 3)")
    ratio.add_argument("--isl", type=int, default=None, help="input (prompt) tokens per request")
    ratio.add_argument("--osl", type=int, default=None, help="output tokens per request")
    ratio.add_argument("--prefill-tps", type=float, default=None,
                       help="measured prompt tokens/s of one prefill instance")
    ratio.add_argument("--decode-tps", type=float, default=None,
                       help="measured output tokens/s of one decode instance (at the batch its ITL target allows)")
    ratio.add_argument("--instances", type=int, default=None,
                       help="split this many instances (default: the smallest near-balanced split)")


_RATIO_FLAGS = ("isl", "osl", "prefill_tps", "decode_tps")


def _ratio(args: argparse.Namespace):  # -> RatioPlan | None
    from pdserve.preflight.ratio import recommend

    given = [f for f in _RATIO_FLAGS if getattr(args, f) is not None]
    if not given:
        if args.instances is not None:
            raise ValueError("--instances needs --isl --osl --prefill-tps --decode-tps")
        return None
    missing = [f"--{f.replace('_', '-')}" for f in _RATIO_FLAGS if getattr(args, f) is None]
    if missing:
        raise ValueError(f"the P:D recommendation needs {' '.join(missing)} too")
    return recommend(args.isl, args.osl, args.prefill_tps, args.decode_tps, args.instances)


def main(args: argparse.Namespace) -> int:
    from pdserve.preflight.ratio import format_ratio

    try:
        ratio = _ratio(args)
        plan = None
        prompt_len = args.prompt_len if args.prompt_len is not None else args.isl
        kv_wanted = ratio is None or args.model is not None or args.layers is not None or args.instance is not None
        if kv_wanted:
            if prompt_len is None:
                raise ValueError("give --prompt-len (or --isl)")
            block_size = args.block_size
            if args.instance is not None:
                if args.model is not None:
                    raise ValueError("give either MODEL or --instance URL, not both")
                live, live_block = shape_from_instance(args.instance)
                shape = resolve_shape(None, layers=args.layers or live.num_layers,
                                      kv_heads=args.kv_heads or live.num_kv_heads,
                                      head_dim=args.head_dim or live.head_dim, dtype=args.dtype or live.dtype)
                overridden = any(v is not None for v in (args.layers, args.kv_heads, args.head_dim, args.dtype))
                shape = dataclasses.replace(shape, source=live.source + (" + command line" if overridden else ""))
                block_size = block_size or live_block
            else:
                shape = resolve_shape(args.model, layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim,
                                      dtype=args.dtype)
            plan = make_plan(shape, prompt_len, args.bandwidth or list(DEFAULT_BANDWIDTHS), block_size or 16,
                             args.prefill_tp, args.decode_tp)
    except (ValueError, FileNotFoundError) as e:
        print(f"pdserve plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        out = plan.to_json() if plan is not None else {}
        if ratio is not None:
            out["ratio"] = ratio.to_json()
        print(json.dumps(out, indent=2))
    else:
        print("\n\n".join(text for text in (format_plan(plan) if plan else "",
                                            format_ratio(ratio) if ratio else "") if text))
    return 0
