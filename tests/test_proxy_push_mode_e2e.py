"""The proxy learns each instance's transfer mode on its own (pdserve/proxy/instance_info.py, pairing.py): real
`pdserve serve` push (NixlPushConnector) and pull (NixlConnector) instances, real NIXL, real `pdserve proxy`
processes, each given only addresses.

- a push fleet behind `pdserve proxy --prefill P --decode D` (no flag) is driven in push mode: token-exact with
  a collocated instance, streamed and not, and the KV went by push;
- a mixed fleet (a push and a pull pair) pairs push with push and pull with pull: every answer exact, each
  decode instance served only its own mode's legs;
- a fleet where no pair is possible (push prefill, pull decode) is answered with an error naming the mismatch;
- `--kv-transfer-mode` still overrides: `push` as before; `pull` over push instances sends the legs one after
  the other, which push instances now take (the shape vLLM's push router sends, below);
- legs shaped as vLLM's push router sends them (vllm tests/v1/kv_connector/nixl_integration/
  toy_push_proxy_server.py: the prefill leg with `do_remote_decode` only, then the decode leg with only
  `remote_engine_id`, `remote_request_id`, `remote_host`, `remote_port`, `tp_size` from its answer) drive pdserve
  push instances, token-exact; a guessed key is refused.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_utils import PdserveProcess, ServerProcess, all_ready, free_port, make_model_dir, wait_idle

pytest.importorskip("nixl_cu12", reason="NIXL is not installed (pip install --no-deps nixl-cu12==1.5.1)")

from test_pd_e2e import long_prompt, start  # noqa: E402 - after the skip
from test_pd_push_e2e import _stream_text, labelled, metrics_of, pull_config, push_config  # noqa: E402

HEADERS = {"Authorization": "Bearer None"}
PREFILL_FIELDS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, pd_reference) -> Iterator[dict[str, ServerProcess]]:
    model_dir: Path = make_model_dir(tmp_path_factory.mktemp("mode-model"))
    logs = tmp_path_factory.mktemp("mode-logs")
    servers = {
        "push_prefill": start(model_dir, logs, "push_prefill", "--kv-transfer-config", push_config("kv_producer"),
                              "--side-channel-port", "0"),
        "push_decode": start(model_dir, logs, "push_decode", "--kv-transfer-config",
                             push_config("kv_consumer", push_registration_timeout=4.0)),
        "pull_prefill": start(model_dir, logs, "pull_prefill", "--kv-transfer-config", pull_config("kv_producer"),
                              "--side-channel-port", "0"),
        "pull_decode": start(model_dir, logs, "pull_decode", "--kv-transfer-config", pull_config("kv_consumer")),
    }
    with all_ready(servers):
        yield {**servers, "collocated": pd_reference.wait_ready(),  # conftest's, for the session
               "logs": logs}  # type: ignore[dict-item]


def proxy(fleet: dict, name: str, prefill: list[str], decode: list[str], *extra: str) -> PdserveProcess:
    port = free_port()
    args = ["proxy", "--host", "127.0.0.1", "--port", str(port), "--health-interval", "1"]
    for role, names in (("--prefill", prefill), ("--decode", decode)):
        for n in names:
            args += [role, fleet[n].url]
    return PdserveProcess(fleet["logs"] / f"proxy-{name}.log", port, [*args, *extra]).wait_ready()


def case(seed: int, words: int = 80, **kw) -> dict:
    return {"model": "tiny", "prompt": f"case {seed}: " + long_prompt(words, seed), "max_tokens": 8,
            "temperature": 0, **kw}


def answer(resp: httpx.Response, stream: bool) -> list[str]:
    assert resp.status_code == 200, resp.text
    return _stream_text(resp) if stream else [c["text"] for c in resp.json()["choices"]]


def exact(fleet: dict, url: str, b: dict) -> None:
    stream = bool(b.get("stream"))
    ref = httpx.post(f"{fleet['collocated'].url}/v1/completions", json=b, timeout=60)
    out = httpx.post(f"{url}/v1/completions", json=b, timeout=90, headers=HEADERS)
    assert answer(out, stream) == answer(ref, stream), b


def push_jobs_done(url: str) -> float:
    return labelled(metrics_of(url), "pdserve:kv_push_jobs_ended_total", '"done"')


def decode_legs(url: str) -> float:
    """Requests the instance finished (a decode leg each, in these tests)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics_of(url).splitlines()
               if line.startswith("vllm:request_success_total{"))


def settle(fleet: dict, *names: str) -> None:
    for n in names:
        wait_idle(fleet[n].url)


def test_push_fleet_is_driven_in_push_mode_without_a_flag(fleet):
    p = proxy(fleet, "push", ["push_prefill"], ["push_decode"])
    try:
        before = push_jobs_done(fleet["push_prefill"].url)
        for seed, stream in ((1, False), (2, True), (3, False)):
            exact(fleet, p.url, case(seed, stream=stream))
        exact(fleet, p.url, case(4, words=30, n=2))  # one push, forked into the n choices by the decode
        assert push_jobs_done(fleet["push_prefill"].url) - before == 4
        status = httpx.get(f"{p.url}/metrics", timeout=10).text
        assert 'pdserve_proxy_errors_total{kind="no_pair"} 0.0' in status
    finally:
        p.stop()
    settle(fleet, "push_prefill", "push_decode")


def test_mixed_fleet_pairs_each_mode_with_its_own(fleet):
    p = proxy(fleet, "mixed", ["push_prefill", "pull_prefill"], ["push_decode", "pull_decode"])
    try:
        legs = {n: decode_legs(fleet[n].url) for n in ("push_decode", "pull_decode")}
        pushes = push_jobs_done(fleet["push_prefill"].url)
        for seed in range(10, 16):
            exact(fleet, p.url, case(seed, stream=seed % 2 == 1))
        served = {n: decode_legs(fleet[n].url) - legs[n] for n in legs}
        pushed = push_jobs_done(fleet["push_prefill"].url) - pushes
        # both pairs served (ties rotate), and every push-decode leg was a push pair's
        assert served["push_decode"] > 0 and served["pull_decode"] > 0, served
        assert served["push_decode"] + served["pull_decode"] == 6
        assert pushed == served["push_decode"]
    finally:
        p.stop()
    settle(fleet, "push_prefill", "push_decode", "pull_prefill", "pull_decode")


def test_a_fleet_with_no_possible_pair_is_refused_naming_the_mismatch(fleet):
    p = proxy(fleet, "mismatch", ["push_prefill"], ["pull_decode"])
    try:
        out = httpx.post(f"{p.url}/v1/completions", json=case(20), timeout=60, headers=HEADERS)
        assert out.status_code == 502, out.text
        msg = out.json()["error"]["message"]
        assert "transfer mode" in msg and fleet["push_prefill"].url in msg and "(push pdserve)" in msg, msg
        assert fleet["pull_decode"].url in msg and "(pull pdserve)" in msg, msg
    finally:
        p.stop()


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_the_flag_still_overrides(fleet, mode):
    """`push`: pdserve's push pair as before. `pull` over push instances: the legs go one after the other (the
    prefill's answer handed to the decode), which push instances take as vLLM's router's legs: still exact."""
    p = proxy(fleet, f"override-{mode}", ["push_prefill"], ["push_decode"], "--kv-transfer-mode", mode)
    try:
        before = push_jobs_done(fleet["push_prefill"].url)
        exact(fleet, p.url, case(30 + (mode == "pull")))
        exact(fleet, p.url, case(32 + (mode == "pull"), stream=True))
        assert push_jobs_done(fleet["push_prefill"].url) - before == 2
    finally:
        p.stop()
    settle(fleet, "push_prefill", "push_decode")


def vllm_router_legs(prefill: str, decode: str, b: dict, rid: str) -> tuple[dict, httpx.Response]:
    """The two legs as vLLM's toy push router sends them (see the module docstring)."""
    pb = {**b, "stream": False, "max_tokens": 1,
          "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                 "remote_block_ids": None, "remote_host": None, "remote_port": None}}
    headers = {"X-Request-Id": rid, **HEADERS}
    pout = httpx.post(f"{prefill}/v1/completions", json=pb, timeout=60, headers=headers)
    assert pout.status_code == 200, pout.text
    kv = pout.json()["kv_transfer_params"]
    db = {**b, "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                                      **{k: kv.get(k) for k in PREFILL_FIELDS}}}
    return kv, httpx.post(f"{decode}/v1/completions", json=db, timeout=90, headers=headers)


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_router_shaped_legs_drive_pdserve_push_instances(fleet, stream):
    b = case(40 + stream, stream=stream)
    ref = httpx.post(f"{fleet['collocated'].url}/v1/completions", json=b, timeout=60)
    before = push_jobs_done(fleet["push_prefill"].url)
    kv, out = vllm_router_legs(fleet["push_prefill"].url, fleet["push_decode"].url, b, f"vllm-shape-{stream}")
    # vLLM's push answer shape (push_scheduler.request_finished, with vllm#50620's transfer_mode), no lease token
    assert kv["transfer_mode"] == "push" and kv["do_remote_prefill"] is True and "remote_lease_token" not in kv
    assert answer(out, stream) == answer(ref, stream)
    assert push_jobs_done(fleet["push_prefill"].url) - before == 1
    settle(fleet, "push_prefill", "push_decode")


def test_a_guessed_key_gets_no_kv(fleet):
    """The minted key is the capability (as the lease token is in pull mode): a decode leg naming the prefill
    with another key registers for nothing, and fails at its registration timeout, not with wrong KV."""
    b = case(45)
    pb = {**b, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    kv = httpx.post(f"{fleet['push_prefill'].url}/v1/completions", json=pb, timeout=60,
                    headers=HEADERS).json()["kv_transfer_params"]
    forged = {**{k: kv[k] for k in PREFILL_FIELDS}, "remote_request_id": "0" * 32, "do_remote_prefill": True}
    out = httpx.post(f"{fleet['push_decode'].url}/v1/completions", json={**b, "kv_transfer_params": forged},
                     timeout=90, headers=HEADERS)
    assert out.status_code >= 400, out.text
    # the real key still works after that (nothing was written under it)
    real = {**{k: kv[k] for k in PREFILL_FIELDS}, "do_remote_prefill": True}
    out = httpx.post(f"{fleet['push_decode'].url}/v1/completions", json={**b, "kv_transfer_params": real},
                     timeout=90, headers=HEADERS)
    ref = httpx.post(f"{fleet['collocated'].url}/v1/completions", json=b, timeout=60)
    assert answer(out, False) == answer(ref, False)
    settle(fleet, "push_prefill", "push_decode")


def test_decode_leg_with_a_pull_lease_is_still_refused_naming_the_mode(fleet):
    """Pull params (a lease token, no transfer_mode) given to a push decode: a 400 naming both modes."""
    params = {"do_remote_prefill": True, "remote_engine_id": "x", "remote_block_ids": [1], "remote_host": "h",
              "remote_port": 1, "remote_request_id": "r" * 20, "remote_lease_token": "t"}
    out = httpx.post(f"{fleet['push_decode'].url}/v1/completions",
                     json={**case(46), "kv_transfer_params": params}, timeout=30, headers=HEADERS)
    assert out.status_code == 400 and "NixlPushConnector" in out.text and "'pull'" in out.text, out.text
    json.loads(out.text)
