"""The P/D wire contract, as vLLM 0.33 speaks it: the one place its field names and rules are written.

A disaggregated request is two HTTP legs (see the protocol notes, sections 1-3):

1. Prefill leg: the client's body with `max_tokens=1`, `stream=false` and the 6-key
   `kv_transfer_params` {do_remote_decode: true, ...} (`build_prefill_body`, or
   `build_prefill_generate_body` for `/inference/v1/generate`). The prefill instance answers with
   `kv_transfer_params` pointing at blocks it holds under a lease (`HeldKVParams`).
2. Decode leg: the client's original body plus those params, verbatim (`build_decode_body`). The decode
   instance validates them as untrusted input (`parse_remote_prefill_params`), pulls the blocks, and
   generates.

Rules shared by the proxy, the render tier and the server: one lease serves one engine request
(`local_only_reason`, `KVTransferParams.one_lease_violation`), and which chat requests may carry the prompt token ids in
the decode leg's params (`chat_prompt_ids_allowed`).

Mirrored from vLLM: tests/v1/kv_connector/nixl_integration/toy_proxy_server.py (the prefill leg), the
NixlConnector's `request_finished` (the producer's params) and the chat server's `prompt_token_ids`
hand-off (vllm-project/vllm PR #48145).

Ours on top (vLLM has it only as an open RFC, vllm-project/vllm#50913): the producer's params also carry
the first token it sampled (`first_token_fields`), so a decode instance can start from it instead of
recomputing the last prompt token; a producer that sends none (vLLM) is served as before.

Typed on this side of the wire: a request's params are read once where they come in (`KVTransferParams`), the
role that acts on them parses them once into frozen objects (`RemotePrefillParams`, `PushParams`, `FirstToken`),
and what a producer answers is one (`HeldKVParams`), serialised back by `to_json` exactly as the wire has it.
Their field names are spelled here and in `pdserve/kv_transfer` only (tests/test_pd_field_names.py).

No torch, no pydantic: functions over JSON-shaped dicts and the frozen dataclasses parsed from them.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

# ---- the prefill leg -----------------------------------------------------------------------------------

# What a prefill leg sends, exactly as vLLM's toy proxy does (a fresh copy per request: `prefill_leg_params`).
PREFILL_KV_TRANSFER_PARAMS: Mapping[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# Keys a prefill leg must not carry (they conflict with max_tokens=1 or stream=false).
PREFILL_DROPPED_KEYS = ("stream_options", "min_tokens", "min_completion_tokens")

# The chat hand-off key inside a decode leg's kv_transfer_params (vLLM PR #48145).
PROMPT_TOKEN_IDS = "prompt_token_ids"

# Ours: what a proxy decided for a turn's held history, in a whole answer's kv_transfer_params
# (pdserve/proxy/history_decision.py; streamed answers carry it as a header only).
KV_HISTORY = "kv_history"


def prefill_leg_params() -> dict[str, Any]:
    return dict(PREFILL_KV_TRANSFER_PARAMS)


def is_prefill_leg(params: Any) -> bool:
    """A request whose params ask it to compute the prompt and hold the KV for a decode instance."""
    return isinstance(params, Mapping) and bool(params.get("do_remote_decode"))


def is_remote_prefill(params: Any) -> bool:
    """A decode leg: its prompt's KV is to be pulled from a prefill instance."""
    return isinstance(params, Mapping) and bool(params.get("do_remote_prefill"))


def build_prefill_body(body: dict[str, Any], *, chat_token_ids: bool = False,
                       history_params: Mapping[str, Any] | None = None, push_key: str | None = None
                       ) -> dict[str, Any]:
    """The prefill leg of an OpenAI completions/chat request (a new dict; `body` is not modified).
    `chat_token_ids` also asks for `return_token_ids`, so the decode leg can skip templating.
    `history_params`: a decode instance's held history of this conversation (`HeldKVParams`): the
    prefill reads that prefix back instead of computing it (vLLM's bidirectional_kv_xfer turn 2).
    `push_key`: push mode, the KV goes to the decode that registers under that key (`push_prefill_params`)."""
    prefill = dict(body)
    prefill["kv_transfer_params"] = (prefill_leg_params() if history_params is None
                                     else prefix_prefill_params(history_params))
    if push_key is not None:  # with a held prefix: read it back, then push the request's KV on
        prefill["kv_transfer_params"] = {**(prefill["kv_transfer_params"] if history_params is not None else {}),
                                         **push_prefill_params(push_key)}
    prefill["stream"] = False
    prefill["max_tokens"] = 1
    if "n" in prefill:
        prefill["n"] = 1  # one held lease: the decode instance forks it into the n choices
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    for key in PREFILL_DROPPED_KEYS:
        prefill.pop(key, None)
    if chat_token_ids:
        prefill["return_token_ids"] = True
    return prefill


def build_prefill_generate_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg of a `/inference/v1/generate` request (sampling fields nested under
    `sampling_params`): the same edits as `build_prefill_body`, one choice, its own request id."""
    prefill = copy.deepcopy(body)
    prefill["request_id"] = f"{body['request_id']}-prefill"
    prefill["sampling_params"].update({"max_tokens": 1, "n": 1, "min_tokens": 0})
    prefill["stream"] = False
    prefill["stream_options"] = None
    prefill["kv_transfer_params"] = prefill_leg_params()
    return prefill


def prefill_kv_params(response: Any) -> dict[str, Any] | None:
    """The `kv_transfer_params` of a prefill response, or None when it has none (an error, an abort, or an
    instance without a KV connector): then nothing can be handed to a decode instance."""
    if not isinstance(response, dict):
        return None
    params = response.get("kv_transfer_params")
    if isinstance(params, dict) and params:
        return params
    return None


def prefill_prompt_token_ids(response: dict[str, Any]) -> list[int] | None:
    """The top-level `prompt_token_ids` of a chat prefill response asked with `return_token_ids`, when
    they are what a decode instance accepts (non-empty, non-negative plain ints)."""
    ids = response.get(PROMPT_TOKEN_IDS)
    if not isinstance(ids, list) or not ids:
        return None
    for token in ids:
        if type(token) is not int or token < 0:
            return None
    return ids


# ---- the decode leg ------------------------------------------------------------------------------------
def build_decode_body(
    body: dict[str, Any],
    kv_params: dict[str, Any],
    *,
    prompt_token_ids: list[int] | None = None,
    remote_host: str | None = None,
) -> dict[str, Any]:
    """The decode leg: the client's body plus the prefill's params, copied verbatim except for the opt-in
    `prompt_token_ids` hand-off and `remote_host` rewrite (for a prefill that advertises an address the
    decode instance cannot reach, as vLLM's disagg_proxy_demo.py does)."""
    params = kv_params
    if prompt_token_ids is not None or (remote_host is not None and "remote_host" in kv_params):
        params = dict(kv_params)
        if prompt_token_ids is not None:
            params[PROMPT_TOKEN_IDS] = prompt_token_ids
        if remote_host is not None and "remote_host" in params:
            params["remote_host"] = remote_host
    decode = dict(body)
    decode["kv_transfer_params"] = params
    return decode


# ---- which requests can be disaggregated ---------------------------------------------------------------
# Content parts that are text to a chat template (pdserve.text.chat renders exactly these).
TEXT_PART_TYPES = ("text", "input_text", "output_text", "refusal")


def chat_prompt_ids_allowed(messages: Any, echo: Any = False) -> bool:
    """Whether a chat request's prompt token ids may travel in the decode leg's params instead of the decode
    instance templating the messages itself (vLLM: single conversation, text-only content, no echo).

    The proxy asks for the ids only when this holds, and the server honours given ids only when it holds
    (otherwise it drops them and templates): one rule, so both sides agree."""
    if echo or not isinstance(messages, list) or not messages:
        return False
    for message in messages:
        if not isinstance(message, dict):
            return False  # a batch of conversations (a list of lists), or malformed
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            return False
        for part in content:
            if isinstance(part, str):
                continue
            if not isinstance(part, dict) or part.get("type") not in TEXT_PART_TYPES:
                return False
    return True


def is_batch_prompt(body: dict[str, Any]) -> bool:
    """A completions request with several prompts: one prefill response carries only the first prompt's
    params (vLLM returns `final_res_batch[0]`'s), so it cannot be disaggregated as one P/D pair."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or len(prompt) <= 1:
        return False
    # A single prompt given as token ids is a flat list of ints.
    return not all(type(x) is int for x in prompt)


def local_only_reason(body: dict[str, Any], *, fork_n: bool = False) -> str | None:
    """Why an OpenAI request cannot be served as one P/D pair (a decode instance then serves it whole), or
    None. One prefill lease can be claimed once, by one engine request:

    - several prompts: the prefill response carries only the first prompt's params;
    - n/best_of > 1: every sampled choice would claim the same prefill's KV lease, unless the decode
      instances fork one load into the n choices (`fork_n`: pdserve's do; vLLM's do not);
    - prompt logprobs (`prompt_logprobs`, or completions `echo` with `logprobs`): they need the prompt's
      logits, which only the prefill instance computed.
    """
    if is_batch_prompt(body):
        return "several prompts"
    for key in ("best_of",) if fork_n else ("n", "best_of"):
        value = body.get(key)
        if type(value) is int and value > 1:
            return f"{key} > 1"
    if wants_prompt_logprobs(body):
        return PROMPT_LOGPROBS
    return None


PROMPT_LOGPROBS = "prompt logprobs"


def wants_prompt_logprobs(body: dict[str, Any]) -> bool:
    """`prompt_logprobs`, or completions `echo` with `logprobs` (the echoed prompt tokens carry theirs)."""
    return body.get("prompt_logprobs") is not None or bool(body.get("echo") and body.get("logprobs") is not None)


def scores_prompt(body: dict[str, Any]) -> bool:
    """A request that wants prompt logprobs and generates at most one token (lm-evaluation-harness's
    loglikelihood requests: echo, logprobs, max_tokens 0 or 1): all of its work is one prefill, so a proxy
    serves it whole on a prefill instance rather than putting a prefill into a decode instance's batches."""
    if not wants_prompt_logprobs(body):
        return False
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if type(value) is int:
            return value <= 1
    return False  # no limit given: it may generate up to the context length


# ---- the held KV's params (a prefill leg's answer, a decode leg's held history, a pinned prefix) ------
@dataclass(frozen=True)
class HeldKVParams:
    """Blocks an instance holds under a lease for another instance to read: its response's `kv_transfer_params`.

    Two shapes of one thing, one serialiser (`to_json`, the wire form byte for byte):
    - a prefill leg's answer (`history` false): vLLM 0.33 pull mode (the NixlConnector's `request_finished`),
      plus `remote_prefill_cached_tokens`, `lease_expires_at`, the lease token and (pdserve producers) the first
      token the leg sampled;
    - a decode leg's conversation kept for the next turn, or a cached prefix pinned for a peer (`history`
      true): vLLM's bidirectional shape (the holder is now the producer: `do_remote_decode` true), held until
      `remote_blocks_expiry_time` (ours: wall-clock seconds; vLLM's is the decode instance's perf_counter plus a
      handshake clock offset), plus the block hashes and bytes (`BLOCK_HASHES`, `BLOCK_BYTES`).

    `tp_size` is the producer's tensor-parallel size: its KV heads are split over that many pools (the
    handshake describes each), and a consumer of another TP size maps heads between them. `push`: the KV is
    WRITTEN to a decode instance (vLLM's push response shape: no lease token, nothing to claim)."""

    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    engine_id: str
    host: str
    port: int
    generation: int
    expires_at: float  # wall clock: the end of the lease as issued (heartbeats extend it on the producer)
    # The lease's own token; the producer acts on the lease (claim, heartbeat, abort, release) only for whoever
    # presents it, so a request id alone does not let anyone touch another request's KV. Never logged.
    lease_token: str = field(repr=False, default="")
    tp_size: int = 1
    history: bool = False
    num_cached_tokens: int = 0  # a prefill leg's prompt tokens its own prefix cache served
    block_hashes: tuple[str, ...] = ()  # history: the held blocks' hashes, in order
    block_bytes: int = 0  # history: bytes of one held block on the wire, all ranks together
    push: bool = False
    first_token: FirstToken | None = None  # a prefill leg's sampled token (pdserve producers)
    # per producer rank, one digest per held block (`BLOCK_DIGESTS`, vLLM's encoding) and how they were made
    block_digests: tuple[tuple[str, ...], ...] = ()
    digest_algo: str = ""
    # push, a key the prefill minted (a leg of vLLM's router's shape): answered as `push_key` and as
    # `remote_request_id` (what that router carries to the decode leg). A capability: never logged.
    push_key: str = field(repr=False, default="")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "do_remote_prefill": not self.history,
            "do_remote_decode": self.history,
            # One KV-cache group (plain decoder): a list holding one list of block ids.
            "remote_block_ids": [[int(b) for b in self.block_ids]],
            "remote_engine_id": self.engine_id,
            "remote_request_id": self.request_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_num_tokens": int(self.num_tokens),
            "tp_size": int(self.tp_size),
            "dcp_size": 1,
            "pp_size": 1,
            "remote_blocks_expiry_time": self.expires_at if self.history else None,
            "remote_registration_generation": self.generation,
            TRANSFER_MODE: PUSH if self.push else PULL,
        }
        if not self.history:
            out["remote_prefill_cached_tokens"] = int(self.num_cached_tokens)
        out["lease_expires_at"] = self.expires_at
        if not self.push:
            out[LEASE_TOKEN] = self.lease_token
        if self.history:
            out[BLOCK_HASHES] = [str(h) for h in self.block_hashes]
            out[BLOCK_BYTES] = int(self.block_bytes)
        if self.first_token is not None:
            out.update(first_token_fields(self.first_token))
        if self.block_digests and not self.push:  # a push's travel over the side channel
            out[BLOCK_DIGESTS] = [list(rank) for rank in self.block_digests]
            out[DIGEST_ALGO] = self.digest_algo
        if self.push_key:
            out[PUSH_KEY] = out["remote_request_id"] = self.push_key
        return out


# ---- the first token ------------------------------------------------------------------------------------
FIRST_TOKEN_ID = "first_token_id"
FIRST_TOKEN_LOGPROB = "first_token_logprob"
# false: a push decode leg does not adopt the first token its push brings (pdserve's own field: the server sets
# it where choice 0 of n > 1 must recompute; a push decode leg adopts the prefill's token by default)
PUSH_FIRST_TOKEN = "push_first_token"


@dataclass(frozen=True)
class FirstToken:
    """The token a prefill leg sampled (its max_tokens=1 output), and its logprob when the leg was asked
    for logprobs: what the decode instance emits first instead of recomputing the last prompt token."""

    token_id: int
    logprob: float | None = None
    rank: int | None = None  # 1-based rank in the full distribution
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first


def first_token_fields(token: FirstToken) -> dict[str, Any]:
    """The keys a producer adds to its `kv_transfer_params`."""
    fields: dict[str, Any] = {FIRST_TOKEN_ID: int(token.token_id)}
    if token.logprob is not None:
        fields[FIRST_TOKEN_LOGPROB] = {"logprob": float(token.logprob), "rank": token.rank,
                                       "top": [[int(t), float(lp)] for t, lp in token.top]}
    return fields


def without_first_token(params: Mapping[str, Any]) -> dict[str, Any]:
    """The params as a producer that sends no first token (vLLM) would have sent them; a push decode leg
    also takes none from its push's completion."""
    kept = {k: v for k, v in params.items() if k not in (FIRST_TOKEN_ID, FIRST_TOKEN_LOGPROB)}
    return {**kept, PUSH_FIRST_TOKEN: False}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_first_token(params: Mapping[str, Any]) -> FirstToken | None:
    """The first token in a decode leg's params, or None when the producer sent none. Untrusted input:
    a malformed value is an InvalidKVTransferParams (400), never a guess."""
    token_id = params.get(FIRST_TOKEN_ID)
    if token_id is None:
        if params.get(FIRST_TOKEN_LOGPROB) is not None:
            raise _bad(f"{FIRST_TOKEN_LOGPROB} without {FIRST_TOKEN_ID}")
        return None
    if not _is_int(token_id) or token_id < 0:
        raise _bad(f"{FIRST_TOKEN_ID} must be a non-negative integer, got {token_id!r}")
    lp = params.get(FIRST_TOKEN_LOGPROB)
    if lp is None:
        return FirstToken(token_id)
    if not isinstance(lp, Mapping) or not _is_number(lp.get("logprob")):
        raise _bad(f"{FIRST_TOKEN_LOGPROB} must be an object with a numeric logprob")
    rank = lp.get("rank")
    if rank is not None and (not _is_int(rank) or rank < 1):
        raise _bad(f"{FIRST_TOKEN_LOGPROB}.rank must be a positive integer, got {rank!r}")
    top = lp.get("top") or []
    if not isinstance(top, list) or not all(
        isinstance(t, list) and len(t) == 2 and _is_int(t[0]) and t[0] >= 0 and _is_number(t[1]) for t in top
    ):
        raise _bad(f"{FIRST_TOKEN_LOGPROB}.top must be a list of [token id, logprob] pairs")
    return FirstToken(token_id, float(lp["logprob"]), rank, tuple((int(t), float(v)) for t, v in top))


# ---- the decode leg sent before its params (pdserve decode instances only) ------------------------------
# A proxy may send the decode leg while the prefill leg runs, so that its HTTP, parsing, validation and
# admission overlap the prefill; its kv_transfer_params say only that the params come later, under a key
# the proxy chose, and the prefill's params follow on KV_PARAMS_PATH with that key. A vLLM decode instance
# has no such route: proxies use it only where the instance says it serves it (/pdserve/info).
PARAMS_LATER = "params_later"
KV_PARAMS_PATH = "/pdserve/v1/kv_params"
_MAX_KEY_CHARS = 200


def early_decode_params(key: str) -> dict[str, Any]:
    """A decode leg's kv_transfer_params before the prefill answered: the params come later under `key`."""
    return {"do_remote_prefill": True, PARAMS_LATER: key}


def params_later_key(params: Any) -> str | None:
    """The key of a decode leg whose params come later, or None (the params are here, or none at all).
    A malformed key is an InvalidKVTransferParams (400)."""
    if not is_remote_prefill(params) or PARAMS_LATER not in params:
        return None
    key = params[PARAMS_LATER]
    if not isinstance(key, str) or not 0 < len(key) <= _MAX_KEY_CHARS:
        raise _bad(f"{PARAMS_LATER} must be a non-empty string of at most {_MAX_KEY_CHARS} characters")
    if len(params) != 2:
        extra = sorted(k for k in params if k not in ("do_remote_prefill", PARAMS_LATER))
        raise _bad(f"{PARAMS_LATER} comes alone with do_remote_prefill (the params follow); got {extra}")
    return key


def params_delivery(key: str, kv_params: Mapping[str, Any]) -> dict[str, Any]:
    """The body of `POST KV_PARAMS_PATH`: the prefill's params for the decode leg waiting under `key`."""
    return {"key": key, "kv_transfer_params": dict(kv_params)}


# ---- the decode instance's validation ------------------------------------------------------------------
class InvalidKVTransferParams(ValueError):
    """`kv_transfer_params` of a request are missing, partial or malformed (the server answers 400)."""


# The lease token a pdserve producer adds to its params (`HeldKVParams`).
LEASE_TOKEN = "remote_lease_token"
_MAX_TOKEN_CHARS = 256

_REQUIRED = (
    "remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port", LEASE_TOKEN,
)

# Why a producer refused the lease a decode leg's params name, and the HTTP status the decode instance answers
# with: forged, replayed, expired or duplicated params are the client's mistake (4xx with the reason), not a
# failed transfer, and `kv_load_failure_policy` (which is for transport failures) does not apply to them.
LEASE_REJECTION_STATUS: Mapping[str, int] = {
    "unknown": 410,  # never held, or already read and freed (a replay)
    "expired": 410,  # nobody claimed it within the lease
    "already_claimed": 409,  # another decode request is reading it now
    "bad_token": 400,  # the lease exists, but remote_lease_token is not its token
    "mismatch": 400,  # the params name other blocks than the lease, or fewer tokens than this prompt needs
}

# Bound on a producer's parallel sizes as read from params: more ranks than any host has is a bad value.
MAX_TP_SIZE = 1024


@dataclass(frozen=True)
class RemotePrefillParams:
    """The validated subset of a decode request's `kv_transfer_params` the consumer acts on."""

    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    remote_block_ids: tuple[int, ...]
    remote_num_tokens: int | None
    generation: int | None  # remote_registration_generation: which producer incarnation issued them
    lease_token: str = field(repr=False, default="")  # remote_lease_token; never logged
    tp_size: int = 1  # the producer's tensor-parallel size (its KV heads live in that many pools)
    first_token: FirstToken | None = None  # the producer's sampled first token (pdserve producers)
    block_hashes: tuple[str, ...] = ()  # a held prefix's block hashes (`BLOCK_HASHES`), in order
    prefix: bool = False  # the params name a held prefix of the prompt (`is_remote_prefix`), not a decode leg's
    block_digests: tuple[tuple[str, ...], ...] = ()  # `BLOCK_DIGESTS`: per producer rank, per block
    digest_algo: str | None = None  # `DIGEST_ALGO`; None: not named (vLLM's prototype names none)
    min_read_tokens: int | None = None  # a held prefix: `MIN_READ_TOKENS`, the proxy's break-even (None: not sent)

    @property
    def address(self) -> tuple[str, int]:
        return (self.remote_host, self.remote_port)


def _bad(msg: str) -> InvalidKVTransferParams:
    return InvalidKVTransferParams(f"invalid kv_transfer_params: {msg}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_remote_prefill_params(params: Any) -> RemotePrefillParams:
    """Validate the params of a decode (D) request; raise InvalidKVTransferParams naming the problem.
    The proxy copies them verbatim from the prefill's answer, so they are untrusted input: a malformed
    dict is a 400, never a half-scheduled request."""
    if not isinstance(params, Mapping):
        raise _bad(f"expected a JSON object, got {type(params).__name__}")
    if not params.get("do_remote_prefill"):
        raise _bad("do_remote_prefill is not true (nothing to load)")
    missing = [k for k in _REQUIRED if params.get(k) is None]
    if missing:
        why = ("send the complete kv_transfer_params the prefill instance returned" if missing != [LEASE_TOKEN]
               else "only a pdserve prefill instance issues it; a pdserve decode instance loads from no other")
        raise _bad(f"missing {', '.join(missing)} ({why})")
    mode = params.get("transfer_mode", "pull")
    if mode != "pull":
        raise _bad(f"transfer_mode {mode!r} is not supported (pull only)")

    groups = params["remote_block_ids"]
    if not isinstance(groups, list) or not groups:
        raise _bad("remote_block_ids must be a non-empty list of per-group block id lists")
    if all(not isinstance(g, list) for g in groups):
        # vLLM < HMA (schema v1) sent one flat list; accept it as the single group.
        if not all(_is_int(b) and b >= 0 for b in groups):
            raise _bad("remote_block_ids must be a list of non-negative integers (or a list of one such list)")
        groups = [groups]
    if len(groups) != 1:
        raise _bad(
            f"remote_block_ids has {len(groups)} KV-cache groups; only single-group models are supported"
        )
    blocks = groups[0]
    if not isinstance(blocks, list) or not all(_is_int(b) and b >= 0 for b in blocks):
        raise _bad("remote_block_ids[0] must be a list of non-negative integers")

    engine_id = params["remote_engine_id"]
    request_id = params["remote_request_id"]
    host = params["remote_host"]
    for name, value in (
        ("remote_engine_id", engine_id),
        ("remote_request_id", request_id),
        ("remote_host", host),
    ):
        if not isinstance(value, str) or not value:
            raise _bad(f"{name} must be a non-empty string, got {value!r}")
    lease_token = params[LEASE_TOKEN]
    if not isinstance(lease_token, str) or not 0 < len(lease_token) <= _MAX_TOKEN_CHARS:
        raise _bad(f"{LEASE_TOKEN} must be a non-empty string of at most {_MAX_TOKEN_CHARS} characters")
    port = params["remote_port"]
    if not _is_int(port) or not 1 <= port <= 65535:
        raise _bad(f"remote_port must be an integer in 1..65535, got {port!r}")

    sizes: dict[str, int] = {}
    for name in ("tp_size", "pp_size", "dcp_size"):
        value = params.get(name, 1)
        if value is None:
            value = 1
        if not _is_int(value) or value < 1:
            raise _bad(f"{name} must be a positive integer, got {value!r}")
        if value > MAX_TP_SIZE:
            raise _bad(f"{name}={value} is more than {MAX_TP_SIZE}")
        if value != 1 and name != "tp_size":
            raise _bad(f"{name}={value}: producers with pipeline/context parallelism are not supported")
        sizes[name] = value

    num_tokens = params.get("remote_num_tokens")
    if num_tokens is not None and (not _is_int(num_tokens) or num_tokens < 0):
        raise _bad(f"remote_num_tokens must be a non-negative integer, got {num_tokens!r}")
    generation = params.get("remote_registration_generation")
    if generation is not None and not _is_int(generation):
        raise _bad(f"remote_registration_generation must be an integer, got {generation!r}")

    return RemotePrefillParams(
        remote_engine_id=engine_id,
        remote_request_id=request_id,
        remote_host=host,
        remote_port=port,
        remote_block_ids=tuple(blocks),
        remote_num_tokens=num_tokens,
        generation=generation,
        lease_token=lease_token,
        tp_size=sizes["tp_size"],
        first_token=parse_first_token(params),
        block_digests=parse_block_digests(params, len(blocks)),
        digest_algo=_digest_algo(params),
    )


# ---- per-block KV digests (vLLM's `remote_block_digests`; pdserve/kv_transfer/digest.py) ----------------
# vLLM's prototype (nixl/digest.py) sends one list per KV-cache group of "h1_h2" hex strings, one per block;
# pdserve sends one list per producer tensor-parallel rank (one group: with one rank the shapes coincide), and
# names its algorithm (`kv_digest_algo`, ours: vLLM's lane sums or XXH3-128).
BLOCK_DIGESTS = "remote_block_digests"
DIGEST_ALGO = "kv_digest_algo"
_DIGEST_RE = re.compile(r"[0-9a-f]{1,16}_[0-9a-f]{1,16}")


def parse_block_digests(params: Mapping[str, Any], num_blocks: int) -> tuple[tuple[str, ...], ...]:
    """The producer's block digests, validated (() when the params carry none); InvalidKVTransferParams when
    malformed: a list per rank (at most tp_size, or 1) of one "h1_h2" string per block."""
    raw = params.get(BLOCK_DIGESTS)
    if raw is None:
        return ()
    tp = params.get("tp_size") or 1
    if not isinstance(raw, list) or not 1 <= len(raw) <= max(int(tp) if _is_int(tp) else 1, 1):
        raise _bad(f"{BLOCK_DIGESTS} must be a list of one digest list per producer rank")
    out = []
    for rank in raw:
        if not isinstance(rank, list) or len(rank) != num_blocks or not all(
                isinstance(d, str) and _DIGEST_RE.fullmatch(d) for d in rank):
            raise _bad(f"{BLOCK_DIGESTS} must hold one \"h1_h2\" hex digest per block ({num_blocks} blocks)")
        out.append(tuple(rank))
    return tuple(out)


def _digest_algo(params: Mapping[str, Any]) -> str | None:
    algo = params.get(DIGEST_ALGO)
    if algo is not None and (not isinstance(algo, str) or not 0 < len(algo) <= 32):
        raise _bad(f"{DIGEST_ALGO} must be a short string")
    return algo


# ---- a cached prefix pinned for a peer's prefill (pdserve instances) -------------------------------------
# A proxy asks the instance that caches the longest prefix of a prompt to pin it (`POST PIN_PATH`, body
# `pin_body`); the answer's kv_transfer_params are a held history's (`HeldKVParams`), which the prefill leg
# reads back (`prefix_prefill_params`).
PIN_PATH = "/pdserve/kv/pin"
PIN_MIN_TOKENS = "min_tokens"


def pin_body(token_ids: Sequence[int], min_tokens: int) -> dict[str, Any]:
    return {PROMPT_TOKEN_IDS: list(token_ids), PIN_MIN_TOKENS: min_tokens}


# ---- multi-turn: a decode instance's held history (vLLM's bidirectional_kv_xfer, PR 32553) --------------
# The block hashes of the held blocks, in order (ours): the reader compares them with its own prompt's and reads
# only the blocks that match, so a conversation whose next prompt is not a token-exact extension of the held
# tokens (a re-templated or re-tokenized answer, an edited history) never gets another position's KV; vLLM
# assumes the prefix matches (vllm-project/vllm#43094).
BLOCK_HASHES = "remote_block_hashes"
# Bytes of one held block on the wire, all ranks together (ours): what the proxy's pull-or-recompute arithmetic
# needs without asking the instance.
BLOCK_BYTES = "remote_block_bytes"
# The fewest tokens worth reading of a held prefix, on a prefill leg a pdserve proxy priced (ours): its cost model's
# break-even for this turn (pdserve/proxy/history_decision.py). The reading instance applies it where it would
# apply its configured `kv_recompute_threshold` (the tokens left to read once its own prefix cache is counted), so
# the proxy's cost model is the one decider; without it (vLLM's proxy, a client sending held params itself) the
# instance's threshold applies, as in vLLM.
MIN_READ_TOKENS = "min_read_tokens"
_MAX_BLOCK_HASH_CHARS = 128


def wire_block_hash(h: int | bytes) -> str:
    """A block hash as it travels: hex (an int as its 64-bit two's complement, bytes as they are)."""
    if isinstance(h, bytes):
        return h.hex()
    return format(h & 0xFFFFFFFFFFFFFFFF, "016x")


def is_remote_prefix(params: Any) -> bool:
    """Params naming a peer's held blocks for a prefix of this request's prompt (a decode instance's held
    history, or any peer's): read them, compute the rest. Not a decode leg (`do_remote_prefill`), whatever
    `do_remote_decode` says (true on a prefill leg, which also holds its own blocks for its decode instance)."""
    return (isinstance(params, Mapping) and not params.get("do_remote_prefill")
            and bool(params.get("remote_block_ids")))


def prefix_prefill_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """A prefill leg's params that read a held prefix back (a decode instance's history, a peer's pinned
    prefix): the holder's params, verbatim, as a prefill leg's (`do_remote_decode`)."""
    return {**params, "do_remote_decode": True, "do_remote_prefill": False}


def with_min_read_tokens(params: Mapping[str, Any], tokens: int | None) -> dict[str, Any]:
    """A held prefix's params with the proxy's break-even (`MIN_READ_TOKENS`) for the reading instance; None: as
    they are (the instance's own threshold applies)."""
    return dict(params) if tokens is None else {**params, MIN_READ_TOKENS: int(tokens)}


def names_held_history(params: Any) -> bool:
    """A decode response's params naming a held history (vLLM's bidirectional shape: the decode instance is now
    the producer, `do_remote_decode` true, with blocks; ours also list their hashes)."""
    return (isinstance(params, dict) and not params.get("do_remote_prefill") and bool(params.get("do_remote_decode"))
            and bool(params.get("remote_block_ids")) and bool(params.get(BLOCK_HASHES)))


# What a proxy reads of held KV's params, untrusted (a value it cannot use reads as unknown: 0 or None).
def held_num_tokens(params: Mapping[str, Any]) -> int:
    """The tokens the held blocks cover (0: not said)."""
    n = params.get("remote_num_tokens")
    return n if isinstance(n, int) and n > 0 else 0


def held_num_blocks(params: Mapping[str, Any]) -> int:
    """The held blocks (of the one KV-cache group; vLLM < HMA sent a flat list)."""
    blocks = params.get("remote_block_ids") or [[]]
    return len(blocks[0]) if isinstance(blocks[0], list) else len(blocks)


def held_block_bytes(params: Mapping[str, Any]) -> int | None:
    """Bytes of one held block on the wire, all ranks together (`BLOCK_BYTES`), when the holder says."""
    n = params.get(BLOCK_BYTES)
    return n if isinstance(n, int) and n > 0 else None


def held_expires_at(params: Mapping[str, Any]) -> float | None:
    """When a held history's lease ends (`remote_blocks_expiry_time`, wall clock), when the holder says."""
    t = params.get("remote_blocks_expiry_time")
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else None


def parse_remote_prefix_params(params: Any) -> RemotePrefillParams:
    """Validate a held prefix's params (as a decode leg's, plus the block hashes); InvalidKVTransferParams
    names the problem."""
    if not is_remote_prefix(params):
        raise _bad("expected params naming a held prefix (remote_block_ids, do_remote_prefill false)")
    hashes = params.get(BLOCK_HASHES)
    if not isinstance(hashes, list) or not all(
        isinstance(h, str) and 0 < len(h) <= _MAX_BLOCK_HASH_CHARS for h in hashes
    ):
        raise _bad(f"{BLOCK_HASHES} must be a list of hex strings (the held blocks' hashes)")
    min_read = params.get(MIN_READ_TOKENS)
    if min_read is not None and (not _is_int(min_read) or min_read < 0):
        raise _bad(f"{MIN_READ_TOKENS} must be a non-negative integer, got {min_read!r}")
    # a held prefix is READ whatever the leg does with its own KV (a push prefill leg's key and mode ride along)
    plain = {k: v for k, v in params.items()
             if k not in (FIRST_TOKEN_ID, FIRST_TOKEN_LOGPROB, TRANSFER_MODE, PUSH_KEY)}
    parsed = parse_remote_prefill_params({**plain, "do_remote_prefill": True})
    if len(hashes) > len(parsed.remote_block_ids):
        raise _bad(f"{BLOCK_HASHES} lists {len(hashes)} hashes for {len(parsed.remote_block_ids)} blocks")
    return dataclasses.replace(parsed, block_hashes=tuple(hashes), prefix=True, min_read_tokens=min_read)


def parse_remote_kv_params(params: Any) -> RemotePrefillParams:
    """A decode leg's params (`do_remote_prefill`) or a held prefix's (`is_remote_prefix`), validated."""
    return parse_remote_prefix_params(params) if is_remote_prefix(params) else parse_remote_prefill_params(params)


# ---- push transfer (NixlPushConnector) -----------------------------------------------------------------
# vLLM's push connector (vllm/distributed/kv_transfer/kv_connector/v1/nixl/push_scheduler.py) marks its params
# with `transfer_mode: "push"`; the decode instance allocates the blocks it lacks and registers them with the
# prefill, which WRITEs the KV into them. vLLM sends the decode leg after the prefill answered, with the
# prefill's coordinates from its response; pdserve's proxy sends both legs at once, so the decode leg names the
# prefill instance up front (its /pdserve/info coordinates) and both legs carry one random `push_key` that
# pairs the prefill request with the decode's registration (a capability, like the lease token: only the two
# legs carry it).
#
# A router of vLLM's shape (vllm tests/v1/kv_connector/nixl_integration/toy_push_proxy_server.py) sends the
# prefill leg with `do_remote_decode` only, waits for its answer, then sends the decode leg with the answer's
# `remote_engine_id`, `remote_request_id`, `remote_host`, `remote_port`, `tp_size` (nothing else: no
# `transfer_mode`, no key). A push prefill instance given a leg without a key mints one and answers it as both
# `push_key` and `remote_request_id`; a push decode instance takes the key from `push_key`, else from
# `remote_request_id`. What authenticates that decode leg is the same as in pull mode: the key is random and
# only the prefill leg's answer carries it (to whoever sent that leg), as the lease token is; the registration
# that presents it reaches the prefill's side channel, which (with PDSERVE_KV_SECRET) takes only fleet members'.
TRANSFER_MODE = "transfer_mode"
PUSH = "push"
PULL = "pull"
PUSH_KEY = "push_key"
_PUSH_KEY_CHARS = (16, 128)


def is_push(params: Any) -> bool:
    return isinstance(params, Mapping) and params.get(TRANSFER_MODE) == PUSH


def push_prefill_params(key: str) -> dict[str, Any]:
    """The prefill leg's kv_transfer_params in push mode: compute the prompt, WRITE its KV to whichever
    decode instance registers blocks under `key`."""
    return {"do_remote_decode": True, "do_remote_prefill": False, TRANSFER_MODE: PUSH, PUSH_KEY: key}


def push_decode_params(key: str, *, engine_id: str, host: str, port: int, tp_size: int = 1) -> dict[str, Any]:
    """The decode leg's kv_transfer_params in push mode, sent together with the prefill leg: the prefill
    instance's side channel (from its /pdserve/info) and the pairing key."""
    return {"do_remote_prefill": True, "do_remote_decode": False, TRANSFER_MODE: PUSH, PUSH_KEY: key,
            "remote_engine_id": engine_id, "remote_host": host, "remote_port": port, "tp_size": tp_size}


@dataclass(frozen=True)
class PushParams:
    """A push-mode leg's validated params: the pairing key, and (decode leg) the prefill's side channel."""

    push_key: str = field(repr=False)
    remote_engine_id: str = ""
    remote_host: str = ""
    remote_port: int = 0
    tp_size: int = 1
    first_token: FirstToken | None = None  # a decode leg's, when its params carry one
    adopt_first_token: bool = True  # a decode leg: adopt the first token the push's completion brings
    minted: bool = False  # a prefill leg that came without a key (vLLM's router): the prefill chose it

    @property
    def address(self) -> tuple[str, int]:
        return (self.remote_host, self.remote_port)


def _push_key(params: Mapping[str, Any], field_name: str = PUSH_KEY) -> str:
    key = params.get(field_name)
    lo, hi = _PUSH_KEY_CHARS
    if not isinstance(key, str) or not lo <= len(key) <= hi:
        raise _bad(f"{field_name} must be a string of {lo} to {hi} characters in push mode")
    return key


def parse_push_prefill_params(params: Any) -> PushParams:
    """A prefill leg's params on a push instance (`do_remote_decode`): pdserve's proxy's carry the pair's
    `push_key`; one without a key (vLLM's router) gets a random key minted here (`minted`), which the answer
    returns (`HeldKVParams.push_key`)."""
    if not isinstance(params, Mapping) or not params.get("do_remote_decode"):
        raise _bad("not a prefill leg (do_remote_decode)")
    if params.get(PUSH_KEY) is None:
        return PushParams(secrets.token_hex(16), minted=True)
    return PushParams(_push_key(params))


def parse_push_decode_params(params: Any) -> PushParams:
    """A push-mode decode leg's params; InvalidKVTransferParams (400) names what is wrong. Params of the other
    mode are refused with the mode named: a pull decode leg (a lease to read) cannot be served by push."""
    if not isinstance(params, Mapping) or not params.get("do_remote_prefill"):
        raise _bad("a decode leg needs do_remote_prefill")
    # vLLM's push router forwards no transfer_mode: a leg without one is taken as push, unless it carries a
    # pull lease (a lease token: pdserve's pull producers)
    mode = params.get(TRANSFER_MODE, PULL if params.get(LEASE_TOKEN) else PUSH)
    if mode != PUSH:
        raise _bad(f"this decode instance uses kv_connector NixlPushConnector (transfer_mode 'push'); the params "
                   f"are for transfer_mode {mode!r} (NixlConnector/NixlPullConnector)")
    # the pair's key: pdserve's proxy's `push_key`, or the one the prefill minted, which vLLM's router carries
    # as `remote_request_id` (pdserve's prefill answers it so)
    key = _push_key(params) if params.get(PUSH_KEY) is not None else _push_key(params, "remote_request_id")
    engine_id, host, port, tp = (params.get(k) for k in ("remote_engine_id", "remote_host", "remote_port",
                                                          "tp_size"))
    if not isinstance(engine_id, str) or not engine_id:
        raise _bad("remote_engine_id must be a non-empty string")
    if not isinstance(host, str) or not host:
        raise _bad("remote_host must be a non-empty string")
    if not _is_int(port) or not 0 < port < 65536:
        raise _bad("remote_port must be an integer port")
    tp = 1 if tp is None else tp
    if not _is_int(tp) or not 1 <= tp <= MAX_TP_SIZE:
        raise _bad("tp_size must be a positive integer")
    adopt = params.get(PUSH_FIRST_TOKEN, True)
    if not isinstance(adopt, bool):
        raise _bad(f"{PUSH_FIRST_TOKEN} must be a boolean, got {adopt!r}")
    return PushParams(key, engine_id, host, port, tp, parse_first_token(params), adopt_first_token=adopt)


def refuse_push_params(params: Any) -> None:
    """A pull-mode decode instance given push params: a 400 naming the mode (the pairing check)."""
    if is_push(params):
        raise _bad("this decode instance uses kv_connector NixlConnector (transfer_mode 'pull'); the params are "
                   "for transfer_mode 'push' (NixlPushConnector)")


# ---- a request's params, read once where they come in ----------------------------------------------------
# What a decode leg or a held prefix loads, fully parsed: a lease to READ (pull) or a push registration.
LoadParams = RemotePrefillParams | PushParams


def remote_prefill_cached_tokens(params: Any) -> Any:
    """The prompt tokens the producer's own prefix cache served, as its params say (None when they do not):
    a decode instance reports them as the request's cached tokens."""
    return params.get("remote_prefill_cached_tokens") if isinstance(params, Mapping) else None


@dataclass(frozen=True)
class KVTransferParams:
    """A request's `kv_transfer_params`, read once where they come in (the server's routes, where the body is
    parsed, and its params delivery route): which P/D role they ask of this instance. Everything behind that edge
    (the server's pipeline and usage, `AsyncEngine`, the engine's `Request.kv`, the connector seam, kv_transfer)
    carries this object, never the dict.

    The role's full parse (`LoadParams` for a decode leg or a held prefix, `PushParams` for a push prefill leg)
    is done once, by the connector role that plays it (`KVConsumer.parse`, `KVProducer.parse_prefill_leg`): what a
    valid decode leg is depends on the instance (pull or push), and an instance that cannot play a role ignores
    its params, as vLLM does without a connector, so params it ignores are no client error. `wire` keeps the
    params as sent for that one parse; nothing reads fields from it but this module."""

    remote_decode: bool = False  # do_remote_decode: a prefill leg, whose KV is held for a decode instance
    remote_prefill: bool = False  # do_remote_prefill: a decode leg, which reads its prompt's KV
    prefix: bool = False  # they name a peer's held prefix of the prompt (`is_remote_prefix`)
    push: bool = False  # transfer_mode push
    remote_cached_tokens: int | None = None  # remote_prefill_cached_tokens, when a non-negative integer
    params_later: bool = False  # a decode leg sent before its params (`PARAMS_LATER` present; its key is checked
    # by `params_later_key`, where admission needs it)
    wire: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def read(cls, params: Mapping[str, Any] | None) -> KVTransferParams:
        """The one read of a request's params (the server's pipeline, where the body is parsed; the params
        delivery route): everything below carries this object."""
        p = params or {}
        cached = remote_prefill_cached_tokens(p)
        return cls(remote_decode=bool(p.get("do_remote_decode")), remote_prefill=bool(p.get("do_remote_prefill")),
                   prefix=is_remote_prefix(p), push=is_push(p),
                   remote_cached_tokens=cached if type(cached) is int and cached >= 0 else None,
                   params_later=PARAMS_LATER in p,
                   wire=MappingProxyType(dict(p)))  # a read-only copy: what was read stays what is parsed

    @property
    def loads(self) -> bool:
        """The request reads remote KV: a decode leg's prompt, or a peer's held prefix of it."""
        return self.remote_prefill or self.prefix

    def one_lease_violation(self, num_prompts: int) -> str | None:
        """The server side of the one-lease rule (`local_only_reason`): a decode leg loads one prompt's KV
        once. Several prompts would claim one lease several times; n choices of one prompt are fine (the first
        loads, the others fork the loaded blocks). Returns the client error, or None. The same holds for a
        peer's prefix (`is_remote_prefix`)."""
        if num_prompts <= 1:
            return None
        if self.remote_prefill:
            return ("kv_transfer_params.do_remote_prefill allows exactly one prompt (one remote KV lease serves "
                    "one prompt; n > 1 choices share its load)")
        if self.prefix:
            return ("kv_transfer_params naming a held prefix (remote_block_ids) allow exactly one prompt (one "
                    "remote KV lease serves one read)")
        return None

    def without_first_token(self) -> KVTransferParams:
        """These params as a producer that sends no first token (vLLM) would have sent them."""
        return dataclasses.replace(self, wire=MappingProxyType(without_first_token(self.wire)))

    def params_later_key(self) -> str | None:
        """A decode leg sent before its params (`early_decode_params`): their key (InvalidKVTransferParams
        when malformed), else None."""
        return params_later_key(self.wire)

    def parse_load(self, *, push: bool) -> LoadParams:
        """A decode leg's or a held prefix's params for a pull (`push` false) or push decode instance; raises
        InvalidKVTransferParams (a 400) naming what is wrong, or the mode the params are for."""
        if push:
            if self.prefix:
                raise _bad("reading a held prefix back (bidirectional_kv_xfer) is a prefill leg's; this instance "
                           "is a NixlPushConnector decode (a push prefill instance reads held prefixes back)")
            return parse_push_decode_params(self.wire)
        if self.prefix:
            # a held prefix is always READ (its holder leases it, in either mode); the leg that reads it may
            # push its own KV onwards (a push prefill's turn with history: `push_key` beside the prefix)
            return parse_remote_prefix_params(self.wire)
        refuse_push_params(self.wire)
        return parse_remote_kv_params(self.wire)

    def parse_push_prefill(self) -> PushParams:
        """A push-mode prefill leg's pairing key; InvalidKVTransferParams when malformed."""
        return parse_push_prefill_params(self.wire)
