"""Multi-turn over P/D, the pieces without servers: history leases (own TTL, eviction, how they end), the
proxy's per-conversation map, the pull-or-recompute arithmetic, the bench's per-turn summary."""

from __future__ import annotations

import pytest

from pdserve.bench.multiturn import MultiTurnOptions, TurnResult, load_sharegpt, summarize_turns
from pdserve.kv_transfer.leases import ClaimRefused, LeaseTable
from pdserve.preflight.plan import pull_or_recompute
from pdserve.proxy.conversations import ConversationHistory, conversation_keys


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def history_params(n_blocks: int = 4, expiry: float | None = None) -> dict:
    return {"do_remote_prefill": False, "do_remote_decode": True, "remote_block_ids": [list(range(n_blocks))],
            "remote_engine_id": "d", "remote_request_id": "r-history", "remote_host": "127.0.0.1",
            "remote_port": 5601, "remote_num_tokens": 16 * n_blocks, "remote_lease_token": "t",
            "remote_block_hashes": [f"{i:016x}" for i in range(n_blocks)],
            "remote_blocks_expiry_time": expiry, "remote_block_bytes": 1024}


# ---- leases ----------------------------------------------------------------------------------------

def test_history_lease_has_its_own_ttl_and_ends_as_expired():
    clock = Clock()
    ended: list[str] = []
    expired_prefill: list[str] = []
    table = LeaseTable(2.0, clock=clock, on_history_end=ended.append, on_expired=expired_prefill.append)
    tok = table.hold("h", [1, 2], 32, duration_s=480.0, history=True)
    table.hold("p", [3], 16)  # a prefill leg's lease: the table's 2 s
    clock.t += 10
    assert table.reap() == ["p"]  # the prefill lease is over, the history is not
    clock.t += 480
    assert table.reap() == ["h"]
    assert ended == ["expired"] and expired_prefill == ["p"]  # histories are not counted as KV expiries
    with pytest.raises(ClaimRefused) as e:
        table.claim("h", tok, 1.0)
    assert e.value.reason == "expired"


def test_history_lease_pulled_aborted_evicted():
    ended: list[str] = []
    table = LeaseTable(30.0, on_history_end=ended.append)
    a = table.hold("a", [1], 16, duration_s=480.0, history=True)
    b = table.hold("b", [2], 16, duration_s=480.0, history=True)
    c = table.hold("c", [3], 16, duration_s=480.0, history=True)
    _, claim = table.claim("a", a, 5.0)
    assert table.evict("a") is False  # being read: stays
    assert table.release("a", a, claim) is True
    assert table.abort("b", b) is True
    assert table.evict("c") is True
    with pytest.raises(ClaimRefused) as e:
        table.claim("c", c, 1.0)
    assert e.value.reason == "expired"  # an evicted history reads as expired: the prefill recomputes
    assert ended == ["pulled", "aborted", "evicted"]
    assert sorted(table.poll_released()) == ["a", "b", "c"]


def test_heartbeat_extends_by_the_lease_own_duration():
    clock = Clock()
    table = LeaseTable(3.0, clock=clock)
    tok = table.hold("h", [1], 16, duration_s=300.0, history=True)
    clock.t += 290
    table.heartbeat([("h", tok)])
    clock.t += 100  # past the original 300 s, within 2/3 of 300 after the heartbeat
    assert table.reap() == []


# ---- the proxy's conversation map ----------------------------------------------------------------

def test_chat_conversation_found_by_its_earlier_turn():
    hist = ConversationHistory()
    turn1 = {"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"}]}
    assert hist.remember("/v1/chat/completions", turn1, history_params(), "http://d:1", prompt_tokens=20)
    turn2 = {"model": "m", "messages": [*turn1["messages"], {"role": "assistant", "content": "a1"},
                                        {"role": "user", "content": "u2"}]}
    other = {"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "x"},
                                        {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}]}
    assert hist.take("/v1/chat/completions", other) is None
    assert hist.take("/v1/completions", turn2) is None  # another route: another scope
    held = hist.take("/v1/chat/completions", turn2)
    assert held is not None and held.decode_url == "http://d:1" and held.prompt_tokens == 20
    assert held.num_tokens == 64
    assert hist.take("/v1/chat/completions", turn2) is None  # one held history serves one read
    # the same messages as the remembered turn itself is not an extension of it
    hist.remember("/v1/chat/completions", turn1, history_params(), "http://d:1")
    assert hist.take("/v1/chat/completions", turn1) is None


def test_completions_prompt_keys_by_whole_chunks():
    prompt = "x" * 150
    keys = conversation_keys("/v1/completions", {"model": "m", "prompt": prompt})
    assert len(keys) == 2  # 150 characters: two whole chunks of 64
    hist = ConversationHistory()
    hist.remember("/v1/completions", {"model": "m", "prompt": prompt}, history_params(), "http://d:1")
    assert hist.take("/v1/completions", {"model": "m", "prompt": prompt + " answer and more"}) is not None
    ids = list(range(40))
    hist.remember("/v1/completions", {"model": "m", "prompt": ids}, history_params(), "http://d:1")
    assert hist.take("/v1/completions", {"model": "m", "prompt": ids + [1, 2, 3]}) is not None
    assert hist.take("/v1/completions", {"model": "m", "prompt": ["a", "b"]}) is None  # several prompts


def test_expired_and_foreign_params_are_not_kept():
    clock = Clock()
    hist = ConversationHistory(max_entries=2, clock=clock)
    body = {"model": "m", "messages": [{"role": "user", "content": "u1"}]}
    nxt = {"model": "m", "messages": [*body["messages"], {"role": "assistant", "content": "a"},
                                      {"role": "user", "content": "u2"}]}
    prefill_params = {**history_params(), "do_remote_prefill": True, "do_remote_decode": False}
    assert not hist.remember("/v1/chat/completions", body, prefill_params, "http://d:1")
    hist.remember("/v1/chat/completions", body, history_params(expiry=clock.t + 5), "http://d:1")
    clock.t += 10
    assert hist.take("/v1/chat/completions", nxt) is None
    for i in range(5):  # bounded
        hist.remember("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": str(i)}]},
                      history_params(), "http://d:1")
    assert len(hist) == 2


# ---- the arithmetic ----------------------------------------------------------------------------------

def test_pull_or_recompute():
    # 8B shape, bf16: 128 KiB per token; 8k tokens over 400 Gb/s vs 20k tokens/s prefill
    c = pull_or_recompute(8192, 131072, 50e9, 20000.0)
    assert c.pull and c.wire_s < c.recompute_s
    # a handful of tokens: the fixed per-read overhead makes recomputing cheaper
    assert not pull_or_recompute(8, 131072, 50e9, 20000.0).pull
    # a link slower than the prefill per token: recompute
    assert not pull_or_recompute(8192, 131072, 0.1e9, 20000.0).pull
    assert not pull_or_recompute(0, 1, 1, 1).pull


# ---- the bench --------------------------------------------------------------------------------------

def test_turn_summary_counts_new_and_computed_tokens():
    rs = [TurnResult(0, 0, True, 0.5, 1.0, 100, 0, 10), TurnResult(0, 1, True, 0.1, 1.0, 150, 96, 10),
          TurnResult(1, 0, True, 0.7, 1.0, 100, 0, 10), TurnResult(1, 1, False, error="boom")]
    s = summarize_turns(rs)
    assert [t.turn for t in s] == [0, 1]
    assert s[0].new_tokens_mean == 100 and s[0].computed_tokens_mean == 100
    assert s[1].count == 2 and s[1].failed == 1
    assert s[1].new_tokens_mean == 40 and s[1].computed_tokens_mean == 54
    assert s[1].computed_over_new == pytest.approx(54 / 40)


def test_sharegpt_loader(tmp_path):
    path = tmp_path / "sg.json"
    path.write_text('[{"conversations": [{"from": "system", "value": "be kind"}, {"from": "human", "value": "hi"},'
                    ' {"from": "gpt", "value": "hello"}, {"from": "human", "value": "more"}]},'
                    ' {"conversations": [{"from": "gpt", "value": "only an answer"}]}]')
    convs = load_sharegpt(str(path), 3, MultiTurnOptions(turns=6, answer_len=5))
    assert len(convs) == 3 and convs[0].system == "be kind" and convs[0].user_messages == ["hi", "more"]
    assert convs[2].answer_len == 5
    path.write_text('{"not": "a list"}')
    with pytest.raises(ValueError):
        load_sharegpt(str(path), 1, MultiTurnOptions())


def test_bench_spec_multiturn_flags_become_the_conversation_options() -> None:
    from pdserve.bench.options import BenchSpec

    spec = BenchSpec(dataset_name="multiturn", multiturn_turns=3, multiturn_system_len=17, multiturn_user_len=9,
                     multiturn_answer_len=5, multiturn_think_time=0.25)
    assert spec.multiturn_options() == MultiTurnOptions(turns=3, system_len=17, user_len=9, answer_len=5,
                                                        think_time=0.25)
