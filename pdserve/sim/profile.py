"""An instance profile: what `pdserve sim` needs to know of one serving instance, as `pdserve profile` writes it.

The JSON (format `pdserve-profile/1`) holds what was measured and the step-time model fitted to it:

- `prefill_points`: engine steps of one prompt chunk, `new` tokens computed after `cached` ones, and their seconds;
- `decode_points`: decode steps of `batch` requests with `context` tokens of KV in all, and their seconds;
- `step_model`: the step time as a linear function of five features of a step (`step_features`), fitted to both
  kinds of points by least squares (`fit_step_model`): a fixed cost, the tokens computed, the prefill rows'
  attention work (new x (cached + new / 2): causal attention over the chunk), the decode rows, and the decode
  rows' context (the KV a decode step reads). A mixed step (chunked prefill beside decodes) is the same sum;
- `kv_capacity_tokens`, `kv_bytes_per_token`: the KV pool and what one token of it weighs (the handoff's bytes);
- `handoff`: a P/D handoff's fixed cost (params hop, lease claim) and the link's rate in bytes/s;
- `overheads`: the HTTP path of a request (client to engine, first token back) outside the engine's steps;
- `engine`: the scheduler settings the profiled instance ran with (block size, budget, max_num_seqs, ...).

No torch here: the simulator and the search import this.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "pdserve-profile/1"
SHIPPED = Path(__file__).resolve().parent.parent / "data" / "profiles"  # the profiles pdserve ships
FEATURES = ("fixed", "tokens", "prefill_attention", "decode_rows", "decode_context")


@dataclass
class EngineSettings:
    """The profiled instance's scheduler settings: the simulated instance runs the same Scheduler with them."""

    block_size: int = 128
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    prefill_only_chunk_tokens: int = 0
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True


@dataclass
class Handoff:
    """A pull handoff's cost: fixed (the prefill's params back through the proxy to the waiting decode leg,
    then the lease claimed on the side channel: the adopted first token goes out there) plus the READ's bytes
    over the link (contended: pdserve/sim/link.py)."""

    params_s: float = 0.0  # prefill finished -> its params delivered to the (early) decode leg
    claim_s: float = 0.0  # load started -> lease claimed (the first token goes out)
    link_bytes_per_s: float = 1e12  # the KV READ's measured rate, per instance's link
    points: list[dict[str, float]] = field(default_factory=list)  # measured {bytes, seconds}

    @property
    def fixed_s(self) -> float:
        return self.params_s + self.claim_s


@dataclass
class Overheads:
    """Time on the HTTP path outside the engine's steps (0 for an engine profiled in process)."""

    ingress_s: float = 0.0  # client send -> the engine has the request
    egress_s: float = 0.0  # a token leaves the engine -> the client has it


@dataclass
class Profile:
    name: str
    model: str
    device: str
    tp: int = 1
    kv_cache_dtype: str = "auto"
    kv_capacity_tokens: int = 0
    kv_bytes_per_token: int = 0
    gpu_memory_bytes: int = 0  # per device, when known (deriving other TP sizes needs it)
    weights_bytes: int = 0
    engine: EngineSettings = field(default_factory=EngineSettings)
    step_model: dict[str, float] = field(default_factory=dict)  # FEATURES -> seconds per unit
    prefill_points: list[dict[str, float]] = field(default_factory=list)
    decode_points: list[dict[str, float]] = field(default_factory=list)
    handoff: Handoff = field(default_factory=Handoff)
    overheads: Overheads = field(default_factory=Overheads)
    source: str = ""  # how it was made: the command, or the measured numbers it was fitted from
    notes: list[str] = field(default_factory=list)
    fit_residuals: dict[str, float] = field(default_factory=dict)

    # ---- JSON ---------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Profile:
        if data.get("format") != FORMAT:
            raise ValueError(f"not a pdserve profile (format {data.get('format')!r}, expected {FORMAT!r})")
        d = {k: v for k, v in data.items() if k != "format"}
        d["engine"] = EngineSettings(**d.get("engine", {}))
        d["handoff"] = Handoff(**d.get("handoff", {}))
        d["overheads"] = Overheads(**d.get("overheads", {}))
        prof = cls(**d)
        missing = [f for f in FEATURES if f not in prof.step_model]
        if missing:
            raise ValueError(f"profile {prof.name!r}: step_model lacks {', '.join(missing)}")
        if prof.kv_capacity_tokens < prof.engine.block_size:
            raise ValueError(f"profile {prof.name!r}: kv_capacity_tokens must hold at least one block")
        return prof

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """A profile file, or the name of a shipped one (`h200-llama3.1-8b-fp8`: pdserve/data/profiles/)."""
        p = Path(path)
        if not p.exists() and SHIPPED.joinpath(f"{p.name.removesuffix('.json')}.json").exists():
            p = SHIPPED / f"{p.name.removesuffix('.json')}.json"
        with open(p, encoding="utf-8") as f:
            return cls.from_json(json.load(f))

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=1)
            f.write("\n")

    @property
    def num_blocks(self) -> int:
        return self.kv_capacity_tokens // self.engine.block_size

    def step_seconds(self, features: Sequence[float]) -> float:
        m = self.step_model
        return (m["fixed"] * features[0] + m["tokens"] * features[1] + m["prefill_attention"] * features[2]
                + m["decode_rows"] * features[3] + m["decode_context"] * features[4])

    def decode_steps_seconds(self, rows: int, contexts: np.ndarray) -> np.ndarray:
        """`step_seconds(step_features(...))` of decode-only steps of `rows` rows, one per total context in
        `contexts` (the simulator's skipped decode steps): the same float expression, its first four terms summed
        first as Python sums them there, then one multiply and one add per step (separate IEEE operations in
        numpy as in Python: each value is the one step_seconds gives)."""
        m = self.step_model
        n = float(rows)
        base = m["fixed"] * 1.0 + m["tokens"] * n + m["prefill_attention"] * 0.0 + m["decode_rows"] * n
        return base + m["decode_context"] * contexts.astype(np.float64)

def step_features(rows: Iterable[tuple[int, int]]) -> tuple[float, float, float, float, float]:
    """The step model's features of one engine step whose rows are (new tokens, tokens computed before): a
    row of one token is a decode row (its context: what it attends to), any other a prefill chunk."""
    tokens = attn = dec_rows = dec_ctx = 0.0
    for n, computed in rows:
        tokens += n
        if n == 1:
            dec_rows += 1
            dec_ctx += computed + 1
        else:
            attn += n * (computed + n / 2.0)
    return (1.0, tokens, attn, dec_rows, dec_ctx)


def prefill_steps(new: int, cached: int, chunk: int) -> list[tuple[float, ...]]:
    """The features of the steps that compute `new` prompt tokens after `cached` ones, `chunk` at a time (one
    prompt alone on the instance, as `pdserve profile` measures it)."""
    steps = []
    done = 0
    while done < new:
        n = min(chunk, new - done) if chunk > 0 else new - done
        steps.append(step_features([(n, cached + done)]))
        done += n
    return steps


def fit_step_model(samples: Sequence[tuple[Sequence[Sequence[float]], float]]) -> tuple[dict[str, float], dict]:
    """Least squares over measured samples, each (the features of its steps, total seconds), with every
    coefficient >= 0 (a negative cost would be a fit artefact: the coefficient is dropped and the rest
    refitted). Returns (coefficients, residuals: mean and max relative error over the samples)."""
    x = np.array([np.sum(np.array(steps, dtype=float), axis=0) for steps, _ in samples])
    y = np.array([s for _, s in samples], dtype=float)
    w = 1.0 / np.maximum(y, 1e-9)  # relative error: a 4 ms decode step weighs as much as a 10 s prefill
    active = list(range(len(FEATURES)))
    coef = np.zeros(len(FEATURES))
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0.0
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    pred = x @ coef
    rel = np.abs(pred - y) / np.maximum(y, 1e-12)
    return ({name: float(c) for name, c in zip(FEATURES, coef, strict=True)},
            {"mean_rel_error": float(rel.mean()), "max_rel_error": float(rel.max()), "samples": len(samples)})


def refit(profile: Profile) -> None:
    """(Re)fit `profile.step_model` from its measured points."""
    chunk = profile.engine.max_num_batched_tokens
    samples: list[tuple[Sequence[Sequence[float]], float]] = []
    for p in profile.prefill_points:
        samples.append((prefill_steps(int(p["new"]), int(p.get("cached", 0)), int(p.get("chunk", chunk))),
                        float(p["seconds"])))
    for p in profile.decode_points:
        b, ctx = int(p["batch"]), float(p["context"])
        samples.append(([(1.0, b, 0.0, b, ctx)], float(p["seconds"])))
    if not samples:
        raise ValueError("no measured points to fit")
    profile.step_model, profile.fit_residuals = fit_step_model(samples)


def derive_tp(profile: Profile, tp: int, efficiency: float) -> Profile:
    """A profile for `tp` devices per instance derived from a TP=1 one: every step cost divided by
    tp x efficiency (the weights, the KV and the FLOPs split over tp devices; `efficiency` < 1 for the
    all-reduces), the KV pool grown by what the extra devices hold beyond their share of the weights.
    An estimate, not a measurement: the result says so in its notes."""
    if profile.tp != 1:
        raise ValueError("derive TP sizes from a TP=1 profile")
    if tp == 1:
        return profile
    if not profile.gpu_memory_bytes or not profile.weights_bytes or not profile.kv_bytes_per_token:
        raise ValueError(f"profile {profile.name!r} lacks gpu_memory_bytes / weights_bytes: cannot derive TP={tp}")
    d = Profile.from_json(json.loads(json.dumps(profile.to_json())))
    d.tp = tp
    d.name = f"{profile.name}-tp{tp}-derived"
    scale = 1.0 / (tp * efficiency)
    d.step_model = {k: v * scale for k, v in profile.step_model.items()}
    pool_bytes = profile.kv_capacity_tokens * profile.kv_bytes_per_token  # at TP=1, beside the whole weights
    extra = (tp - 1) * profile.weights_bytes + (tp - 1) * pool_bytes
    d.kv_capacity_tokens = int((pool_bytes + extra) // profile.kv_bytes_per_token)
    d.notes = [*profile.notes, f"TP={tp} DERIVED from the TP=1 profile: step costs / ({tp} x {efficiency} "
               "efficiency), KV pool of tp devices less one copy of the weights. Not measured."]
    return d
