"""`pdserve up --ray` before Ray: flags -> LaunchConfig + RayOptions -> instance specs, their Ray bundles and
command lines, the proxy's settings, `--from-plan`. No cluster needed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pdserve.launch import cli as up_cli
from pdserve.launch import ray_cli
from pdserve.launch.ray_spec import (
    RayAppSpec,
    RayOptions,
    build_app_spec,
    instance_name,
    instance_prefix,
    parse_resources,
    tensor_parallel_size,
)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    up_cli.add_arguments(parser)
    return parser.parse_args(argv)


def _spec(argv: list[str], gpus: float = 0.0) -> RayAppSpec:
    args = _parse(argv)
    cfg = up_cli.config_from_args(args)
    opts = ray_cli.options_from_args(args, cfg)
    return build_app_spec(cfg, opts, model="/models/m", cluster_gpus=gpus, proxy={"port": 1}, proxy_node_id="n0")


def test_1p1d_cpu_specs_and_command_lines() -> None:
    spec = _spec(["--ray", "--topology", "1p1d", "--prefill-resources", '{"prefill_node": 1}',
                  "--decode-resources", '{"decode_node": 1}', "--cpus-per-instance", "2",
                  "--serve-arg=--max-model-len 512", "--decode-arg=--block-size 8",
                  "--kv-load-failure-policy", "recompute"])
    p, d = spec.instances
    assert (p.role, d.role) == ("prefill", "decode")
    assert p.bundle() == {"CPU": 2.0, "prefill_node": 1.0} and d.bundle() == {"CPU": 2.0, "decode_node": 1.0}
    assert p.num_gpus == 0 and p.env["OMP_NUM_THREADS"] == "2"
    argv = d.serve_argv("/py", "10.0.0.2", 8200, "10.0.0.2")
    assert argv[:5] == ["/py", "-m", "pdserve", "serve", "/models/m"]
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv == {"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute"}
    assert argv[-8:] == ["--host", "10.0.0.2", "--port", "8200", "--side-channel-host", "10.0.0.2",
                         "--side-channel-port", "0"]
    assert "--block-size" in argv and "--block-size" not in p.base_argv
    assert spec.autoscale is None and spec.app == "default" and spec.namespace == "pdserve"
    assert RayAppSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    # one KV side-channel secret per deployment, by environment (never argv), for scaled-up instances too
    secret = p.env["PDSERVE_KV_SECRET"]
    assert len(secret) == 64 and d.env["PDSERVE_KV_SECRET"] == secret
    assert spec.templates["decode"].env["PDSERVE_KV_SECRET"] == secret and secret not in " ".join(argv)
    assert _spec(["--ray"]).instances[0].env["PDSERVE_KV_SECRET"] != secret


def test_collocated_and_gpu_bundles() -> None:
    spec = _spec(["--ray", "--topology", "collocated:2"], gpus=8)
    assert [i.role for i in spec.instances] == ["collocated", "collocated"]
    assert spec.instances[0].bundle() == {"CPU": 1.0, "GPU": 1.0}
    assert "--side-channel-host" not in spec.instances[0].serve_argv("/py", "h", 1, "h")
    assert "PDSERVE_KV_SECRET" not in spec.instances[0].env  # no KV transfer, no secret
    spec = _spec(["--ray", "--prefill-arg=--tensor-parallel-size 2", "--gpus-per-instance", "1"], gpus=8)
    assert spec.templates["prefill"].num_gpus == 2 and spec.templates["decode"].num_gpus == 1
    assert spec.templates["decode"].env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "y"
    half = _spec(["--ray", "--gpus-per-instance", "0.5"], gpus=1).templates["decode"]
    assert half.bundle()["GPU"] == 0.5
    assert half.base_argv[-2:] == ["--gpu-memory-utilization", "0.45"]
    with pytest.raises(ValueError, match="fractional"):
        _spec(["--ray", "--gpus-per-instance", "0.5", "--decode-arg=-tp 2"], gpus=4)


@pytest.mark.parametrize(("argv", "message"), [
    (["--ray", "--topology", "collocated:2", "--autoscale"], "P/D topology"),
    (["--ray", "--engine", "vllm"], "pdserve instances only"),
    (["--ray", "--prefill-resources", '{"GPU": 1}'], "gpus-per-instance"),
    (["--ray", "--prefill-resources", "[1]"], "JSON object"),
    (["--ray", "--app-name", "a/b"], "app-name"),
    (["--ray", "--topology", "2p1d", "--autoscale", "--max-prefill", "1"], "outside"),
])
def test_rejected(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _spec(argv)


def test_autoscale_options() -> None:
    spec = _spec(["--ray", "--topology", "1p2d", "--autoscale", "--max-decode", "5", "--itl-slo-ms", "40",
                  "--target-ongoing-decode", "16", "--upscale-delay", "3", "--no-role-switch"])
    a = spec.autoscale
    assert a is not None
    assert a["decode"] == {"min_replicas": 1, "max_replicas": 5, "target_ongoing": 16.0, "latency_slo_s": 0.04}
    assert a["prefill"]["max_replicas"] == 2  # default: twice the topology's
    assert a["upscale_delay_s"] == 3 and a["allow_role_switch"] is False


def test_names_and_tp_and_resources() -> None:
    assert instance_name("app", 3) == "app/inst-3" and instance_name("app", 3).startswith(instance_prefix("app"))
    assert tensor_parallel_size(["--x", "-tp", "4"]) == 4
    assert tensor_parallel_size(["--tensor-parallel-size=2"]) == 2
    assert tensor_parallel_size([]) == 1
    with pytest.raises(ValueError):
        tensor_parallel_size(["-tp", "0"])
    assert parse_resources('{"a": 1, "b": 0.5}', "x") == {"a": 1.0, "b": 0.5}
    with pytest.raises(ValueError):
        RayOptions(max_restarts=-2).validate()


def test_proxy_settings_from_proxy_args() -> None:
    cfg = up_cli.config_from_args(_parse(["--ray", "--proxy-arg=--eject-after 5 --prefix-affinity", "--port", "0"]))
    values = ray_cli._proxy_settings(cfg, "127.0.0.1")
    assert values["eject_after"] == 5 and values["prefix_affinity"] is True
    assert values["host"] == "127.0.0.1" and values["port"] > 0 and values["decode"] == []
    cfg = up_cli.config_from_args(_parse(["--ray", "--proxy-arg=--port 9000"]))
    with pytest.raises(ValueError, match="--port"):
        ray_cli._proxy_settings(cfg, "127.0.0.1")


def test_from_plan(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"ratio": {"topology": "3p2d"}}))
    assert ray_cli.topology_from_plan(str(plan)) == "3p2d"
    plan.write_text(json.dumps({"shape": {}}))
    with pytest.raises(ValueError, match="ratio.topology"):
        ray_cli.topology_from_plan(str(plan))


def test_relative_model_keeps_its_served_name() -> None:
    args = _parse(["./m", "--ray"])
    cfg = up_cli.config_from_args(args)
    spec = build_app_spec(cfg, ray_cli.options_from_args(args, cfg), model="/abs/m", cluster_gpus=0, proxy={},
                          proxy_node_id="n0", served_model_name="./m")
    argv = spec.templates["decode"].base_argv
    assert argv[3] == "/abs/m" and argv[argv.index("--served-model-name") + 1] == "./m"


def test_proxy_prefills_locally_while_no_prefill_is_up_unless_told() -> None:
    cfg = up_cli.config_from_args(_parse(["--ray", "--port", "0"]))
    assert ray_cli._proxy_settings(cfg, "127.0.0.1")["on_prefill_failure"] == "decode-local"
    cfg = up_cli.config_from_args(_parse(["--ray", "--port", "0", "--proxy-arg=--on-prefill-failure fail"]))
    assert ray_cli._proxy_settings(cfg, "127.0.0.1")["on_prefill_failure"] == "fail"
    cfg = up_cli.config_from_args(_parse(["--ray", "--port", "0", "--topology", "collocated:1"]))
    assert ray_cli._proxy_settings(cfg, "127.0.0.1")["on_prefill_failure"] == "retry"
