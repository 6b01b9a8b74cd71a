"""A stand-in for a vLLM prefill/decode instance at the HTTP level, to test and benchmark the proxy
without a model. It is not a model server: it answers instantly with fixed tokens.

It speaks the P/D protocol the way vLLM's OpenAI server does: a request whose `kv_transfer_params` has
`do_remote_decode` is a prefill leg (one token, non-streaming, `kv_transfer_params` pointing at
"held" blocks, `prompt_token_ids` when `return_token_ids` is asked on chat); any other request is
generated in full, as SSE when `stream` is set (`data: ...` events, `[DONE]`, usage chunk with
`stream_options.include_usage`).

Control routes (tests drive these over HTTP): `GET/DELETE /_standin/requests` (what it received:
path, headers, body, and for prefill legs the response), `GET /_standin/stats`, `POST /_standin/behaviour` (JSON merged into the
Behaviour below), `POST /_standin/release` (lets held requests go on).

    python -m pdserve.testing.standin --port 0 [--model NAME] [--api-key KEY]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from pdserve.api.pd import HeldKVParams, is_prefill_leg

MAX_RECORDED = 10_000


@dataclass
class Behaviour:
    fail_status: int = 0  # answer generation requests with this status ...
    fail_count: int = 0  # ... this many times (-1: always)
    retry_after: str = ""  # the Retry-After header of those failures ("" = none)
    no_params: bool = False  # prefill legs answer 200 with kv_transfer_params null
    max_tokens: int = 64  # cap on generated tokens (a D stream has one event per token)
    hold_before_response: bool = False  # wait for /_standin/release before answering
    hold_after_chunks: int = -1  # streams: wait for release after this many events
    die_after_chunks: int = -1  # streams: drop the connection after this many events


@dataclass
class StandinState:
    model: str
    api_key: str | None
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    behaviour: Behaviour = field(default_factory=Behaviour)
    received: collections.deque[dict[str, Any]] = field(
        default_factory=lambda: collections.deque(maxlen=MAX_RECORDED)
    )
    stats: dict[str, int] = field(
        default_factory=lambda: {"prefill": 0, "decode": 0, "streams_completed": 0, "disconnects": 0}
    )
    gate: asyncio.Event | None = None
    next_block: int = 0

    def gate_event(self) -> asyncio.Event:
        if self.gate is None:
            self.gate = asyncio.Event()
        return self.gate


def _text(messages: Any) -> str:
    if not isinstance(messages, list):
        return ""
    parts = []
    for message in messages:
        if isinstance(message, dict):
            content = message.get("content")
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts.extend(p.get("text", "") for p in content if isinstance(p, dict))
    return " ".join(parts)


def _prompt_ids(body: dict[str, Any]) -> list[int]:
    """Deterministic fake token ids of the prompt (one per character, at least one)."""
    prompt = body.get("prompt")
    text = prompt if isinstance(prompt, str) else _text(body.get("messages"))
    return [ord(c) % 50_000 for c in text] or [1]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _invalid(body: Any, chat: bool) -> str | None:
    """Why a generation body is malformed (vLLM answers those with a 400 too), or None. Only what the
    stand-in reads is checked, so that fuzzing the proxy in front of it never meets a stand-in crash."""
    if not isinstance(body, dict):
        return "the body must be a JSON object"
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            return "messages must be a non-empty list of objects"
        for m in messages:
            content = m.get("content")
            parts = content if isinstance(content, list) else []
            if not (content is None or isinstance(content, str | list)) or not all(
                isinstance(p, dict) and isinstance(p.get("text", ""), str) for p in parts
            ):
                return "message content must be a string or a list of text parts"
    elif not isinstance(body.get("prompt"), str | list):
        return "prompt must be a string or a list"
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and not (_is_int(value) and value >= 1):
            return f"{key} must be an integer >= 1"
    for key, kind in (("stream", bool), ("stream_options", dict), ("kv_transfer_params", dict)):
        if body.get(key) is not None and not isinstance(body[key], kind):
            return f"{key} must be a {kind.__name__}"
    return None


def _error(status: int, message: str) -> web.Response:
    payload = {"error": {"message": message, "type": "StandinError", "param": None, "code": status}}
    return web.json_response(payload, status=status)


class Standin:
    def __init__(self, state: StandinState) -> None:
        self.state = state

    async def generate(self, request: web.Request) -> web.StreamResponse:
        st = self.state
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            return _error(400, "invalid JSON")
        entry: dict[str, Any] = {"path": request.path, "headers": dict(request.headers), "body": body}
        st.received.append(entry)
        problem = _invalid(body, request.path.endswith("/chat/completions"))
        if problem is not None:
            return _error(400, problem)
        if st.api_key is not None and request.headers.get("Authorization") != f"Bearer {st.api_key}":
            return _error(401, "unauthorized")
        b = st.behaviour
        if b.fail_status and b.fail_count != 0:
            if b.fail_count > 0:
                b.fail_count -= 1
            failure = _error(b.fail_status, "injected failure")
            if b.retry_after:
                failure.headers["Retry-After"] = b.retry_after
            return failure
        if b.hold_before_response:
            await st.gate_event().wait()
        chat = request.path.endswith("/chat/completions")
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        kv = body.get("kv_transfer_params")
        if is_prefill_leg(kv):
            st.stats["prefill"] += 1
            out = self._prefill(body, chat, rid)
            entry["response"] = out
            return web.json_response(out)
        st.stats["decode"] += 1
        n_tokens = min(int(body.get("max_completion_tokens") or body.get("max_tokens") or 16), b.max_tokens)
        if body.get("stream"):
            return await self._stream(request, body, chat, rid, n_tokens)
        text = "".join(f" tok{i}" for i in range(n_tokens))
        return web.json_response(self._final(body, chat, rid, text, n_tokens, None))

    def _final(
        self, body: dict[str, Any], chat: bool, rid: str, text: str, n_tokens: int, kv: dict[str, Any] | None
    ) -> dict[str, Any]:
        n_prompt = len(_prompt_ids(body))
        choice: dict[str, Any] = {
            "index": 0,
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
        }
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.get("model") or self.state.model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": n_prompt,
                "completion_tokens": n_tokens,
                "total_tokens": n_prompt + n_tokens,
            },
            "kv_transfer_params": kv,
        }

    def _prefill(self, body: dict[str, Any], chat: bool, rid: str) -> dict[str, Any]:
        st = self.state
        ids = _prompt_ids(body)
        kv: dict[str, Any] | None = None
        if not st.behaviour.no_params:
            n_blocks = (len(ids) + 15) // 16
            blocks = list(range(st.next_block, st.next_block + n_blocks))
            st.next_block += n_blocks
            # The shape a real prefill instance answers with; the blocks are only numbers here.
            kv = HeldKVParams(
                request_id=f"{'chatcmpl' if chat else 'cmpl'}-{rid}-0-{uuid.uuid4().hex[:8]}",
                block_ids=tuple(blocks), num_tokens=len(ids), num_cached_tokens=0, engine_id=st.engine_id,
                host="localhost", port=5600, generation=0, expires_at=time.time() + 30.0,
                lease_token=uuid.uuid4().hex,
            ).to_json()
        out = self._final(body, chat, rid, " tok0", 1, kv)
        if chat and body.get("return_token_ids"):
            out["prompt_token_ids"] = ids
        return out

    async def _stream(
        self, request: web.Request, body: dict[str, Any], chat: bool, rid: str, n_tokens: int
    ) -> web.StreamResponse:
        st = self.state
        b = st.behaviour
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.get("model") or st.model,
        }
        events: list[dict[str, Any]] = []
        if chat:
            events.append(
                {
                    **head,
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                }
            )
        for i in range(n_tokens):
            last = i == n_tokens - 1
            choice: dict[str, Any] = {
                "index": 0,
                "logprobs": None,
                "finish_reason": "length" if last else None,
            }
            if chat:
                choice["delta"] = {"content": f" tok{i}"}
            else:
                choice.update(text=f" tok{i}", stop_reason=None)
            event = {**head, "choices": [choice]}
            if last:
                event["kv_transfer_params"] = None
            events.append(event)
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            n_prompt = len(_prompt_ids(body))
            events.append(
                {
                    **head,
                    "choices": [],
                    "usage": {
                        "prompt_tokens": n_prompt,
                        "completion_tokens": n_tokens,
                        "total_tokens": n_prompt + n_tokens,
                    },
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        try:
            for i, event in enumerate(events):
                if i == b.die_after_chunks:
                    if request.transport is not None:
                        request.transport.abort()
                    return resp
                if i == b.hold_after_chunks:
                    await st.gate_event().wait()
                await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            st.stats["disconnects"] += 1
            raise
        st.stats["streams_completed"] += 1
        return resp

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        model = {"id": self.state.model, "object": "model", "created": 0, "owned_by": "pdserve-standin"}
        return web.json_response({"object": "list", "data": [model]})

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
        except ValueError:
            return _error(400, "invalid JSON")
        problem = _invalid(body, isinstance(body, dict) and "messages" in body)
        if problem is not None:
            return _error(400, problem)
        ids = _prompt_ids(body)
        return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": 4096})

    async def detokenize(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
        except ValueError:
            return _error(400, "invalid JSON")
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(_is_int(t) and 0 <= t < 50_000 for t in tokens):
            return _error(400, "tokens must be a list of token ids")
        return web.json_response({"prompt": "".join(chr(t) for t in tokens)})

    async def get_requests(self, request: web.Request) -> web.Response:
        return web.json_response(list(self.state.received))

    async def clear_requests(self, request: web.Request) -> web.Response:
        self.state.received.clear()
        for key in self.state.stats:
            self.state.stats[key] = 0
        return web.json_response({"ok": True})

    async def get_stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.state.stats)

    async def set_behaviour(self, request: web.Request) -> web.Response:
        changes = await request.json()
        names = {f.name for f in dataclasses.fields(Behaviour)}
        unknown = set(changes) - names
        if unknown:
            return _error(400, f"unknown behaviour fields {sorted(unknown)}")
        self.state.behaviour = dataclasses.replace(self.state.behaviour, **changes)
        return web.json_response(dataclasses.asdict(self.state.behaviour))

    async def release(self, request: web.Request) -> web.Response:
        gate = self.state.gate_event()
        self.state.gate = asyncio.Event()
        gate.set()
        return web.json_response({"ok": True})


def create_app(model: str = "standin", api_key: str | None = None) -> web.Application:
    handlers = Standin(StandinState(model=model, api_key=api_key))
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/completions", handlers.generate)
    app.router.add_post("/v1/chat/completions", handlers.generate)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_post("/tokenize", handlers.tokenize)
    app.router.add_post("/detokenize", handlers.detokenize)
    app.router.add_get("/_standin/requests", handlers.get_requests)
    app.router.add_delete("/_standin/requests", handlers.clear_requests)
    app.router.add_get("/_standin/stats", handlers.get_stats)
    app.router.add_post("/_standin/behaviour", handlers.set_behaviour)
    app.router.add_post("/_standin/release", handlers.release)
    return app


async def _serve(host: str, port: int, model: str, api_key: str | None) -> None:
    runner = web.AppRunner(
        create_app(model, api_key), handler_cancellation=True, access_log=None, shutdown_timeout=1.0
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096)
    await site.start()
    host_out, port_out = runner.addresses[0][:2]
    print(f"standin listening on http://{host_out}:{port_out}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.testing.standin",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--model", default="standin")
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args(argv)
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(_serve(args.host, args.port, args.model, args.api_key))
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
