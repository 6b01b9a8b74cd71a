"""POST /pdserve/kv/pin: pin a prompt's cached prefix for a peer's prefill to read (issue 18 part 4).

The proxy asks the instance whose prefix cache holds the most of a prompt (its fleet index says so) when
the prefill instance it chose lacks it. This instance takes a reference on the leading cached blocks and
holds them under a short history lease (`peer_pin_ttl_s`), answering the same `kv_transfer_params` a decode
instance returns for a held conversation: the prefill leg carries them and reads the blocks back with the
multi-turn machinery (hash-checked, claim / NIXL READ / release-with-verify; anything gone is recomputed).
An HTTP route rather than a side-channel message: the proxy speaks HTTP to instances and has no side-channel
client, and a pin must happen before the prefill leg is sent, which is where the proxy is.

Body: `{"prompt_token_ids": [int, ...], "min_tokens": int}`. Answers 200 `{"kv_transfer_params": {...} or
null}` (null: fewer than `min_tokens` tokens cached), 404 when this instance pins nothing (no
bidirectional_kv_xfer, `peer_pin_max_leases` 0, no prefix caching), 503 when it holds its maximum of pins.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from pdserve.api.openai.errors import error_body
from pdserve.api.pd import PIN_MIN_TOKENS, PROMPT_TOKEN_IDS
from pdserve.engine.pd.holds import PinRefused
from pdserve.server.pipeline import held_json


async def pin_prefix(engine: Any, body: Any) -> JSONResponse:
    ids = body.get(PROMPT_TOKEN_IDS) if isinstance(body, dict) else None
    if not isinstance(ids, list) or not ids or not all(type(t) is int and t >= 0 for t in ids):
        return JSONResponse(error_body(f"{PROMPT_TOKEN_IDS} must be a non-empty list of token ids", 400,
                                       PROMPT_TOKEN_IDS), 400)
    min_tokens = body.get(PIN_MIN_TOKENS, 1)
    if type(min_tokens) is not int or min_tokens < 0:
        return JSONResponse(error_body(f"{PIN_MIN_TOKENS} must be an integer >= 0", 400, PIN_MIN_TOKENS), 400)
    try:
        params = await engine.pin_cached_prefix(ids, min_tokens)
    except PinRefused as e:
        status = 404 if e.reason == "disabled" else 503
        return JSONResponse(error_body(str(e), status), status)
    return JSONResponse({"kv_transfer_params": held_json(params)})
