"""Push transfer's contract and configuration (fast, no processes): the params of each leg, the pairing
refusals that name the mode, `pdserve up --kv-transfer-mode push`."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from pdserve.api import pd
from pdserve.launch.config import LaunchConfig, parse_topology
from pdserve.launch.spec import build_deployment

KEY = "k" * 32


def test_push_legs_params() -> None:
    prefill = pd.build_prefill_body({"prompt": "x", "max_tokens": 9, "n": 2}, push_key=KEY)
    assert prefill["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                             "transfer_mode": "push", "push_key": KEY}
    assert prefill["max_tokens"] == 1 and prefill["n"] == 1
    assert pd.parse_push_prefill_params(prefill["kv_transfer_params"]).push_key == KEY
    decode = pd.push_decode_params(KEY, engine_id="e", host="10.0.0.1", port=5600)
    p = pd.parse_push_decode_params(decode)
    assert (p.remote_engine_id, p.address, p.tp_size, p.push_key) == ("e", ("10.0.0.1", 5600), 1, KEY)


@pytest.mark.parametrize(("change", "message"), [
    ({"transfer_mode": "pull"}, "NixlPushConnector"),  # pull params: the mode is named
    ({"push_key": "short"}, "push_key must be a string"),
    ({"remote_port": 0}, "remote_port"),
    ({"remote_engine_id": ""}, "remote_engine_id"),
    ({"tp_size": 0}, "tp_size must be a positive integer"),
])
def test_push_decode_params_refusals_name_the_problem(change: dict, message: str) -> None:
    params = {**pd.push_decode_params(KEY, engine_id="e", host="h", port=1), **change}
    params = {k: v for k, v in params.items() if v is not None}
    with pytest.raises(pd.InvalidKVTransferParams, match=message):
        pd.parse_push_decode_params(params)


def test_push_decode_params_carry_a_tensor_parallel_prefills_size() -> None:
    """A TP prefill WRITEs from each of its ranks: its size travels (the decode checks it at the handshake)."""
    p = pd.parse_push_decode_params(pd.push_decode_params(KEY, engine_id="e", host="h", port=1, tp_size=4))
    assert p.tp_size == 4


def test_a_pull_decode_refuses_push_params_naming_the_mode() -> None:
    with pytest.raises(pd.InvalidKVTransferParams, match="NixlConnector.*'push'"):
        pd.refuse_push_params(pd.push_decode_params(KEY, engine_id="e", host="h", port=1))
    pd.refuse_push_params({"do_remote_prefill": True})  # pull params pass


def test_a_decode_legs_params_are_parsed_once_for_the_instances_mode() -> None:
    """`KVTransferParams.parse_load`, the one parse of a decode leg's params (a consumer role's `parse`): push
    params give `PushParams` (with the first token they carry) to a push instance and a 400 naming the mode to a
    pull one; a held prefix is a pull instance's only."""
    push = pd.KVTransferParams.read({**pd.push_decode_params(KEY, engine_id="e", host="h", port=1),
                                     **pd.first_token_fields(pd.FirstToken(7))})
    assert push.remote_prefill and push.push and not push.prefix
    parsed = push.parse_load(push=True)
    assert isinstance(parsed, pd.PushParams) and parsed.first_token == pd.FirstToken(7)
    with pytest.raises(pd.InvalidKVTransferParams, match="NixlConnector.*'push'"):
        push.parse_load(push=False)
    prefix = pd.KVTransferParams.read({"do_remote_decode": True, "remote_block_ids": [[1]]})
    assert prefix.prefix and not prefix.remote_prefill
    with pytest.raises(pd.InvalidKVTransferParams, match="held prefix.*NixlPushConnector"):
        prefix.parse_load(push=True)
    assert pd.KVTransferParams.read(None) == pd.KVTransferParams()


def test_up_push_mode_configures_both_pools_and_the_proxy() -> None:
    cfg = LaunchConfig(model="m", gpus="none", log_dir=Path("logs"), kv_transfer_mode="push").validate()
    dep = build_deployment(cfg, cpus=[0, 1], env={})
    for inst in dep.instances:
        kv = json.loads(inst.argv[inst.argv.index("--kv-transfer-config") + 1])
        assert kv["kv_connector"] == "NixlPushConnector"
    assert "--kv-transfer-mode" not in dep.proxy.argv  # the proxy learns each instance's mode
    vllm = LaunchConfig(model="m", gpus="none", log_dir=Path("logs"), kv_transfer_mode="push", engine="vllm",
                        topology=parse_topology("1p1d")).validate()  # driven with sequential legs, as vLLM's router
    for inst in build_deployment(vllm, cpus=[0, 1], env={}).instances:
        kv = json.loads(inst.argv[inst.argv.index("--kv-transfer-config") + 1])
        assert kv["kv_connector"] == "NixlPushConnector"


@pytest.mark.parametrize(("kw", "message"), [
    ({"engine": "vllm", "kv_history": True}, "needs pdserve instances"),
    ({"kv_transfer_mode": "both"}, "must be pull or push"),
])
def test_up_push_mode_refuses_what_it_cannot_do(kw: dict, message: str) -> None:
    cfg = LaunchConfig(model="m", gpus="none", topology=parse_topology("1p1d"), log_dir=Path("logs"),
                       **{"kv_transfer_mode": "push", **kw})
    with pytest.raises(ValueError, match=message):
        cfg.validate()


def test_a_registration_whose_sealed_metadata_fails_its_tag_is_refused_as_bad_seal() -> None:
    """The decode's agent metadata arrives sealed (ChaCha20-Poly1305): one altered byte, or metadata sealed for
    another registration, is the sender's fault (`bad_seal`), and no remote agent is added for it."""
    from pdserve.kv_transfer.auth import MessageAuth
    from pdserve.kv_transfer.errors import SideChannelRefused
    from pdserve.kv_transfer.messages import PushRegister
    from pdserve.kv_transfer.pool import PoolRegion
    from pdserve.kv_transfer.push_sender import PushSender

    auth = MessageAuth("deployment-secret")
    region = PoolRegion(base_addr=4096, length=8 * 512, num_blocks=8, block_bytes=512, mem_type="DRAM",
                        device_id=0, shape=(8, 2, 256), dtype="float32")

    class NoAgent:  # an agent the refusal must never reach
        def add_remote(self, metadata: bytes, name: str) -> None:
            raise AssertionError("a remote agent was added from metadata that failed its tag")

    sender = PushSender(agent=NoAgent(), region=region, num_layers=2, block_size=16, layerwise=True,  # type: ignore[arg-type]
                        transfer_timeout_s=5.0, lease_duration_s=30.0, release_lease=lambda *_: None, auth=auth)
    nonce = b"n" * 16
    sealed = auth.conceal(b"agent metadata", nonce, 3)
    msg = PushRegister(pool=region.describe(), block_ids=(0, 1), first_block=0, num_tokens=20, engine_id="decode",
                       agent_name="decode-agent", agent_metadata=sealed, push_key=KEY, timeout_s=5.0, seal_nonce=nonce,
                       generation=3)
    try:
        for bad in ({"agent_metadata": sealed[:-1] + bytes([sealed[-1] ^ 1])},  # altered
                    {"generation": 4},  # sealed for another registration
                    {"seal_nonce": b"m" * 16}):
            with pytest.raises(SideChannelRefused) as err:
                sender.handle(msgspec.structs.replace(msg, **bad))
            assert err.value.reason == "bad_seal"
    finally:
        sender.shutdown()


def test_up_push_mode_with_tensor_parallelism() -> None:
    """`pdserve up --kv-transfer-mode push --tensor-parallel-size 2` (vLLM's flag, every instance) or per role
    (`--decode-tp 1` overrides it): NixlPushConnector on both pools, each instance at its TP size."""
    import argparse

    from pdserve.launch.cli import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for argv, want in ((["--tensor-parallel-size", "2"], ("2", "2")), (["-tp", "2", "--decode-tp", "1"], ("2", None)),
                       (["--prefill-tp", "2"], ("2", None))):
        cfg = config_from_args(parser.parse_args(["m", "--gpus", "none", "--kv-transfer-mode", "push", *argv]))
        dep = build_deployment(cfg.validate(), cpus=[0, 1, 2, 3], env={})
        got = []
        for inst in dep.instances:
            kv = json.loads(inst.argv[inst.argv.index("--kv-transfer-config") + 1])
            assert kv["kv_connector"] == "NixlPushConnector"
            got.append(inst.argv[inst.argv.index("--tensor-parallel-size") + 1]
                       if "--tensor-parallel-size" in inst.argv else None)
        assert tuple(got) == want, argv


def test_up_push_mode_with_history_gives_each_pool_its_role() -> None:
    """`pdserve up --kv-transfer-mode push --kv-history`: push decode instances keep the conversations
    (kv_consumer), push prefill instances read them back (kv_producer); never kv_both, which push refuses."""
    cfg = LaunchConfig(model="m", gpus="none", log_dir=Path("logs"), kv_transfer_mode="push", kv_history=True,
                       topology=parse_topology("1p1d")).validate()
    roles = {}
    for inst in build_deployment(cfg, cpus=[0, 1], env={}).instances:
        kv = json.loads(inst.argv[inst.argv.index("--kv-transfer-config") + 1])
        assert kv["kv_connector"] == "NixlPushConnector"
        assert kv["kv_connector_extra_config"]["bidirectional_kv_xfer"] is True
        roles[inst.role] = kv["kv_role"]
    assert roles == {"prefill": "kv_producer", "decode": "kv_consumer"}


def test_completion_notice_carries_the_first_token_and_reads_back():
    from pdserve.api.pd import FirstToken
    from pdserve.kv_transfer.push_sender import completion_notif, parse_completion_notif

    first = FirstToken(17, -0.25, 1, ((17, -0.25), (3, -2.0)))
    assert parse_completion_notif(completion_notif("k" * 32, first)) == ("k" * 32, first)
    assert parse_completion_notif(completion_notif("k" * 32, None)) == ("k" * 32, None)
    # a bare key (a sender without the token) and a malformed token read as no token, never a guess
    assert parse_completion_notif(b"pdserve-push:" + b"k" * 32) == ("k" * 32, None)
    assert parse_completion_notif(b'pdserve-push:{"push_key":"kk","first_token_id":-1}') == ("kk", None)
    assert parse_completion_notif(b"pdserve-lease:x") is None


def test_a_push_decode_leg_registers_the_whole_prompt_unless_it_takes_no_first_token():
    from pdserve.engine.pd.kv_handoff import KVHandoff

    params = pd.push_decode_params("k" * 32, engine_id="e", host="127.0.0.1", port=5)
    kv = KVHandoff(remote=pd.parse_push_decode_params(params))
    assert kv.load_tokens(100) == 100  # the push may bring the first token: the last position comes too
    kv = KVHandoff(remote=pd.parse_push_decode_params(pd.without_first_token(params)))
    assert kv.load_tokens(100) == 99  # recomputed here
    with pytest.raises(pd.InvalidKVTransferParams, match="push_first_token"):
        pd.parse_push_decode_params({**params, pd.PUSH_FIRST_TOKEN: "no"})


def test_push_pipeline_auto_is_layer_by_layer_on_cpu_pools_and_whole_request_on_gpu_pools():
    from pdserve.kv_transfer.config import KVTransferConfig, push_layer_by_layer

    cfg = KVTransferConfig.from_json('{"kv_connector":"NixlPushConnector","kv_role":"kv_producer"}')
    assert cfg.push_pipeline == "auto"
    assert push_layer_by_layer("auto", "DRAM") and not push_layer_by_layer("auto", "VRAM")
    assert push_layer_by_layer("layer", "VRAM") and not push_layer_by_layer("request", "DRAM")
