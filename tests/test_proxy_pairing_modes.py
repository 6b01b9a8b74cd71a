"""The proxy's pairing by transfer mode (pdserve/proxy/instance_info.py, pairing.py), fast, no processes: what
/pdserve/info and vLLM's `transfer_mode` param (vllm-project/vllm#50620) teach, which pairs form, the error that
names a mismatch; and the push legs of vLLM's router's shape (a minted key answered as `remote_request_id`)."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.api import pd
from pdserve.proxy.config import ProxyConfig
from pdserve.proxy.instance_info import apply_info, learn_from_params, pairs
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.pairing import PairChooser
from pdserve.proxy.pool import Instance, Pool
from pdserve.proxy.readiness import Readiness


def pdserve_info(mode: str | None, port: int = 5600) -> dict:
    return {"kv_transfer_mode": mode, "kv_params_later": True, "engine_id": "e", "side_channel_host": "10.0.0.9",
            "side_channel_port": port, "tensor_parallel_size": 1}


def instance(url: str, role: str, mode: str | None, *, pdserve: bool = True) -> Instance:
    inst = Instance(url=url, role=role, healthy=True)
    apply_info(inst, pdserve_info(mode) if pdserve else None)
    if not pdserve and mode is not None:
        learn_from_params(inst, {"transfer_mode": mode})
    return inst


def test_info_and_params_teach_the_mode() -> None:
    p = instance("http://a:1", "prefill", "push")
    assert (p.pdserve, p.transfer_mode, p.params_later) == (True, "push", True)
    assert p.push_info == {"engine_id": "e", "host": "10.0.0.9", "port": 5600, "tp_size": 1}
    learn_from_params(p, {"transfer_mode": "pull"})  # /pdserve/info wins for a pdserve instance
    assert p.transfer_mode == "push"
    v = Instance(url="http://v:1", role="prefill", healthy=True)
    apply_info(v, None)  # no /pdserve/info: vLLM's
    assert (v.pdserve, v.transfer_mode) == (False, None)
    learn_from_params(v, {"transfer_mode": "push"})  # vllm#50620's field in its answer
    assert v.transfer_mode == "push"
    learn_from_params(v, {"transfer_mode": "sideways"})  # not a mode: ignored
    assert v.transfer_mode == "push"


@pytest.mark.parametrize(("p", "d", "override", "ok"), [
    (("push", True), ("push", True), None, True),
    (("pull", True), ("pull", True), None, True),
    (("push", True), ("pull", True), None, False),
    (("pull", True), ("push", True), None, False),
    (("push", True), ("pull", True), "push", True),  # the flag overrides what was learnt
    (("push", False), (None, False), None, True),  # a vLLM decode never says: it pairs
    (("push", True), (None, False), None, False),  # push across engines: pdserve's and vLLM's registrations differ
    (("pull", True), (None, False), None, True),  # pull across engines: NIXL READ, as before
    ((None, True), ("push", True), None, True),  # unknown (no connector info yet) pairs with anything
])
def test_which_pairs_form(p, d, override, ok) -> None:
    prefill = instance("http://p:1", "prefill", p[0], pdserve=p[1])
    decode = instance("http://d:1", "decode", d[0], pdserve=d[1])
    assert pairs(prefill, decode, override) is ok


def chooser(prefill: list[Instance], decode: list[Instance], override: str | None = None) -> PairChooser:
    cfg = ProxyConfig(prefill=[i.url for i in prefill], decode=[i.url for i in decode], kv_transfer_mode=override)
    pools = []
    for role, insts in (("prefill", prefill), ("decode", decode)):
        pool = Pool(role)
        for inst in insts:  # the test's instances, with what they taught
            pool.adopt(inst)
        pools.append(pool)
    return PairChooser(cfg, pools[0], pools[1], ProxyMetrics(lambda: pools), Readiness(), lambda: None, None)


def test_a_mixed_fleet_pairs_each_mode_with_its_own() -> None:
    pp, pl = instance("http://pp:1", "prefill", "push"), instance("http://pl:1", "prefill", "pull")
    dp, dl = instance("http://dp:1", "decode", "push"), instance("http://dl:1", "decode", "pull")
    c = chooser([pp, pl], [dp, dl])
    assert c.mismatch() is None

    async def pair() -> tuple[Instance, Instance]:
        p = await c.prefill(wait=False)
        assert p is not None
        d = await c.decode(wait=False, pair_with=p)
        assert d is not None
        return p, d

    seen = {asyncio.run(pair()) for _ in range(6)}
    assert seen == {(pp, dp), (pl, dl)}  # both pairs used, never a cross pair
    assert c.concurrent_push(pp) and not c.concurrent_push(pl)
    # a retry stays in the first attempt's mode
    assert asyncio.run(c.prefill([pl], wait=False, like=pl)) is None


def test_a_fleet_with_no_pair_names_the_mismatch() -> None:
    c = chooser([instance("http://pp:1", "prefill", "push")], [instance("http://dl:1", "decode", "pull")])
    msg = c.mismatch()
    assert msg is not None
    assert "http://pp:1 (push pdserve)" in msg and "http://dl:1 (pull pdserve)" in msg and "transfer mode" in msg
    assert asyncio.run(c.prefill(wait=False)) is None  # never chosen
    assert chooser([instance("http://pp:1", "prefill", "push")], [instance("http://dl:1", "decode", "pull")],
                   override="push").mismatch() is None


def test_vllm_push_instances_get_sequential_legs() -> None:
    c = chooser([instance("http://v:1", "prefill", "push", pdserve=False)],
                [instance("http://w:1", "decode", None, pdserve=False)])
    assert c.mismatch() is None and not c.concurrent_push(c._prefill.instances[0])


def test_a_key_less_prefill_leg_is_minted_a_key_the_answer_carries() -> None:
    """vLLM's push router sends `do_remote_decode` only, then forwards only the coordinates: the key minted for
    the leg comes back as `push_key` and `remote_request_id`, and a decode leg holding only the coordinates
    parses to that key."""
    p = pd.parse_push_prefill_params(pd.prefill_leg_params())
    assert p.minted and len(p.push_key) == 32
    assert pd.parse_push_prefill_params(pd.push_prefill_params("k" * 32)) == pd.PushParams("k" * 32)
    held = pd.HeldKVParams(request_id="cmpl-1", block_ids=(1, 2), num_tokens=20, engine_id="e", host="h", port=7,
                           generation=1, expires_at=0.0, push=True, push_key=p.push_key).to_json()
    assert held["transfer_mode"] == "push" and held["remote_request_id"] == held["push_key"] == p.push_key
    assert pd.LEASE_TOKEN not in held and p.push_key not in repr(p)
    router_leg = {"do_remote_prefill": True, "do_remote_decode": False,
                  **{k: held[k] for k in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port",
                                          "tp_size")}}
    parsed = pd.parse_push_decode_params(router_leg)
    assert (parsed.push_key, parsed.address, parsed.remote_engine_id) == (p.push_key, ("h", 7), "e")
    with pytest.raises(pd.InvalidKVTransferParams, match="remote_request_id"):
        pd.parse_push_decode_params({**router_leg, "remote_request_id": "short"})
