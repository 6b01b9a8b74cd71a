"""What the proxy learns about an instance on its own: whether it is a pdserve instance, its KV transfer mode
(push or pull), and for a pdserve instance what its /pdserve/info says about taking legs.

Two sources, as a router of vLLM's can read them too:

- pdserve's `/pdserve/info` (read by the health checker on each admission, before the instance is chosen):
  `kv_transfer_mode`, `kv_params_later`, and a push prefill's side channel (`engine_id`, `side_channel_host`,
  `side_channel_port`, `tensor_parallel_size`) that the decode leg of a push pair names;
- the `transfer_mode` that vLLM's schedulers put in a prefill answer's `kv_transfer_params` since
  vllm-project/vllm#50620 (`NixlBaseConnectorScheduler._TRANSFER_MODE`, "push" in `NixlPushConnectorScheduler`,
  vllm/distributed/kv_transfer/kv_connector/v1/nixl/push_scheduler.py). That PR also made the mode a factor of
  the NIXL handshake's compatibility hash (connector version 7), so a push and a pull instance never complete a
  handshake: pairing them is an error the proxy avoids up front rather than a request that fails later.

An instance without /pdserve/info (vLLM's) has no mode until its first prefill answer says it; a vLLM decode
instance never says (its answers carry no params), so it pairs with any prefill.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import aiohttp

from pdserve.api.pd import PULL, PUSH, TRANSFER_MODE
from pdserve.proxy.history_decision import RecomputeInfo
from pdserve.proxy.pool import Instance

MODES = (PULL, PUSH)


async def read_instance_info(session: aiohttp.ClientSession, inst: Instance, timeout: float) -> bool:
    """Reads `inst`'s /pdserve/info into its fields; False when the probe itself failed (nothing learnt)."""
    try:
        async with session.get(inst.endpoint("/pdserve/info"), timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            info = await resp.json(content_type=None) if resp.status == 200 else None
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
        return False
    apply_info(inst, info)
    return True


def apply_info(inst: Instance, info: Any) -> None:
    """`inst`'s fields from its /pdserve/info document (anything else: not a pdserve instance)."""
    # a prefill's measured prefill cost, for the multi-turn choice (history_decision.py)
    inst.recompute = RecomputeInfo.from_info(dict(info)) if inst.role == "prefill" and isinstance(info, Mapping) \
        else RecomputeInfo() if inst.role == "prefill" else None
    if not isinstance(info, Mapping):
        inst.pdserve = False
        inst.params_later = False
        inst.push_info = None
        return  # a vLLM instance keeps the mode its answers taught
    inst.pdserve = True
    inst.params_later = info.get("kv_params_later") is True
    mode = info.get("kv_transfer_mode")
    inst.transfer_mode = mode if mode in MODES else None  # None: no KV connector
    inst.push_info = push_coordinates(inst, info) if mode == PUSH else None


def push_coordinates(inst: Instance, info: Mapping[str, Any]) -> dict[str, Any] | None:
    """A push prefill's side channel, as `pdserve.api.pd.push_decode_params` takes it; None when it has none."""
    port = info.get("side_channel_port")
    if not isinstance(info.get("engine_id"), str) or type(port) is not int:
        return None
    return dict(engine_id=info["engine_id"], host=info.get("side_channel_host") or inst.host, port=port,
                tp_size=int(info.get("tensor_parallel_size") or 1))


def learn_from_params(inst: Instance, params: Mapping[str, Any]) -> None:
    """A prefill answer's `kv_transfer_params` say its instance's mode (vllm#50620's `transfer_mode`). What
    /pdserve/info said wins for a pdserve instance (read again on each admission)."""
    mode = params.get(TRANSFER_MODE)
    if mode in MODES and not inst.pdserve:
        inst.transfer_mode = mode


Kind = tuple[str | None, bool | None]  # (transfer mode, a pdserve instance): all that pairing looks at


def kind(inst: Instance, override: str | None) -> Kind:
    return (mode_of(inst, override), inst.pdserve)


def kinds_pair(prefill: Kind, decode: Kind) -> bool:
    """Whether a prefill and a decode instance of these kinds can be a P/D pair. Modes must match (a push
    instance WRITEs into blocks the decode registers, a pull one waits to be READ: vllm#50620 refuses such a
    handshake), an unknown mode matches any; and a push pair is two pdserve instances or two of vLLM's (their
    push registrations differ: pdserve's side-channel `push_register`, vLLM's NIXL `PUSH_REG` notification)."""
    (pm, p_pdserve), (dm, d_pdserve) = prefill, decode
    if pm is not None and dm is not None and pm != dm:
        return False
    if PUSH in (pm, dm) and p_pdserve is not None and d_pdserve is not None:
        return p_pdserve == d_pdserve
    return True


def pairs(prefill: Instance, decode: Instance, override: str | None) -> bool:
    return kinds_pair(kind(prefill, override), kind(decode, override))


def mode_of(inst: Instance, override: str | None) -> str | None:
    """The instance's transfer mode: `--kv-transfer-mode` when given (it overrides what was learnt), else what
    was learnt, else None."""
    return override if override is not None else inst.transfer_mode


def describe(instances: list[Instance], override: str | None) -> str:
    """`url (mode)` for each instance, for an error that names a mismatch."""
    def what(inst: Instance) -> str:
        mode = mode_of(inst, override) or "mode unknown"
        engine = "" if inst.pdserve is None else (" pdserve" if inst.pdserve else " vLLM")
        return f"{inst.url} ({mode}{engine})"
    return ", ".join(what(i) for i in instances) or "none"
