"""`pdserve bench` end to end against a stand-in OpenAI streaming server on 127.0.0.1.

The stand-in streams vLLM-shaped SSE (a role-only opening delta for chat, one token per chunk, a usage
chunk, `[DONE]`) with controlled delays, records what it receives, and can expose decode-side NIXL
metrics. Run as a script it also plays `pdserve up` for the compare mode's `--launch` path:
`python tests/test_bench_e2e.py --topology T --model M --port P`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

REPO = Path(__file__).resolve().parent.parent
PNG = b"\x89PNG\r\n\x1a\n"


@dataclass
class StandIn:
    ttft_s: float = 0.01
    itl_s: float = 0.002
    served_name: str = "standin-model"
    root: str = "standin-root"
    fail_suffixes: tuple[str, ...] = ()  # x-request-id endings answered with HTTP 500
    nixl: bool = False  # expose decode-side vllm:nixl_* metrics and /pdserve/instances
    received: list[dict[str, Any]] = field(default_factory=list)
    url: str = ""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        if self.nixl:
            app.router.add_get("/metrics", self.metrics)
            app.router.add_get("/pdserve/instances", self.instances)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.served_name, "root": self.root}]})

    async def instances(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"prefill": [], "decode": [{"url": self.url, "healthy": True, "in_flight": 0}]}
        )

    async def metrics(self, request: web.Request) -> web.Response:
        n = len(self.received)
        lines = [
            f'vllm:nixl_xfer_time_seconds_bucket{{engine="0",le="0.005",model_name="m"}} {n}',
            f'vllm:nixl_xfer_time_seconds_bucket{{engine="0",le="+Inf",model_name="m"}} {n}',
            f'vllm:nixl_xfer_time_seconds_count{{engine="0",model_name="m"}} {n}',
            f'vllm:nixl_xfer_time_seconds_sum{{engine="0",model_name="m"}} {0.004 * n}',
            'vllm:nixl_num_failed_transfers_total{engine="0",model_name="m"} 0.0',
        ]
        return web.Response(text="\n".join(lines) + "\n")

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(
            {
                "path": request.path,
                "headers": {k.lower(): v for k, v in request.headers.items()},
                "body": body,
            }
        )
        if request.headers.get("x-request-id", "").endswith(self.fail_suffixes or ("\0",)):
            return web.json_response({"error": {"message": "boom"}}, status=500)
        chat = request.path.endswith("/chat/completions")
        n = int(body.get("max_completion_tokens") if chat else body.get("max_tokens"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(obj: dict[str, Any]) -> None:
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        if chat:  # role-only opening delta, sent before any token: must not count as the first token
            await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        await asyncio.sleep(self.ttft_s)
        for i in range(n):
            if i:
                await asyncio.sleep(self.itl_s)
            choice: dict[str, Any] = (
                {"index": 0, "delta": {"content": f" t{i}"}} if chat else {"index": 0, "text": f" t{i}"}
            )
            if i == n - 1:
                choice["finish_reason"] = "length"
            await send({"choices": [choice]})
        await send(
            {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}}
        )
        await resp.write(b"data: [DONE]\n\n")
        return resp


class ThreadedServer:
    """Runs a stand-in in its own event loop thread; `stop()` shuts it down and joins the thread."""

    def __init__(self, standin: StandIn) -> None:
        self.standin = standin
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def start(self) -> str:
        self._thread.start()
        port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        self.standin.url = f"http://127.0.0.1:{port}"
        return self.standin.url

    async def _start(self) -> int:
        self._runner = web.AppRunner(self.standin.app())
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return int(self._runner.addresses[0][1])

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)


def make_word_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i + 3 for i in range(500)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(str(path))
    return path


# Runs `pdserve bench` in a fresh interpreter and fails if it imported torch.
NO_TORCH_RUNNER = (
    "import sys\n"
    "from pdserve.cli import main\n"
    "rc = main(sys.argv[1:])\n"
    "assert 'torch' not in sys.modules, 'pdserve bench imported torch'\n"
    "sys.exit(rc)\n"
)


def run_bench(
    args: list[str], cwd: Path, env_extra: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("OPENAI_API_KEY", None)
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-c", NO_TORCH_RUNNER, "bench", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip


def test_serve_completions_block_json_and_requests(tmp_path: Path) -> None:
    tok = make_word_tokenizer(tmp_path / "tok")
    standin = StandIn(fail_suffixes=("-3",))
    server = ThreadedServer(standin)
    url = server.start()
    try:
        proc = run_bench(
            ["serve", "--base-url", url, "--tokenizer", str(tok), "--num-prompts", "6", "--random-input-len", "20",
             "--random-output-len", "5", "--request-rate", "200", "--seed", "1", "--goodput", "ttft:60000",
             "tpot:60000", "--metric-percentiles", "50,99", "--percentile-metrics", "ttft,tpot,itl,e2el",
             "--save-result", "--save-detailed", "--result-dir", str(tmp_path / "res"), "--result-filename",
             "r.json", "--request-id-prefix", "t-", "--metadata", "topology=collocated"],
            tmp_path, {"OPENAI_API_KEY": "sekret"},
        )  # fmt: skip
    finally:
        server.stop()
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "============ Serving Benchmark Result ============" in out
    assert "Successful requests:                     5         " in out
    assert "Failed requests:                         1         " in out
    assert "Request rate configured (RPS):           200.00    " in out
    assert "Total input tokens:                      35        " in out  # usage.prompt_tokens = 7 each
    assert "Total generated tokens:                  25        " in out
    assert "Request goodput (req/s):" in out and "P99 E2EL (ms):" in out
    assert "Failed requests during benchmark run detected" in out and "HTTP 500" in out

    result = json.loads((tmp_path / "res" / "r.json").read_text())
    assert result["completed"] == 5 and result["failed"] == 1
    assert result["model_id"] == "standin-root" and result["tokenizer_id"] == str(tok)
    assert result["request_rate"] == 200.0 and result["topology"] == "collocated"
    assert result["request_goodput"] == result["request_throughput"]  # generous SLOs: every success is good
    for key in (
        "mean_ttft_ms",
        "p50_tpot_ms",
        "p99_itl_ms",
        "std_e2el_ms",
        "max_output_tokens_per_s",
        "ttfts",
        "itls",
        "generated_texts",
        "errors",
        "latencies",
        "queue_times",
    ):
        assert key in result, key
    assert result["output_lens"] == [5, 5, 5, 0, 5, 5]
    assert result["generated_texts"][0] == " t0 t1 t2 t3 t4"
    assert all(len(itl) == 4 for i, itl in enumerate(result["itls"]) if i != 3)
    assert all(t >= standin.ttft_s for i, t in enumerate(result["ttfts"]) if i != 3)

    sent = sorted(standin.received, key=lambda r: int(r["headers"]["x-request-id"].split("-")[-1]))
    assert [r["headers"]["x-request-id"] for r in sent] == [f"t-{i}" for i in range(6)]
    for r in sent:
        assert r["path"] == "/v1/completions"
        assert r["headers"]["authorization"] == "Bearer sekret"
        body = r["body"]
        assert body["model"] == "standin-model" and body["max_tokens"] == 5 and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True} and body["ignore_eos"] is True
        assert body["repetition_penalty"] == 1.0 and "temperature" not in body
        assert len(body["prompt"].split()) == 19  # 20 requested minus the BOS the server adds
    assert len({r["body"]["prompt"] for r in sent}) == 6


def test_serve_chat_jsonl_ignores_role_delta(tmp_path: Path) -> None:
    data = tmp_path / "conv.jsonl"
    data.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hello there"}], "output_len": 3}) + "\n"
        + json.dumps({"prompt": "plain prompt"}) + "\n"
    )  # fmt: skip
    standin = StandIn(ttft_s=0.05)
    server = ThreadedServer(standin)
    url = server.start()
    try:
        proc = run_bench(
            ["--base-url", url, "--backend", "openai-chat", "--model", "m", "--skip-tokenizer-init", "--dataset-path",
             str(data), "--num-prompts", "4", "--random-output-len", "4", "--temperature", "0", "--disable-tqdm",
             "--save-result", "--save-detailed", "--result-filename", "c.json"],
            tmp_path,
        )  # fmt: skip
    finally:
        server.stop()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "%|" not in proc.stderr  # --disable-tqdm
    result = json.loads((tmp_path / "c.json").read_text())
    assert result["completed"] == 4 and result["output_lens"] == [3, 4, 3, 4]
    # The role-only delta arrives at once; the first token only after ttft_s: TTFT must not be earlier.
    assert min(result["ttfts"]) >= standin.ttft_s
    assert [len(i) for i in result["itls"]] == [2, 3, 2, 3]
    bodies = [r["body"] for r in standin.received]
    assert all(r["path"] == "/v1/chat/completions" for r in standin.received)
    assert {b["max_completion_tokens"] for b in bodies} == {3, 4} and all(
        b["temperature"] == 0 for b in bodies
    )
    assert {json.dumps(b["messages"]) for b in bodies} == {
        json.dumps([{"role": "user", "content": "hello there"}]),
        json.dumps([{"role": "user", "content": [{"type": "text", "text": "plain prompt"}]}]),
    }
    assert "ignore_eos" not in bodies[0]


def _port_open(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, int(port))) == 0


def test_compare_launch_transfer_check_plots_and_html(tmp_path: Path) -> None:
    tok = make_word_tokenizer(tmp_path / "tok")
    colo = StandIn(itl_s=0.02)  # ITL >= 20 ms: misses the 10 ms target whatever the machine does
    server = ThreadedServer(colo)
    url = server.start()
    out_dir = tmp_path / "cmp"
    try:
        proc = run_bench(
            ["compare", "--target", f"collocated={url}", "--launch", "pd=1p1d", "--model", "standin-root",
             "--launch-cmd", f"{sys.executable} {Path(__file__).resolve()}", "--launch-timeout", "60",
             "--transfer-check-url", "pd=auto", "--tokenizer", str(tok), "--request-rates", "100,inf",
             "--num-prompts", "4", "--random-input-len", "12", "--random-output-len", "4", "--goodput",
             "ttft:60000", "tpot:10", "--output-dir", str(out_dir), "--disable-tqdm"],
            tmp_path,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    finally:
        server.stop()
    assert len(colo.received) == 8
    assert len({r["headers"]["x-request-id"] for r in colo.received}) == 8  # unique across rates
    for name in ("collocated-100qps", "collocated-infqps", "pd-100qps", "pd-infqps"):
        run_json = json.loads((out_dir / "runs" / f"{name}.json").read_text())
        assert run_json["completed"] == 4 and "p99_itl_ms" in run_json and "p50_ttft_ms" in run_json
    # same prompts for every target at a rate, fresh prompts between rates
    colo_prompts = [{r["body"]["prompt"] for r in colo.received[i : i + 4]} for i in (0, 4)]
    assert not colo_prompts[0] & colo_prompts[1]
    for png in ("goodput_vs_rate", "p99_itl_vs_rate", "ttft_vs_rate", "ttft_cdf"):
        data = (out_dir / "plots" / f"{png}.png").read_bytes()
        assert data[:8] == PNG and len(data) > 1000
    summary = json.loads((out_dir / "summary.json").read_text())
    (verdict,) = summary["verdicts"]
    assert verdict["candidate"] == "pd" and verdict["baseline"] == "collocated"
    assert verdict["transfer"]["status"] == "pass" and verdict["transfer"]["transfers"] == 8
    assert all(c["baseline_misses_itl_target"] for c in verdict["checks"])
    assert verdict["decision"] in ("GO", "NO-GO")
    table = (out_dir / "results.md").read_text()
    assert "| 100 | collocated |" in table and "| inf | pd |" in table
    page = (out_dir / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 4 and "Disaggregate only if" in page
    log = (out_dir / "logs" / "launch-pd.log").read_text()
    assert "--topology 1p1d --model standin-root" in log
    port = log.split("--port ")[1].split()[0]
    assert not _port_open(f"http://127.0.0.1:{port}")  # SIGTERM stopped the launched process


def _serve_as_launcher() -> None:
    """`pdserve up` stand-in: serve until SIGTERM (aiohttp's run_app exits cleanly on it)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--topology", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, required=True)
    args, _ = parser.parse_known_args()
    print(
        f"stand-in launcher: --topology {args.topology} --model {args.model} --port {args.port}", flush=True
    )
    standin = StandIn(nixl=True, root=args.model, url=f"http://127.0.0.1:{args.port}")
    web.run_app(standin.app(), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    _serve_as_launcher()
