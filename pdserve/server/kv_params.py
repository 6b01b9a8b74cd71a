"""`POST /pdserve/v1/kv_params`: the prefill's kv_transfer_params for a decode leg sent before them
(pdserve/api/pd.py `early_decode_params`; the engine side is pdserve/engine/pd/params_mailbox.py)."""

from __future__ import annotations

from typing import Any

from pdserve.api import pd
from pdserve.api.openai.errors import APIError
from pdserve.types.sampling_params import ParamError


async def deliver_kv_params(engine: Any, body: Any, can_load: bool) -> dict[str, str]:
    """Hands the params to the engine; a 400 names what is wrong (the waiting leg then ends with the same
    400), a 409 says this instance loads no remote KV."""
    if not can_load:
        raise APIError("this instance is no decode (kv_consumer) instance: it takes no kv_transfer_params", 409)
    if not isinstance(body, dict):
        raise APIError("the body must be a JSON object", 400)
    key, params = body.get("key"), body.get("kv_transfer_params")
    if not isinstance(key, str) or not key:
        raise APIError("key must be a non-empty string", 400, "key")
    if not isinstance(params, dict):
        raise APIError("kv_transfer_params must be an object", 400, "kv_transfer_params")
    if pd.PARAMS_LATER in params:
        raise APIError(f"kv_transfer_params must be the prefill's, not another {pd.PARAMS_LATER}", 400,
                       "kv_transfer_params")
    try:
        await engine.deliver_params(key, pd.KVTransferParams.read(params))  # the one read: typed from here on
    except ParamError as e:
        raise APIError(str(e), 400, e.param) from e
    return {"status": "delivered"}
