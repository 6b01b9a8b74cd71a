"""Unit tests of the proxy's pure parts: the P/D protocol bodies (pdserve.api.pd), estimates, pools,
configuration."""

from __future__ import annotations

import argparse
import copy

import pytest

from pdserve.api import pd
from pdserve.bindcheck import exposure_warning, is_loopback, port_taken
from pdserve.proxy import protocol
from pdserve.proxy.cli import add_arguments, config_from_args
from pdserve.proxy.config import ProxyConfig, load_config_file
from pdserve.proxy.pool import Pool, normalize_url
from pdserve.proxy.request import prefill_body, routing_view, splittable_generate
from pdserve.proxy.retry import RetryBudget, parse_retry_after, retry_after_header

SIX_KEYS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def test_prefill_body_is_vllm_toy_proxy_body() -> None:
    body = {
        "model": "m",
        "prompt": "hello",
        "max_tokens": 50,
        "max_completion_tokens": 40,
        "min_tokens": 3,
        "min_completion_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.5,
        "kv_transfer_params": {"something": "client-sent"},
    }
    original = copy.deepcopy(body)
    prefill = pd.build_prefill_body(body)
    assert prefill == {
        "model": "m",
        "prompt": "hello",
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "stream": False,
        "temperature": 0.5,
        "kv_transfer_params": SIX_KEYS,
    }
    assert body == original  # the client's body is not modified
    # max_completion_tokens is only set when the client sent it; chat asks for token ids on demand.
    chat = pd.build_prefill_body({"messages": [], "stream": False}, chat_token_ids=True)
    assert chat == {
        "messages": [],
        "stream": False,
        "max_tokens": 1,
        "kv_transfer_params": SIX_KEYS,
        "return_token_ids": True,
    }


def test_decode_body_carries_params_verbatim() -> None:
    body = {"model": "m", "prompt": "p", "stream": True, "max_tokens": 9}
    params = {
        "do_remote_prefill": True,
        "remote_block_ids": [[1, 2]],
        "remote_host": "10.0.0.1",
        "x": {"y": [1.5]},
    }
    decode = pd.build_decode_body(body, params)
    assert decode == {**body, "kv_transfer_params": params}
    assert "kv_transfer_params" not in body
    handed = pd.build_decode_body(body, params, prompt_token_ids=[5, 6], remote_host="p-host")
    assert handed["kv_transfer_params"] == {**params, "prompt_token_ids": [5, 6], "remote_host": "p-host"}
    assert params["remote_host"] == "10.0.0.1"  # the prefill's dict is not modified
    # remote_host is only rewritten when the prefill sent one.
    assert (
        "remote_host" not in pd.build_decode_body(body, {"a": 1}, remote_host="h")["kv_transfer_params"]
    )


def test_prefill_response_parsing() -> None:
    assert pd.prefill_kv_params({"kv_transfer_params": {"a": 1}}) == {"a": 1}
    for bad in ({"kv_transfer_params": None}, {"kv_transfer_params": {}}, {}, [], "x"):
        assert pd.prefill_kv_params(bad) is None
    assert pd.prefill_prompt_token_ids({"prompt_token_ids": [1, 0, 7]}) == [1, 0, 7]
    for bad_ids in ([], [1, -1], [1, True], [1.0], None, "12"):
        assert pd.prefill_prompt_token_ids({"prompt_token_ids": bad_ids}) is None


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, True),
        (
            {
                "messages": [
                    {"role": "system", "content": None},
                    {"role": "user", "content": [{"type": "text", "text": "a"}]},
                ]
            },
            True,
        ),
        # The server renders these as text too, so the proxy and the server agree they are text-only.
        ({"messages": [{"role": "user", "content": ["a", {"type": "input_text", "text": "b"}]}]}, True),
        ({"messages": [{"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}]}, True),
        ({"messages": [{"role": "user", "content": "hi"}], "echo": True}, False),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            False,
        ),
        ({"messages": [[{"role": "user", "content": "batch"}]]}, False),
        ({"messages": []}, False),
    ],
)
def test_chat_token_id_eligibility(body: dict, expected: bool) -> None:
    assert pd.chat_prompt_ids_allowed(body.get("messages"), body.get("echo")) is expected


def test_estimates_and_batch_detection() -> None:
    assert protocol.estimate_prompt_tokens({"prompt": "a" * 400}) == 101
    assert protocol.estimate_prompt_tokens({"prompt": [1, 2, 3]}) == 3
    assert protocol.estimate_prompt_tokens({"prompt": ["a" * 40, "b" * 80]}) == 11 + 21
    assert protocol.estimate_prompt_tokens({"messages": [{"role": "user", "content": "a" * 40}]}) == 14
    assert protocol.max_output_tokens({"max_tokens": 5, "max_completion_tokens": 7}) == 7
    assert protocol.max_output_tokens({}) == 0
    assert pd.is_batch_prompt({"prompt": ["a", "b"]})
    assert pd.is_batch_prompt({"prompt": [[1, 2], [3]]})
    assert not pd.is_batch_prompt({"prompt": [1, 2, 3]})
    assert not pd.is_batch_prompt({"prompt": ["only"]})
    assert not pd.is_batch_prompt({"prompt": "text"})


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"prompt": "one"}, None),
        ({"prompt": ["a", "b"]}, "several prompts"),
        ({"prompt": "x", "n": 2}, "n > 1"),
        ({"prompt": "x", "n": 1, "best_of": 3}, "best_of > 1"),
        ({"prompt": "x", "prompt_logprobs": 0}, "prompt logprobs"),
        ({"prompt": "x", "echo": True, "logprobs": 1}, "prompt logprobs"),
        ({"prompt": "x", "echo": True}, None),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, None),
    ],
)
def test_local_only_reason(body: dict, reason: str | None) -> None:
    assert pd.local_only_reason(body) == reason


@pytest.mark.parametrize(
    ("body", "scores"),
    [
        ({"prompt": [1, 2], "echo": True, "logprobs": 1, "max_tokens": 1}, True),  # lm-eval's loglikelihood
        ({"prompt": "x", "echo": True, "logprobs": 0, "max_tokens": 0}, True),
        ({"messages": [], "prompt_logprobs": 2, "max_completion_tokens": 1, "max_tokens": 50}, True),
        ({"prompt": "x", "prompt_logprobs": 2, "max_tokens": 5}, False),  # also decodes: a decode instance
        ({"prompt": "x", "prompt_logprobs": 2}, False),  # no limit: it may decode to the context length
        ({"prompt": "x", "echo": True, "max_tokens": 1}, False),  # no logprobs: an ordinary P/D pair
        ({"prompt": "x", "prompt_logprobs": 1, "max_tokens": True}, False),
    ],
)
def test_scores_prompt(body: dict, scores: bool) -> None:
    """Which prompt-logprob requests the proxy serves whole on a prefill instance."""
    assert pd.scores_prompt(body) is scores


def test_n_forks_over_pd() -> None:
    """pdserve decode instances fork one load into n choices: n > 1 stays one pair, whose prefill leg asks
    one choice (one held lease)."""
    assert pd.local_only_reason({"prompt": "x", "n": 4}, fork_n=True) is None
    assert pd.local_only_reason({"prompt": "x", "best_of": 4}, fork_n=True) == "best_of > 1"
    assert pd.build_prefill_body({"prompt": "x", "n": 4, "max_tokens": 9})["n"] == 1
    assert pd.KVTransferParams.read({"do_remote_prefill": True}).one_lease_violation(1) is None
    assert "one prompt" in pd.KVTransferParams.read({"do_remote_prefill": True}).one_lease_violation(2)


def test_a_generate_body_is_read_by_the_openai_rules() -> None:
    """The render tier's tokens-only body, under OpenAI's names: one rule for both routes."""
    gen = {"request_id": "r1", "token_ids": [5, 6, 7], "stream": True,
           "sampling_params": {"max_tokens": 9, "n": 2, "temperature": 0.0, "prompt_logprobs": 1}}
    view = routing_view("/inference/v1/generate", gen)
    assert view == {"prompt": [5, 6, 7], "max_tokens": 9, "n": 2, "prompt_logprobs": 1}
    assert protocol.estimate_prompt_tokens(view) == 3 and protocol.max_output_tokens(view) == 9
    assert pd.local_only_reason(view) == "n > 1" and pd.local_only_reason(view, fork_n=True) == pd.PROMPT_LOGPROBS
    assert pd.scores_prompt({**view, "max_tokens": 1})
    openai = {"prompt": "hi", "max_tokens": 3}
    assert routing_view("/v1/completions", openai) is openai
    assert splittable_generate(gen) and not splittable_generate({"token_ids": []})
    assert not splittable_generate({"token_ids": [1], "sampling_params": "greedy"})


def test_generate_prefill_leg() -> None:
    gen = {"request_id": "r1", "token_ids": [5, 6, 7], "stream": True, "sampling_params": {"max_tokens": 9, "n": 2}}
    before = copy.deepcopy(gen)
    leg = prefill_body("/inference/v1/generate", gen, "rid")
    assert gen == before  # the client's body is not touched
    assert leg["request_id"] == "r1-prefill" and leg["stream"] is False and leg["token_ids"] == [5, 6, 7]
    assert leg["sampling_params"] == {"max_tokens": 1, "n": 1, "min_tokens": 0}
    assert leg["kv_transfer_params"] == pd.prefill_leg_params()
    pushed = prefill_body("/inference/v1/generate", {"token_ids": [1]}, "rid", push_key="k" * 32)
    assert pushed["request_id"] == "rid-prefill" and pushed["kv_transfer_params"] == pd.push_prefill_params("k" * 32)
    # the OpenAI routes: api/pd.py's builder, unchanged
    assert prefill_body("/v1/completions", {"prompt": "x"}, "rid") == pd.build_prefill_body({"prompt": "x"})


def test_affinity_key_uses_prefix_only() -> None:
    a = protocol.affinity_key({"prompt": "x" * 100 + "tail-a"}, 100)
    b = protocol.affinity_key({"prompt": "x" * 100 + "tail-b"}, 100)
    assert a == b
    m1 = {"messages": [{"role": "system", "content": "s" * 50}, {"role": "user", "content": "q1"}]}
    m2 = {"messages": [{"role": "system", "content": "s" * 50}, {"role": "user", "content": "q2"}]}
    assert protocol.affinity_key(m1, 30) == protocol.affinity_key(m2, 30)
    assert protocol.affinity_key(m1, 200) != protocol.affinity_key(m2, 200)
    assert protocol.affinity_key({}, 10) is None


def test_normalize_url() -> None:
    assert normalize_url("localhost:8100") == "http://localhost:8100"
    assert normalize_url("http://10.0.0.2:8200/v1/") == "http://10.0.0.2:8200"
    assert normalize_url("https://[::1]:9000") == "https://[::1]:9000"
    for bad in ("", "localhost", "ftp://h:1", "http://h:1/other"):
        with pytest.raises(ValueError):
            normalize_url(bad)


def test_pool_least_loaded_with_rotating_ties() -> None:
    pool = Pool("decode", ["h:1", "h:2", "h:3"], healthy=True)
    a, b, c = pool.instances
    # All idle: ties rotate, so consecutive choices cover every instance.
    assert {pool.choose().url for _ in range(3)} == {a.url, b.url, c.url}
    a.acquire(10)
    b.acquire(10)
    assert pool.choose() is c
    c.acquire(100)  # equal in_flight everywhere: fewer outstanding tokens wins
    assert pool.choose() in (a, b)
    c.release(100)
    assert pool.choose(exclude=[c]) in (a, b)
    assert pool.choose(exclude=[a, b, c]) is None


def test_pool_admission_ejection_readmission() -> None:
    pool = Pool("prefill", ["h:1", "h:2"])
    a, b = pool.instances
    # Nothing is admitted before a successful probe: no candidate, state "starting".
    assert pool.choose() is None and pool.healthy_count() == 0
    assert a.to_json()["state"] == b.state == "starting"
    assert a.record_success() and b.record_success()
    assert not a.record_failure("boom", eject_after=2)
    assert a.record_failure("boom", eject_after=2)
    assert not a.healthy and a.ejections_total == 1 and a.state == "ejected"
    assert all(pool.choose() is b for _ in range(4))
    assert b.record_failure("x", eject_after=1) and not b.healthy
    # Nothing healthy: no candidate (callers wait for a probe to re-admit one, then answer 503).
    assert pool.choose() is None
    assert a.record_success() and a.healthy and a.consecutive_failures == 0
    assert not a.record_success()


def test_pool_upstream_backoff() -> None:
    pool = Pool("decode", ["h:1", "h:2"], healthy=True)
    a, b = pool.instances
    assert pool.backoff_left() is None
    a.back_off(30)
    assert a.state == "backoff" and a.healthy
    assert all(pool.choose() is b for _ in range(4))
    b.back_off(5)
    assert pool.choose() is None
    assert 4 < pool.backoff_left() <= 5
    a.backoff_until = b.backoff_until = 0.0
    assert pool.choose() in (a, b)


def test_retry_budget_is_a_fraction_of_traffic() -> None:
    now = [0.0]
    budget = RetryBudget(ratio=0.1, min_per_s=0.0, burst=2, clock=lambda: now[0])
    assert budget.try_spend() and budget.try_spend() and not budget.try_spend()  # the burst, then empty
    spent = 0
    for _ in range(1000):  # an error storm: every request wants a retry
        budget.deposit()
        spent += budget.try_spend()
    assert spent == 100  # 10 % of the traffic, never more
    floor = RetryBudget(ratio=0.0, min_per_s=2.0, burst=1, clock=lambda: now[0])
    assert floor.try_spend() and not floor.try_spend()
    now[0] += 0.5
    assert floor.try_spend() and not floor.try_spend()  # 2 per second whatever the traffic
    now[0] += 100
    assert floor.tokens == 1.0  # never more than the burst saved up
    with pytest.raises(ValueError):
        RetryBudget(ratio=-1, min_per_s=0, burst=1)


def test_parse_retry_after() -> None:
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after("100000") == 300.0  # capped
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:10 GMT", now=1445412480.0) == 10.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412490.0) == 0.0
    assert retry_after_header(0.2) == "1" and retry_after_header(2.1) == "3"


def test_bindcheck_loopback_exposure_and_ports() -> None:
    import socket

    assert all(is_loopback(h) for h in ("127.0.0.1", "127.1.2.3", "localhost", "::1", "[::1]"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "", "10.0.0.1", "example.com"))
    assert exposure_warning("pdserve proxy", "127.0.0.1", None) is None
    assert exposure_warning("pdserve proxy", "0.0.0.0", "key") is None
    warning = exposure_warning("pdserve proxy", "0.0.0.0", None)
    assert warning is not None and "0.0.0.0" in warning and "--api-key" in warning
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        assert "not free" in (port_taken("127.0.0.1", port) or "")
    assert port_taken("127.0.0.1", port) is None
    assert port_taken("127.0.0.1", 0) is None


def test_pool_prefix_affinity_is_consistent_and_yields_to_load() -> None:
    pool = Pool("prefill", ["h:1", "h:2", "h:3", "h:4"], healthy=True)
    targets = {pool.choose(affinity="shared prefix", affinity_slack=2) for _ in range(8)}
    assert len(targets) == 1
    target = targets.pop()
    spread = {pool.choose(affinity=f"prefix {i}", affinity_slack=2) for i in range(40)}
    assert len(spread) > 1  # different prefixes land on different instances
    for _ in range(3):
        target.acquire(1)
    assert pool.choose(affinity="shared prefix", affinity_slack=2) is not target  # overloaded: least loaded
    target.release(1)
    assert pool.choose(affinity="shared prefix", affinity_slack=2) is target  # within the slack again
    # Removing another instance does not move this prefix (rendezvous hashing).
    other = next(inst for inst in pool.instances if inst is not target)
    pool.remove(other.url)
    assert pool.choose(affinity="shared prefix", affinity_slack=2) is target


def test_pool_membership() -> None:
    pool = Pool("decode", ["h:1"])
    with pytest.raises(ValueError):
        pool.add("http://h:1")
    pool.add("h:2")
    assert len(pool) == 2
    assert pool.remove("http://h:1/v1").url == "http://h:1"
    assert pool.remove("h:1") is None


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_config_file_and_flag_precedence(tmp_path, monkeypatch) -> None:
    yaml_file = tmp_path / "proxy.yaml"
    yaml_file.write_text(
        "prefill: [127.0.0.1:8100, 127.0.0.1:8101]\ndecode: 127.0.0.1:8200\n"
        "disagg-threshold-tokens: 64\non_prefill_failure: decode-local\nmax_inflight: 7\n"
    )
    monkeypatch.setenv("PDSERVE_ADMIN_KEY", "from-env")
    cfg = config_from_args(_parse(["--config", str(yaml_file), "--max-inflight", "9"]))
    assert cfg.prefill == ["http://127.0.0.1:8100", "http://127.0.0.1:8101"]
    assert cfg.decode == ["http://127.0.0.1:8200"]
    assert cfg.disagg_threshold_tokens == 64
    assert cfg.on_prefill_failure == "decode-local"
    assert cfg.max_inflight == 9  # the flag wins over the file
    assert cfg.admin_key == "from-env"
    assert cfg.chat_token_ids and not cfg.prefix_affinity  # defaults where neither says
    toml_file = tmp_path / "proxy.toml"
    toml_file.write_text('decode = ["h:1"]\nprefix-affinity = true\n')
    assert load_config_file(toml_file) == {"decode": ["h:1"], "prefix_affinity": True}
    bad = tmp_path / "bad.yaml"
    bad.write_text("decode: [h:1]\nno_such_key: 1\n")
    with pytest.raises(ValueError, match="no_such_key"):
        load_config_file(bad)
    no_ids = config_from_args(_parse(["--decode", "h:1", "--no-chat-token-ids", "--prefill", "a:1", "b:2"]))
    assert not no_ids.chat_token_ids and no_ids.prefill == ["http://a:1", "http://b:2"]


@pytest.mark.parametrize(
    "changes",
    [
        {"decode": []},
        {"on_prefill_failure": "maybe"},
        {"prefill": ["h:1", "h:1"]},
        {"max_inflight": 0},
        {"prefill_timeout": 0},
    ],
)
def test_config_validation(changes: dict) -> None:
    values = {"decode": ["h:9"], **changes}
    with pytest.raises(ValueError):
        ProxyConfig(**values).validate()


def test_proxy_import_graph_is_light() -> None:
    """The proxy (and the P/D wire contract it builds on) runs on machines without torch: none of its modules
    may pull it in."""
    import subprocess
    import sys

    code = (
        "import sys; import pdserve.cli, pdserve.api.pd, pdserve.proxy.app, pdserve.proxy.cli, pdserve.testing.standin; "
        "heavy = [m for m in ('torch', 'numpy', 'transformers', 'fastapi') if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
