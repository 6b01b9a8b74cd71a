"""Multi-turn over P/D with and without reading the conversation back from the decode instance.

One prefill and one decode instance (`pdserve serve`, NIXL over DRAM or CUDA IPC) behind `pdserve proxy`, driven by
`pdserve bench --dataset-name multiturn` (synthetic conversations over the chat API: a shared system prompt,
`--turns` user messages, answers of `--answer-len` tokens, all conversations side by side). Modes:

- `on`: both instances with `bidirectional_kv_xfer` (the decode instance keeps each turn's conversation, the
  next turn's prefill reads it back and computes only the new tokens), `kv_recompute_threshold` as given; the
  proxy's cost model chooses per turn between reading the history back and recomputing it;
- `on-pull`: the same with the proxy told to read every held history back (`--kv-history-choice pull`): what
  each read costs, for the turns where `on` chose to recompute;
- `off`: the same without it: the prefill instance recomputes what its own prefix cache lacks (the answers,
  which the decode instance generated; its cache still holds its previous prompts);
- `off-nocache` (with `--modes`): also no prefix cache on the prefill instance (every turn recomputes the
  whole history: what a fleet whose prefill caches cannot hold every conversation converges to).

Answers (`--answers`): `fixed` (the default) has every answer be one token repeated (`allowed_token_ids`), a
token chosen so that the answer's text, put back into the conversation by the chat template, tokenizes to the
very ids that were generated; then the next turn's prompt starts with what the decode instance holds and every
turn tests the choice. With `free` answers a model with random weights (`--load-format dummy`) writes text that
does not re-tokenize to its ids, and nothing held matches the next prompt past the previous one.

Each mode starts with one uncounted two-turn conversation (`--no-warmup` to skip): the prefill instance's first
read from the decode instance pays the NIXL handshake, once per pair, which no turn's choice is about.

Per mode it reports the bench's per-turn table (TTFT, prompt, new, cached and computed prefill tokens) and
writes one JSON per mode plus a TTFT-by-turn plot of all modes.

The cost check (modes `on` and `on-pull`; `--no-cost-check` to skip): the proxy's log gives each turn's
decision and prediction (`X-PDServe-KV-History`: tokens, pull_ms, recompute_ms, new_tokens, priced_by), the
prefill instance's log the measured read-back time of each turn that read ("read N held prompt tokens back in
X ms"; mode `on-pull` reads every turn's). Recompute is measured at its marginal cost, as the turn pays it: the
same `on` prefill instance computes fresh random prompts of new + N and of new tokens (new: the turn's own new
prompt tokens, from the bench's usage numbers), `max_tokens` 1, and the difference is taken (median of
`--recompute-repeats`, the two lengths' order alternating). A turn whose choice was slower than the other, as
measured, by more than `--tolerance-ms`, is flagged WRONG; `multiturn-cost-check.json` holds every row and the
prefill instance's advertised `prefill_cost` (what the proxy priced recompute with; printed too). `--answer-len
64,640` runs the conversations once per answer length on the same servers, so that the held histories the prefill
lacks fall on both sides of the break-even.

The cost model prices a turn alone in its step, and the recompute is measured so; check it with
`--max-concurrency 1` (conversations one after another). With conversations side by side (the default: all at
once) the turns of a round reach the prefill instance together and share its steps, so a recomputed history is
no longer free under the step's floor, and a read's measured time includes waiting for the other turns' steps
(the H100 run of issue 42 measured reads of 3.6-5.7 ms alone and up to 32 ms side by side): the check then
compares a read measured in a crowd with a recompute measured alone, and says so.

    python benchmarks/bench_multiturn.py --out-dir benchmarks/results/multiturn-cpu
    python benchmarks/bench_multiturn.py --system-len 4096 --out-dir ...    # a long shared history
    # one GPU, P and D sharing it (the servers get the tokenizer too: a packaged shape has none)
    python benchmarks/bench_multiturn.py --model Llama-3.1-8B --serve-arg=--load-format --serve-arg=dummy \
        --serve-arg=--gpu-memory-utilization --serve-arg=0.4 --tokenizer TOK --modes on,on-pull \
        --answer-len 64,640 --turns 4 --conversations 3 --max-concurrency 1 \
        --proxy-arg=--kv-history-bandwidth --proxy-arg=cuda-ipc --out-dir ...
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_procs import stop, wait_healthy

MODES = ("on", "on-pull", "off", "off-nocache")
ANSWER_WORDS = (" a", " the", " and", " x", " 1", " of")  # candidates for the fixed answer's token


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    def __init__(self, name: str, cmd: list[str], logdir: Path, url: str, env: dict[str, str]) -> None:
        self.name = name
        self.url = url
        self.log = open(logdir / f"{name}.log", "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **env})

    def close(self) -> None:
        stop(self.proc)
        self.log.close()


def kv_config(role: str, bidirectional: bool, threshold: int) -> str:
    extra = {"bidirectional_kv_xfer": True, "kv_recompute_threshold": threshold} if bidirectional else {}
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": extra})


def round_trip_token(tokenizer_dir: str) -> int:
    """A token whose repetition, as an assistant answer put back into a conversation by the chat template,
    tokenizes to the same ids: the fixed answer (`--answers fixed`). Checked on a sample conversation."""
    from pdserve.text.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    msgs = [{"role": "user", "content": "hello there"}]
    prompt = tok.encode_chat(msgs)
    for word in ANSWER_WORDS:
        ids = tok.encode(word, add_special_tokens=False)
        if len(ids) != 1:
            continue
        answer = [ids[0]] * 12
        full = tok.encode_chat([*msgs, {"role": "assistant", "content": tok.decode(answer)},
                                {"role": "user", "content": "and then"}])
        if full[:len(prompt) + len(answer)] == prompt + answer:
            return ids[0]
    raise SystemExit(f"{tokenizer_dir}: none of {ANSWER_WORDS} round-trips through the chat template as an answer; "
                     "use --answers free")


def tokenizer_dir(args: argparse.Namespace) -> str:
    """The tokenizer the servers and the bench use: --tokenizer, else the model folder (the embedded default's
    when no model is given)."""
    if args.tokenizer:
        return args.tokenizer
    from pdserve.model.default_model import resolve_model

    path = resolve_model(args.model)
    if not (Path(path) / "tokenizer.json").is_file():
        raise SystemExit(f"{args.model}: no tokenizer.json there (a packaged shape): pass --tokenizer DIR")
    return str(path)


def start_instance(name: str, role: str, mode: str, args: argparse.Namespace, logdir: Path, env: dict) -> Proc:
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve", "serve", *([args.model] if args.model else []), "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", "bench", "--disable-uvicorn-access-log",
           "--max-model-len", str(args.max_model_len), "--block-size", "16",
           "--kv-transfer-config", kv_config(role, mode.startswith("on"), args.kv_recompute_threshold), "--side-channel-port", str(free_port())]
    if args.num_gpu_blocks:
        cmd += ["--num-gpu-blocks-override", str(args.num_gpu_blocks)]
    if mode == "off-nocache" and role == "kv_producer":
        cmd.append("--no-enable-prefix-caching")
    if args.tokenizer and not any(a == "--tokenizer" or a.startswith("--tokenizer=") for a in args.serve_arg):
        cmd += ["--tokenizer", args.tokenizer]  # a packaged shape (`--load-format dummy`) brings none
    cmd += args.serve_arg
    return Proc(f"{name}-{mode}", cmd, logdir, f"http://127.0.0.1:{port}", env)


def prefill_cost_info(url: str) -> dict | None:
    """What the prefill instance advertises its prefill steps cost (/pdserve/info `prefill_cost`: measured at its
    start on a GPU, None on a CPU), printed beside the check: the proxy priced recompute with it."""
    import httpx

    cost = httpx.get(f"{url}/pdserve/info", timeout=10).json().get("prefill_cost")
    if cost is None:
        print("prefill instance's prefill_cost: none advertised (recompute priced at --kv-history-prefill-tps)")
    else:
        pts = ", ".join(f"{n}: {s * 1e3:.2f} ms" for n, s in cost.get("points", []))
        print(f"prefill instance's prefill_cost ({cost.get('device')}): floor {cost['floor_s'] * 1e3:.2f} ms, "
              f"{cost['per_token_s'] * 1e6:.2f} us a token past it; measured steps {pts}")
    return cost


def run_mode(mode: str, args: argparse.Namespace, out_dir: Path, logdir: Path
             ) -> tuple[dict[str, dict], list[dict], dict | None]:
    """One mode's servers, then one `pdserve bench` run per answer length on them: ({series: bench result},
    per-turn cost rows (modes on / on-pull with the cost check), the prefill instance's advertised prefill_cost
    (modes on*))."""
    env = {"PDSERVE_KV_SECRET": "bench-multiturn-" + os.urandom(8).hex()}
    procs = [start_instance("prefill", "kv_producer", mode, args, logdir, env),
             start_instance("decode", "kv_consumer", mode, args, logdir, env)]
    try:
        for p in procs:
            wait_healthy(p.proc, p.url, 900, p.name)
        port = free_port()
        choice = ["--kv-history-choice", "pull"] if mode == "on-pull" else []
        proxy = Proc(f"proxy-{mode}", [sys.executable, "-m", "pdserve", "proxy", "--host", "127.0.0.1", "--port",
                                       str(port), "--prefill", procs[0].url, "--decode", procs[1].url,
                                       *choice, *args.proxy_arg],
                     logdir, f"http://127.0.0.1:{port}", {})
        procs.append(proxy)
        wait_healthy(proxy.proc, proxy.url, 120, proxy.name)
        results: dict[str, dict] = {}
        new_by_turn: dict[tuple[int, int], float | None] = {}

        def bench(answer_len: int, conversations: int, turns: int, prefix: str, name: str, seed: int,
                  result_dir: Path) -> list[str]:
            cmd = [sys.executable, "-m", "pdserve", "bench", "--base-url", proxy.url, "--model", "bench",
                   "--dataset-name", "multiturn", "--num-prompts", str(conversations),
                   "--multiturn-turns", str(turns), "--multiturn-system-len", str(args.system_len),
                   "--multiturn-user-len", str(args.user_len), "--multiturn-answer-len", str(answer_len),
                   "--multiturn-think-time", str(args.think_time), "--temperature", "0", "--label", name,
                   "--request-id-prefix", prefix, "--seed", str(seed),
                   "--save-result", "--result-dir", str(result_dir), "--result-filename", f"multiturn-{name}.json"]
            if args.tokenizer:
                cmd += ["--tokenizer", args.tokenizer]
            if args.answer_token is not None:
                cmd += ["--extra-body", json.dumps({"allowed_token_ids": [args.answer_token]})]
            if args.max_concurrency:
                cmd += ["--max-concurrency", str(args.max_concurrency)]
            return cmd

        if args.warmup:
            # one conversation of two turns with the longest answers, not counted: the prefill instance's first
            # read from this decode instance pays the NIXL handshake (once per pair, not per turn)
            # (its own seed: a measured conversation's prompts must not be in the prefill's cache beforehand)
            longest = max(args.answer_lens)
            subprocess.run(bench(longest, 1, 2, "warmup-", f"warmup-{mode}", 1_000_003, logdir), check=True,
                           stdout=subprocess.DEVNULL)
        for answer_len in args.answer_lens:
            name = series_name(mode, answer_len, args)
            cmd = bench(answer_len, args.conversations, args.turns, f"a{answer_len}-", name, answer_len, out_dir)
            t0 = time.monotonic()
            subprocess.run(cmd, check=True)
            print(f"mode {mode}, answers of {answer_len}: {time.monotonic() - t0:.1f} s")
            results[name] = json.loads((out_dir / f"multiturn-{name}.json").read_text())
            new_by_turn.update({(answer_len, t["turn"]): t.get("new_tokens_mean") for t in results[name]["turns"]})
        costs: list[dict] = []
        prefill_cost = prefill_cost_info(procs[0].url) if mode.startswith("on") else None
        if mode.startswith("on") and args.cost_check:
            costs = turn_costs(procs[0] if mode == "on" else None, logdir / f"proxy-{mode}.log",
                               logdir / f"prefill-{mode}.log", new_by_turn, args.recompute_repeats)
        return results, costs, prefill_cost
    finally:
        for p in reversed(procs):
            p.close()


_DECISION = re.compile(r"request (\S+): held history of (\d+) tokens on \S+: (\w+) \((.*)\)$")
_READ = re.compile(r"request (\S+): read (\d+) held prompt tokens back in ([\d.]+) ms")
_TURN = re.compile(r"a(\d+)-c(\d+)-t(\d+)")  # the bench's request ids: --request-id-prefix a<answer len>-


def series_name(mode: str, answer_len: int, args: argparse.Namespace) -> str:
    return mode if len(args.answer_lens) == 1 else f"{mode}-a{answer_len}"


def _recompute_ms(url: str, tokens: int, new: int, repeats: int) -> float:
    """What recomputing `tokens` history tokens adds to a turn of `new` prompt tokens on the prefill instance:
    fresh random prompts (nothing cached) of new + tokens and of new tokens, `max_tokens` 1, the median
    difference (the margin: a GPU computes a short history in the same step as the turn's tokens)."""
    import httpx

    def once(n: int) -> float:
        prompt = [random.randrange(1000, 40_000) for _ in range(n)]
        t0 = time.perf_counter()
        r = httpx.post(f"{url}/v1/completions", json={"model": "bench", "prompt": prompt, "max_tokens": 1},
                       timeout=300)
        r.raise_for_status()
        return time.perf_counter() - t0

    once(new + tokens)  # warm: the step size's first run (graphs, plans) is not the turn's cost
    diffs = []
    for i in range(repeats):  # the two lengths' order alternates, so that a drift between them cancels
        if i % 2:
            small = once(new)
            big = once(new + tokens)
        else:
            big = once(new + tokens)
            small = once(new)
        diffs.append(big - small)
    return statistics.median(diffs) * 1e3


def turn_costs(prefill: Proc | None, proxy_log: Path, prefill_log: Path,
               new_by_turn: dict[tuple[int, int], float | None], repeats: int) -> list[dict]:
    """Per turn that had a held history: the proxy's choice and prediction, the measured read-back time when
    it read, and (with `prefill`, mode `on`) the measured marginal recompute time. Keyed by (answer length,
    conversation, turn)."""
    reads = {m.group(1): float(m.group(3)) for m in _READ.finditer(prefill_log.read_text(errors="replace"))}
    rows = []
    for line in proxy_log.read_text(errors="replace").splitlines():
        m = _DECISION.search(line)
        if m is None:
            continue
        fields = dict(kv.split("=", 1) for kv in m.group(4).split("; ") if "=" in kv)
        t = _TURN.search(m.group(1))
        if t is None:
            continue  # the warm-up conversation
        answer_len, conv, turn = (int(x) for x in t.groups())
        tokens = int(fields.get("tokens", 0))
        new = new_by_turn.get((answer_len, turn))
        row = {"request": m.group(1), "answer_len": answer_len, "conversation": conv, "turn": turn,
               "decision": m.group(3), "reason": fields.get("reason"), "held": int(m.group(2)), "tokens": tokens,
               "new_tokens": round(new) if new else None, "priced_by": fields.get("priced_by"),
               "proxy_new_tokens": int(fields["new_tokens"]) if "new_tokens" in fields else None,
               "min_read_tokens": int(fields["min_read_tokens"]) if "min_read_tokens" in fields else None,
               "predicted_pull_ms": float(fields.get("pull_ms", "nan")),
               "predicted_recompute_ms": float(fields.get("recompute_ms", "nan")),
               "measured_pull_ms": next((ms for rid, ms in reads.items() if f"-{m.group(1)}-" in f"-{rid}-"), None)}
        if prefill is not None and tokens > 0:
            row["measured_recompute_ms"] = _recompute_ms(prefill.url, tokens, max(1, round(new or 1)), repeats)
        rows.append(row)
    return rows


def check_choices(on_rows: list[dict], pull_rows: list[dict], tolerance_ms: float) -> list[dict]:
    """Mode `on`'s choices against the measured costs: a read's time from the turn itself when it read, else
    from the same turn of mode `on-pull` (same prompts, same fixed answers: the same tokens). `right` is
    False (WRONG) when the chosen way was slower than the other by more than `tolerance_ms`; None when a side
    was not measured."""
    def key(r: dict) -> tuple:
        return r.get("answer_len"), r["conversation"], r["turn"]

    pulls = {key(r): r["measured_pull_ms"] for r in pull_rows}
    for r in on_rows:
        pull = r["measured_pull_ms"] if r["decision"] == "pull" else pulls.get(key(r))
        r["pull_ms_for_check"] = pull
        recompute = r.get("measured_recompute_ms")
        if r["decision"] not in ("pull", "recompute") or pull is None or recompute is None:
            r["right"] = None
            continue
        chosen, other = (pull, recompute) if r["decision"] == "pull" else (recompute, pull)
        r["right"] = chosen <= other + tolerance_ms
    # new: the turn's new prompt tokens (the bench's count, what the recompute was measured with); est: the proxy's
    # estimate, which it priced with (characters / 4 without the prompt's ids)
    print(f"{'answer':>6} {'conv':>4} {'turn':>4} {'decision':>9} {'reason':>10} {'tokens':>6} {'new':>5} {'est':>5} "
          f"{'pred pull':>9} {'pred recomp':>11} {'meas pull':>9} {'meas recomp':>11}")
    for r in on_rows:
        pull = r["pull_ms_for_check"]
        rec = r.get("measured_recompute_ms")
        print(f"{r.get('answer_len') or '-':>6} {r['conversation'] if r['conversation'] is not None else '-':>4} "
              f"{r['turn'] if r['turn'] is not None else '-':>4} {r['decision']:>9} {r['reason'] or '-':>10} "
              f"{r['tokens']:>6} {r['new_tokens'] or '-':>5} {r.get('proxy_new_tokens') or '-':>5} "
              f"{r['predicted_pull_ms']:>9.2f} "
              f"{r['predicted_recompute_ms']:>11.2f} {'-' if pull is None else f'{pull:.2f}':>9} "
              f"{'-' if rec is None else f'{rec:.2f}':>11}"
              + {True: "", False: "  WRONG", None: "  (unchecked)" if r["decision"] in ("pull", "recompute")
                 else ""}[r["right"]])
    checked = [r for r in on_rows if r["right"] is not None]
    choices = [r for r in on_rows if r["decision"] in ("pull", "recompute")]
    print(f"choice check: {len(checked)} turns checked, {sum(not r['right'] for r in checked)} WRONG, "
          f"{len(choices) - len(checked)} unchecked, {len(on_rows) - len(choices)} with nothing to choose "
          f"(p_cache / none) (tolerance {tolerance_ms} ms)")
    return on_rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder or name (default: pdserve's embedded SmolLM2)")
    ap.add_argument("--tokenizer", default=None, help="for the bench client (default: the server's model folder)")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--user-len", type=int, default=128)
    ap.add_argument("--answer-len", default="64",
                    help="tokens per answer; a comma list runs the conversations once per length on the same servers "
                         "(e.g. 64,640: histories on both sides of the pull-or-recompute break-even) (default 64)")
    ap.add_argument("--think-time", type=float, default=0.0)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--num-gpu-blocks", type=int, default=None)
    ap.add_argument("--kv-recompute-threshold", type=int, default=0,
                    help="both instances' kv_recompute_threshold (vLLM's default is 64, its bidirectional "
                         "benchmark configs use 0). The proxy's cost model decides per turn either way: a read it "
                         "chooses carries its own min_read_tokens, which the prefill applies instead (default 0)")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="one more `pdserve serve` argument for both instances (repeat; e.g. "
                         "--serve-arg=--load-format --serve-arg=dummy)")
    ap.add_argument("--modes", default="on,on-pull,off", help=f"comma list of {', '.join(MODES)}")
    ap.add_argument("--answers", choices=("fixed", "free"), default="fixed",
                    help="fixed: every answer one round-tripping token repeated, so that each turn's prompt starts "
                         "with what the decode instance holds; free: whatever the model writes (default fixed)")
    ap.add_argument("--no-cost-check", dest="cost_check", action="store_false",
                    help="skip checking the proxy's per-turn pull-or-recompute choice against measured costs")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="skip the uncounted two-turn conversation each mode starts with (it takes the prefill "
                         "instance's first read from the decode instance, which pays the NIXL handshake)")
    ap.add_argument("--recompute-repeats", type=int, default=5,
                    help="cost check: measurements of each turn's marginal recompute time (median; default 5)")
    ap.add_argument("--tolerance-ms", type=float, default=1.0,
                    help="cost check: a choice slower than the other by at most this is not WRONG (measurement "
                         "noise of two HTTP round trips; default 1.0)")
    ap.add_argument("--proxy-arg", action="append", default=[],
                    help="one more `pdserve proxy` argument (repeat; e.g. --proxy-arg=--kv-history-prefill-tps "
                         "--proxy-arg=500)")
    ap.add_argument("--out-dir", required=True)
    args = ap.parse_args()
    try:
        args.answer_lens = [int(x) for x in args.answer_len.split(",") if x]
    except ValueError:
        ap.error(f"--answer-len: integers, comma-separated; got {args.answer_len!r}")
    if not args.answer_lens or min(args.answer_lens) < 1:
        ap.error("--answer-len: at least one length >= 1")
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown modes {bad}")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    logdir = out_dir / "logs"
    logdir.mkdir(exist_ok=True)
    from pdserve.bench.multiturn import TurnSummary, plot_ttft_by_turn

    args.answer_token = round_trip_token(tokenizer_dir(args)) if args.answers == "fixed" else None
    if args.answer_token is not None:
        print(f"fixed answers: token {args.answer_token} repeated {args.answer_len} times")
    results: dict[str, dict] = {}
    costs: dict[str, list[dict]] = {}
    prefill_costs: dict[str, dict | None] = {}
    for m in modes:
        results_m, costs[m], prefill_costs[m] = run_mode(m, args, out_dir, logdir)
        results.update(results_m)
    if args.cost_check and "on" in costs:
        rows = check_choices(costs["on"], costs.get("on-pull", []), args.tolerance_ms)
        side_by_side = min(args.max_concurrency or args.conversations, args.conversations)
        print(f"conversations side by side: {side_by_side}"
              + ("" if side_by_side == 1 else
                 " (the cost model prices a turn alone in its step; side by side, turns share steps and a read "
                 "waits for the steps of others: check with --max-concurrency 1)"))
        checked = [r for r in rows if r["right"] is not None]
        (out_dir / "multiturn-cost-check.json").write_text(json.dumps(
            {"tolerance_ms": args.tolerance_ms, "checked": len(checked), "wrong": sum(not r["right"] for r in checked),
             "conversations_side_by_side": side_by_side, "prefill_cost": prefill_costs.get("on"),
             "rows": rows, "on_pull_rows": costs.get("on-pull", [])}, indent=1))
    series = {name: [TurnSummary(**t) for t in r["turns"]] for name, r in results.items()}
    plot = plot_ttft_by_turn(series, str(out_dir / "ttft-by-turn.png"),
                             f"TTFT by turn: {args.conversations} conversations, system {args.system_len}, "
                             f"user {args.user_len}, answer {args.answer_len}")
    names = list(series)
    print(f"{'turn':>4} " + " ".join(f"{n + ' TTFT p50':>22} {n + ' computed/new':>22}" for n in names))
    for i in range(args.turns):
        row = []
        for n in names:
            t = series[n][i] if i < len(series[n]) else None
            row.append(f"{t.ttft_p50_ms if t else float('nan'):>22.1f} "
                       f"{(t.computed_over_new if t and t.computed_over_new is not None else float('nan')):>22.2f}")
        print(f"{i:>4} " + " ".join(row))
    print(f"plot: {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
