"""KV events for the blocks a push decode instance received (issue 44; llm-d-kv-cache PR #347: an indexer
loses track of decode instances when received blocks produce no event). Real `pdserve serve` processes: a push
prefill, a push decode and a collocated instance, the latter two publishing KV events to 127.0.0.1 ZMQ
sockets, real NIXL WRITEs, both legs sent as the proxy sends them (tests/test_pd_push_e2e.py's helpers).

- Once the push completed, the decode announces the prompt's full blocks: medium "GPU" (its own pool), and
  each block with the hash, parent and token ids the collocated instance announces for the same prompt.
- Not before: while the decode's blocks are registered with the prefill and the push is pending, neither its
  live stream nor its snapshot has them. (The events come from `Scheduler.end_load`, which runs on the push's
  completion; with this tiny model the WRITEs themselves take too little time to watch them in flight.)
- A partial prefix hit on the decode: only the blocks the push brought are new, chained to the hit.
- A push that never completes (no prefill leg: given up at the registration timeout) and one the decode
  aborts announce nothing for their blocks.
Instances run under different PYTHONHASHSEEDs: the hashes must not depend on it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_utils import MODEL, ServerProcess, all_ready, make_model_dir, wait_idle

pytest.importorskip("nixl_cu12", reason="NIXL is not installed (pip install --no-deps nixl-cu12==1.5.1)")
zmq = pytest.importorskip("zmq")

from test_pd_e2e import start  # noqa: E402 - after the skip
from test_pd_push_e2e import HEADERS, Leg, body, info, prompt, push_config, push_pair  # noqa: E402

from pdserve.api import pd  # noqa: E402
from pdserve.kv_events.block_hash import external_block_hashes  # noqa: E402
from pdserve.kv_events.events import BlockRemoved, BlockStored, decode_batch  # noqa: E402

BLOCK = 16  # test_pd_e2e.COMMON's --block-size
EVENTS = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*",
                     "replay_endpoint": "tcp://127.0.0.1:*", "snapshot_endpoint": "tcp://127.0.0.1:*"})

# one block as an indexer knows it: (parent hash, token ids, medium)
Block = tuple[int | None, tuple[int, ...], str | None]


def per_block(events: list[Any]) -> dict[int, Block]:
    """Every stored block of these events, keyed by its hash (a run of chained blocks split up)."""
    out: dict[int, Block] = {}
    for e in events:
        if isinstance(e, BlockStored):
            for k, h in enumerate(e.block_hashes):
                parent = e.parent_block_hash if k == 0 else e.block_hashes[k - 1]
                out[h] = (parent, tuple(e.token_ids[k * e.block_size:(k + 1) * e.block_size]), e.medium)
    return out


def snapshot(srv: ServerProcess) -> tuple[int, dict[int, Block]]:
    """(the last batch the state includes, the blocks the instance's publisher holds), from its snapshot socket."""
    ep = info(srv)["kv_events"]["snapshot_endpoint"]
    req = zmq.Context.instance().socket(zmq.REQ)
    try:
        req.connect(ep)
        req.send(b"snapshot")
        assert req.poll(10_000), "no snapshot answer"
        seq, _identity, *chunks = req.recv_multipart()
    finally:
        req.close(linger=0)
    seq_no = int.from_bytes(seq, "big", signed=True)
    assert seq_no != -2, "snapshot unavailable"
    return seq_no, per_block([e for c in chunks for e in decode_batch(c).events])


class LiveEvents:
    """An instance's live stream since the module started: every batch, in order (bounded reads)."""

    def __init__(self, srv: ServerProcess):
        self.srv = srv
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(info(srv)["kv_events"]["endpoint"])
        self.batches: list[tuple[int, list[Any]]] = []  # (seq, events)
        self._read(lambda: bool(self.batches), "the first batch (an idle instance's heartbeat)")

    def _read(self, done: Any, what: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            if self.sock.poll(200):
                _topic, seq, payload = self.sock.recv_multipart()
                self.batches.append((int.from_bytes(seq[:8], "big"), decode_batch(payload).events))

    def through(self, seq: int) -> list[Any]:
        """Every event received so far, after reading on until batch `seq` (a snapshot's) arrived."""
        self._read(lambda: seq < 0 or any(s >= seq for s, _ in self.batches), f"batch {seq}")
        return [e for _, evs in self.batches for e in evs]

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("kv-events-push")
    model = make_model_dir(root)
    servers = {
        "collocated": start(model, root, "collocated", "--kv-events-config", EVENTS, env={"PYTHONHASHSEED": "1"}),
        # every prompt layer by layer (shorter than the default push_layerwise_min_tokens)
        "prefill": start(model, root, "prefill", "--kv-transfer-config",
                         push_config("kv_producer", push_layerwise_min_tokens=0), "--side-channel-port", "0"),
        "decode": start(model, root, "decode", "--kv-transfer-config",
                        push_config("kv_consumer", push_registration_timeout=4.0), "--kv-events-config", EVENTS,
                        env={"PYTHONHASHSEED": "2"}),
    }
    with all_ready(servers):
        live = LiveEvents(servers["decode"])
        try:
            yield {**servers, "live": live}
        finally:
            live.close()


def prompt_ids(srv: ServerProcess, text: str) -> list[int]:
    r = httpx.post(f"{srv.url}/tokenize", json={"model": MODEL, "prompt": text}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def collocated_blocks(cluster: dict[str, Any], b: dict) -> tuple[list[int], dict[int, Block]]:
    """The collocated answer's token ids, and the blocks the collocated instance announced by then."""
    r = httpx.post(f"{cluster['collocated'].url}/v1/completions", json=b, timeout=60, headers=HEADERS)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"], snapshot(cluster["collocated"])[1]


def stored_hashes(events: list[Any]) -> list[int]:
    return [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]


def test_pushed_blocks_are_announced_once_the_push_completed_as_collocated_announces_them(cluster):
    decode, live = cluster["decode"], cluster["live"]
    b = body(3, words=90)
    full = external_block_hashes(prompt_ids(decode, b["prompt"]), BLOCK)  # the push writes the whole prompt
    assert len(full) >= 4
    ref_tokens, ref_blocks = collocated_blocks(cluster, b)
    assert set(full) <= set(ref_blocks)

    # the decode leg first: admitted, its blocks allocated and registered with the prefill; nothing pushed yet
    d, _, key = push_pair(cluster["prefill"], decode, b, send_prefill=False)
    time.sleep(1.0)  # (the prefill holds the registration until its own leg comes: test_pd_push_e2e's timing)
    seq, held = snapshot(decode)
    assert not set(full) & set(held)
    assert not set(full) & set(stored_hashes(live.through(seq)))
    p = Leg(cluster["prefill"].url, "completions", pd.build_prefill_body(b, push_key=key), f"p-{key}")
    assert p.result().status_code == 200
    out = d.result()
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["token_ids"] == ref_tokens

    seq, held = snapshot(decode)
    assert {h: held.get(h) for h in full} == {h: ref_blocks[h] for h in full}
    assert {held[h][2] for h in full} == {"GPU"}
    assert held[full[0]][0] is None  # the chain starts at the prompt's first block, as for a computed prompt
    events = live.through(seq)
    stored = stored_hashes(events)
    assert all(stored.count(h) == 1 for h in full)  # announced once, on the live stream too
    assert not set(full) & {h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}
    wait_idle(decode.url)


def test_a_partial_prefix_hit_announces_only_the_pushed_blocks_chained_to_the_hit(cluster):
    decode, live = cluster["decode"], cluster["live"]
    shared = prompt(33, 150)
    # tails of a few blocks each, so that the second prompt has full blocks of its own
    first, second = (body(0, prompt=shared + " " + prompt(seed, 25), max_tokens=8) for seed in (34, 35))
    full1 = external_block_hashes(prompt_ids(decode, first["prompt"]), BLOCK)
    full2 = external_block_hashes(prompt_ids(decode, second["prompt"]), BLOCK)
    hit = [h for h, g in zip(full1, full2, strict=False) if h == g]  # the shared full blocks
    new = full2[len(hit):]
    assert len(hit) >= 4 and new and full2[:len(hit)] == hit

    for b in (first, second):
        ref_tokens, ref_blocks = collocated_blocks(cluster, b)
        seq0, _ = snapshot(decode)
        n0 = len(live.through(seq0))
        d, p, _ = push_pair(cluster["prefill"], decode, b)
        assert p is not None and p.result().status_code == 200
        out = d.result()
        assert out.status_code == 200, out.text
        assert out.json()["choices"][0]["token_ids"] == ref_tokens
        seq, held = snapshot(decode)
        during = live.through(seq)[n0:]  # what this request's push made the decode announce
    # the second request: the hit blocks stay as they were, announced once (by the first request); the pushed
    # ones are new, with the collocated instance's hashes, parents and tokens, the run chained to the last hit
    assert {h: held.get(h) for h in full2} == {h: ref_blocks[h] for h in full2}
    assert {held[h][2] for h in full2} == {"GPU"}
    announced = [h for h in stored_hashes(during) if h in set(full2)]
    assert announced == new
    first_run = next(e for e in during if isinstance(e, BlockStored) and new[0] in e.block_hashes)
    assert first_run.block_hashes[0] == new[0] and first_run.parent_block_hash == hit[-1]
    assert first_run.medium == "GPU"
    wait_idle(decode.url)


def test_a_push_that_never_completes_announces_nothing(cluster):
    decode, live = cluster["decode"], cluster["live"]
    # registered, its prefill leg never sent: given up at the registration's timeout, the decode fails (500)
    gone = body(5, words=90)
    d, _, _ = push_pair(cluster["prefill"], decode, gone, send_prefill=False)
    assert d.result().status_code == 500
    # registered, then dropped by its client: the push is cancelled, the blocks come back once quiesced
    dropped = body(7, words=90)
    i = info(cluster["prefill"])
    dparams = pd.push_decode_params(uuid.uuid4().hex, engine_id=i["engine_id"],
                                    host=i["side_channel_host"], port=i["side_channel_port"])
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{decode.url}/v1/completions", json=pd.build_decode_body(dropped, dparams), timeout=1.5,
                   headers=HEADERS)
    wait_idle(decode.url)  # both ended, their blocks freed
    seq, held = snapshot(decode)
    events = live.through(seq)
    for b in (gone, dropped):
        full = external_block_hashes(prompt_ids(decode, b["prompt"]), BLOCK)
        assert len(full) >= 4
        assert not set(full) & set(held)
        assert not set(full) & set(stored_hashes(events))
