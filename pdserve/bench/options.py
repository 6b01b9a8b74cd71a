"""`pdserve bench serve` options: vLLM's flag names and defaults, collected into one typed spec."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.bench.client import BACKENDS
from pdserve.bench.metrics import (
    DEFAULT_PERCENTILE_METRICS,
    parse_goodput,
    parse_percentile_metrics,
    parse_percentiles,
)

if TYPE_CHECKING:
    from pdserve.bench.multiturn import MultiTurnOptions

DATASETS = ("random", "jsonl", "prefix", "multiturn", "sharegpt")
MULTITURN_DATASETS = ("multiturn", "sharegpt")
DATASET_ALIASES = {"custom": "jsonl", "prefix_repetition": "prefix", "shared-prefix": "prefix"}


@dataclass
class BenchSpec:
    # target
    backend: str = "openai"
    base_url: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    endpoint: str | None = None
    model: str | None = None
    served_model_name: str | None = None
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    api_key: str | None = None
    header: list[str] = field(default_factory=list)
    # workload
    dataset_name: str = "random"
    dataset_path: str | None = None
    num_prompts: int = 1000
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    prefix_len: int = 256
    suffix_len: int = 256
    num_prefixes: int = 10
    shuffle: bool = False
    # multiturn / sharegpt: --num-prompts conversations of up to this many turns (pdserve/bench/multiturn.py)
    multiturn_turns: int = 6
    multiturn_system_len: int = 512
    multiturn_user_len: int = 128
    multiturn_answer_len: int = 64
    multiturn_think_time: float = 0.0
    seed: int = 0
    no_align_prompts: bool = False
    # traffic
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_warmups: int = 0
    ready_check_timeout_sec: int = 0
    request_id_prefix: str = ""
    # sampling
    ignore_eos: bool = False
    logprobs: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    extra_body: dict[str, Any] | None = None
    # results
    percentile_metrics: str | None = None
    metric_percentiles: str = "99"
    goodput: list[str] | None = None
    disable_tqdm: bool = False
    save_result: bool = False
    save_detailed: bool = False
    result_dir: str | None = None
    result_filename: str | None = None
    label: str | None = None
    metadata: list[str] = field(default_factory=list)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> BenchSpec:
        values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}
        spec = cls(**values)
        spec.normalise()
        return spec

    def multiturn_options(self) -> MultiTurnOptions:
        """The --multiturn-* flags as the conversation builder's options (pdserve/bench/multiturn.py)."""
        from pdserve.bench.multiturn import MultiTurnOptions

        return MultiTurnOptions(self.multiturn_turns, self.multiturn_system_len, self.multiturn_user_len,
                                self.multiturn_answer_len, self.multiturn_think_time)

    def normalise(self) -> None:
        """Fill derived defaults and reject inconsistent combinations (ValueError)."""
        self.dataset_name = DATASET_ALIASES.get(self.dataset_name, self.dataset_name)
        if self.dataset_name not in DATASETS:
            raise ValueError(
                f"unknown --dataset-name {self.dataset_name!r}; choose from {', '.join(DATASETS)}"
            )
        if self.dataset_name in ("jsonl", "sharegpt") and not self.dataset_path:
            raise ValueError(f"--dataset-name {self.dataset_name} needs --dataset-path")
        if self.dataset_name in MULTITURN_DATASETS:
            if self.backend not in ("openai-chat", "chat"):
                self.backend = "openai-chat"  # conversations go over the chat API
            if self.multiturn_turns < 1 or self.multiturn_user_len < 1 or self.multiturn_answer_len < 1:
                raise ValueError("--multiturn-turns, --multiturn-user-len and --multiturn-answer-len must be >= 1")
            if self.multiturn_system_len < 0 or self.multiturn_think_time < 0:
                raise ValueError("--multiturn-system-len and --multiturn-think-time must be >= 0")
        if self.dataset_path and self.dataset_name not in ("jsonl", "sharegpt"):
            if self.dataset_name != "random":
                raise ValueError(f"--dataset-path cannot be used with --dataset-name {self.dataset_name}")
            self.dataset_name = "jsonl"
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown --backend {self.backend!r}; choose from {', '.join(BACKENDS)}")
        if self.endpoint is None:
            self.endpoint = BACKENDS[self.backend][1]
        if self.max_concurrency is not None and self.max_concurrency <= 0:
            raise ValueError("--max-concurrency must be greater than 0")
        if self.num_prompts < 1:
            raise ValueError("--num-prompts must be at least 1")
        if not self.request_rate > 0:
            raise ValueError("--request-rate must be positive (or inf)")
        if not self.burstiness > 0:
            raise ValueError("--burstiness must be positive")
        parse_goodput(self.goodput)
        parse_percentiles(self.metric_percentiles)
        parse_percentile_metrics(self.percentile_metrics or DEFAULT_PERCENTILE_METRICS)
        for item in [*(self.metadata or ()), *(self.header or ())]:
            if "=" not in item:
                raise ValueError(f"Invalid KEY=VALUE item {item!r} (--metadata / --header)")
        if not self.request_id_prefix:
            self.request_id_prefix = f"bench-{uuid.uuid4().hex[:8]}-"
        if self.api_key is None:
            self.api_key = os.environ.get("OPENAI_API_KEY") or None
        # vLLM 0.33 sets ignore_eos for the random dataset with OpenAI-style backends.
        if self.dataset_name == "random":
            self.ignore_eos = True

    @property
    def root_url(self) -> str:
        if self.base_url:
            return self.base_url.rstrip("/")
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"http://{host}:{self.port}"

    @property
    def api_url(self) -> str:
        return f"{self.root_url}{self.endpoint}"

    def request_headers(self) -> dict[str, str]:
        headers: dict[str, str] = {}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        for item in self.header or ():
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"Invalid header format {item!r}. Please use KEY=VALUE format.")
            headers[key.strip()] = value.strip()
        return headers

    def sampling_body(self) -> dict[str, Any]:
        params = {
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "temperature": self.temperature,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        body = {k: v for k, v in params.items() if v is not None}
        return {**body, **(self.extra_body or {})}


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"rate must be positive or inf, got {text}")
    return value


def add_target_arguments(parser: argparse.ArgumentParser, with_address: bool = True) -> None:
    g = parser.add_argument_group("target")
    g.add_argument(
        "--backend",
        default="openai",
        choices=list(BACKENDS),
        help="openai/vllm/completions -> /v1/completions; openai-chat/chat -> /v1/chat/completions",
    )
    if with_address:
        g.add_argument("--base-url", default=None, help="server base URL (overrides --host/--port)")
        g.add_argument("--host", default="127.0.0.1")
        g.add_argument("--port", type=int, default=8000)
    g.add_argument("--endpoint", default=None, help="API path (default: the backend's)")
    g.add_argument("--model", default=None, help="model id (default: data[0] of GET /v1/models)")
    g.add_argument("--served-model-name", default=None, help="model name sent in requests (default: --model)")
    g.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer folder/file or hub id (default: the model id when it is a local path)",
    )
    g.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        help="no tokenizer: token counts from usage only; TTFT/TPOT/ITL not reported (as vLLM)",
    )
    g.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    g.add_argument("--header", metavar="KEY=VALUE", nargs="*", default=[], help="extra request headers")


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument(
        "--dataset-name",
        default="random",
        help="random | jsonl (alias custom) | prefix (alias prefix_repetition) | multiturn (synthetic "
             "conversations) | sharegpt (--dataset-path: ShareGPT-format JSON conversations)",
    )
    g.add_argument(
        "--dataset-path",
        default=None,
        help='JSONL file: one {"prompt": ...} or {"messages": [...]} per line, optional "output_len"',
    )
    g.add_argument("--num-prompts", type=int, default=1000)
    g.add_argument("--random-input-len", "--input-len", dest="random_input_len", type=int, default=1024)
    g.add_argument(
        "--random-output-len",
        "--output-len",
        dest="random_output_len",
        type=int,
        default=128,
        help="output tokens (random/prefix datasets; JSONL lines without output_len)",
    )
    g.add_argument("--random-range-ratio", type=float, default=0.0)
    g.add_argument("--random-prefix-len", type=int, default=0)
    g.add_argument("--prefix-len", type=int, default=256, help="prefix dataset: shared prefix tokens")
    g.add_argument("--suffix-len", type=int, default=256, help="prefix dataset: per-request suffix tokens")
    g.add_argument("--num-prefixes", type=int, default=10, help="prefix dataset: number of distinct prefixes")
    g.add_argument("--shuffle", action="store_true", help="shuffle the JSONL file (seeded)")
    m = parser.add_argument_group("multi-turn (--dataset-name multiturn|sharegpt; --num-prompts = conversations)")
    m.add_argument("--multiturn-turns", type=int, default=6, help="user turns per conversation (default 6)")
    m.add_argument("--multiturn-system-len", type=int, default=512,
                   help="tokens of the system prompt all synthetic conversations share (default 512)")
    m.add_argument("--multiturn-user-len", type=int, default=128, help="tokens per user message (default 128)")
    m.add_argument("--multiturn-answer-len", type=int, default=64, help="tokens per answer (default 64)")
    m.add_argument("--multiturn-think-time", type=float, default=0.0,
                   help="seconds between an answer and the next user message (default 0)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--no-align-prompts",
        action="store_true",
        help="skip re-aligning prompt lengths with the server's /tokenize",
    )

    t = parser.add_argument_group("traffic")
    t.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of inter-arrival gaps: 1 = Poisson, <1 burstier, >1 more uniform",
    )
    t.add_argument("--max-concurrency", type=int, default=None)
    t.add_argument("--num-warmups", type=int, default=0)
    t.add_argument(
        "--ready-check-timeout-sec",
        type=int,
        default=0,
        help="retry the first request until it succeeds, up to this many seconds (0 = skip)",
    )
    t.add_argument("--request-id-prefix", default="", help="x-request-id prefix (default bench-<8hex>-)")

    s = parser.add_argument_group("sampling")
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--logprobs", type=int, default=None)
    s.add_argument("--temperature", type=float, default=None)
    s.add_argument("--top-p", type=float, default=None)
    s.add_argument("--top-k", type=int, default=None)
    s.add_argument("--min-p", type=float, default=None)
    s.add_argument("--frequency-penalty", type=float, default=None)
    s.add_argument("--presence-penalty", type=float, default=None)
    s.add_argument("--repetition-penalty", type=float, default=None)
    s.add_argument("--extra-body", type=json.loads, default=None, help="JSON merged into every request body")

    r = parser.add_argument_group("results")
    r.add_argument(
        "--percentile-metrics",
        default=None,
        help=f"comma list of ttft,tpot,itl,e2el,client_queue_time,e2el_including_client_queue "
        f"(default {DEFAULT_PERCENTILE_METRICS})",
    )
    r.add_argument("--metric-percentiles", default="99", help='comma list, e.g. "50,90,99"')
    r.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="SLOs for goodput, e.g. ttft:2000 tpot:30 (e2el also allowed)",
    )
    r.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_arguments(parser)
    add_workload_arguments(parser)
    parser.add_argument("--request-rate", type=_rate, default=math.inf, help="requests/s, or inf (default)")
    r = parser.add_argument_group("result file")
    r.add_argument("--save-result", action="store_true")
    r.add_argument("--save-detailed", action="store_true", help="keep per-request arrays in the JSON")
    r.add_argument("--result-dir", default=None)
    r.add_argument("--result-filename", default=None)
    r.add_argument("--label", default=None)
    r.add_argument("--metadata", metavar="KEY=VALUE", nargs="*", default=[])
