"""`pdserve up` without processes: topology grammar, config files, deployment specs, --dry-run output."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.launch.config import LaunchConfig, apply_file, load_file, parse_topology
from pdserve.launch.spec import build_deployment, cpu_list, split_cpus


@pytest.mark.parametrize(
    ("text", "p", "d", "c"),
    [("1p1d", 1, 1, 0), ("2P1D", 1 * 2, 1, 0), ("3p2d", 3, 2, 0), ("collocated", 0, 0, 1), ("collocated:4", 0, 0, 4)],
)
def test_parse_topology(text: str, p: int, d: int, c: int) -> None:
    t = parse_topology(text)
    assert (t.num_prefill, t.num_decode, t.num_collocated) == (p, d, c)
    assert parse_topology(str(t)) == t


@pytest.mark.parametrize("text", ["0p1d", "1p0d", "collocated:0", "pd", "2x2", ""])
def test_parse_topology_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_topology(text)


def test_split_cpus() -> None:
    assert split_cpus([0, 1], 2) == [[0], [1]]
    assert split_cpus(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_cpus([0, 1], 3) == [[0], [1], [0]]  # fewer cores than instances: shared round-robin
    assert cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def _flat(shares: list[list[int]]) -> list[int]:
    return [c for s in shares for c in s]


def test_1p1d_cpu_deployment() -> None:
    cfg = LaunchConfig(model="m", gpus="none", log_dir=Path("logs")).validate()
    dep = build_deployment(cfg, cpus=[0, 1, 2, 3], env={})
    assert dep.device == "cpu" and [s.name for s in dep.instances] == ["prefill", "decode"]
    prefill, decode = dep.instances
    ports = [prefill.port, decode.port, prefill.side_channel_port, decode.side_channel_port, dep.proxy.port]
    assert len(set(ports)) == 5 and all(ports)
    assert prefill.cpus == [0, 1] and decode.cpus == [2, 3]
    assert prefill.env["OMP_NUM_THREADS"] == "2" and "CUDA_VISIBLE_DEVICES" not in prefill.env
    kv = json.loads(prefill.argv[prefill.argv.index("--kv-transfer-config") + 1])
    assert kv == {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_load_failure_policy": "fail"}
    kv = json.loads(decode.argv[decode.argv.index("--kv-transfer-config") + 1])
    assert kv["kv_role"] == "kv_consumer"
    assert decode.argv[decode.argv.index("--side-channel-port") + 1] == str(decode.side_channel_port)
    assert decode.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(decode.side_channel_port)
    assert prefill.argv[1:5] == ["-m", "pdserve", "serve", "m"]
    assert prefill.log_path == Path("logs/prefill.log") and dep.proxy.log_path == Path("logs/proxy.log")
    argv = dep.proxy.argv
    assert argv[argv.index("--prefill") + 1] == prefill.url and argv[argv.index("--decode") + 1] == decode.url
    # a KV side-channel secret is made at start (by environment, never argv), unless the user has their own
    assert dep.kv_secret and not any("SECRET" in a for s in dep.instances for a in s.argv)
    assert not build_deployment(cfg, cpus=[0, 1, 2, 3], env={"PDSERVE_KV_SECRET": "x" * 32}).kv_secret


def test_kv_history_events_and_offloading_flags() -> None:
    """`pdserve up --kv-history --kv-events --kv-offloading-size`: what each instance is started with."""
    import argparse

    from pdserve.launch.cli import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = config_from_args(parser.parse_args(["m", "--gpus", "none", "--kv-history", "--kv-events",
                                              "--kv-offloading-size", "0.5"]))
    dep = build_deployment(cfg, cpus=[0, 1], env={})
    for inst in dep.instances:
        kv = json.loads(inst.argv[inst.argv.index("--kv-transfer-config") + 1])
        assert kv["kv_connector_extra_config"] == {"bidirectional_kv_xfer": True}, inst.name
        events = json.loads(inst.argv[inst.argv.index("--kv-events-config") + 1])
        assert events["enable_kv_cache_events"] and events["endpoint"] == "tcp://127.0.0.1:*"
        assert inst.argv[inst.argv.index("--kv-offloading-size") + 1] == "0.5"
        assert inst.argv[inst.argv.index("--kv-offloading-backend") + 1] == "native"
    # a user's own events config wins; without the flags nothing is added
    own = config_from_args(parser.parse_args(["m", "--gpus", "none", "--kv-events",
                                              "--serve-arg=--kv-events-config {}"]))
    assert all(s.argv.count("--kv-events-config") == 1 for s in build_deployment(own, cpus=[0, 1], env={}).instances)
    plain = build_deployment(config_from_args(parser.parse_args(["m", "--gpus", "none"])), cpus=[0, 1], env={})
    assert not any("--kv-events-config" in s.argv or "bidirectional" in " ".join(s.argv) for s in plain.instances)
    # by default, events (and so routing by cached prefix) wherever a role has a choice of instances

    def publishing(*words: str) -> list[str]:
        dep = build_deployment(config_from_args(parser.parse_args(["m", "--gpus", "none", *words])), cpus=[0, 1],
                               env={})
        return [s.name for s in dep.instances if "--kv-events-config" in s.argv]

    assert publishing("--topology", "collocated:2") == ["collocated-0", "collocated-1"]
    assert publishing("--topology", "2p1d") == ["prefill-0", "prefill-1"]
    assert publishing("--topology", "collocated:2", "--no-kv-events") == []
    with pytest.raises(ValueError, match="kv-history"):
        config_from_args(parser.parse_args(["m", "--topology", "collocated:1", "--kv-history"]))
    with pytest.raises(ValueError, match="kv-offloading-size"):
        config_from_args(parser.parse_args(["m", "--kv-offloading-size", "0"]))


def test_xpyd_gpu_round_robin_and_vllm_engine() -> None:
    cfg = LaunchConfig(model="Qwen/Qwen2.5-7B-Instruct", topology=parse_topology("2p2d"), engine="vllm")
    dep = build_deployment(cfg, gpus=["0", "1", "2"], env={})
    assert [s.name for s in dep.instances] == ["prefill-0", "prefill-1", "decode-0", "decode-1"]
    assert [s.gpu for s in dep.instances] == ["0", "1", "2", "0"]
    assert len({s.side_channel_port for s in dep.instances}) == 4
    for s in dep.instances:
        assert s.argv[:3] == ["vllm", "serve", "Qwen/Qwen2.5-7B-Instruct"] and "--side-channel-port" not in s.argv
        assert s.env["CUDA_VISIBLE_DEVICES"] == s.gpu and s.env["UCX_NET_DEVICES"] == "all"
        assert s.env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "y" and s.cpus is None
        assert s.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(s.side_channel_port)
    # the user's own UCX setting is not overridden
    dep = build_deployment(cfg, gpus=["0"], env={"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"})
    assert all("UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in s.env for s in dep.instances)


def test_collocated_has_no_kv_config_and_proxy_in_collocated_mode() -> None:
    cfg = LaunchConfig(model="m", topology=parse_topology("collocated:2"), gpus="none", cpu_pinning=False)
    dep = build_deployment(cfg, env={})
    assert [s.name for s in dep.instances] == ["collocated-0", "collocated-1"]
    assert not dep.kv_secret  # no KV transfer, no side channel
    for s in dep.instances:
        assert "--kv-transfer-config" not in s.argv and s.side_channel_port is None and s.cpus is None
    assert "--prefill" not in dep.proxy.argv
    assert dep.proxy.argv[dep.proxy.argv.index("--decode") + 1 :] == [s.url for s in dep.instances]


def test_config_file_yaml_and_toml_and_flags_win(tmp_path: Path) -> None:
    yaml_file = tmp_path / "deploy.yaml"
    yaml_file.write_text(
        "model: ./tiny\ntopology: 2p1d\ngpus: none\nlog-dir: out\nserve_args: --block-size 8\n"
        "prefill:\n  serve_args: [--max-num-seqs, '4']\n  ports: [18100, 18101]\n  env: {MY_VAR: x}\n"
        "decode:\n  side_channel_ports: [18600]\nproxy:\n  args: [--prefix-affinity]\n"
    )
    toml_file = tmp_path / "deploy.toml"
    toml_file.write_text(
        'model = "./tiny"\ntopology = "2p1d"\ngpus = "none"\nlog_dir = "out"\nserve_args = ["--block-size", "8"]\n'
        '[prefill]\nserve_args = ["--max-num-seqs", "4"]\nports = [18100, 18101]\nenv = {MY_VAR = "x"}\n'
        '[decode]\nside_channel_ports = [18600]\n[proxy]\nargs = ["--prefix-affinity"]\n'
    )
    for file in (yaml_file, toml_file):
        cfg = LaunchConfig()
        apply_file(cfg, load_file(file), str(file))
        cfg.validate()
        assert cfg.model == "./tiny" and str(cfg.topology) == "2p1d" and cfg.log_dir == Path("out")
        dep = build_deployment(cfg, env={})
        p0, p1, d = dep.instances
        assert (p0.port, p1.port, d.side_channel_port) == (18100, 18101, 18600)
        assert p0.argv[-4:] == ["--block-size", "8", "--max-num-seqs", "4"] and d.argv[-2:] == ["--block-size", "8"]
        assert p0.env["MY_VAR"] == "x" and "MY_VAR" not in d.env
        assert dep.proxy.argv[-1] == "--prefix-affinity"
    bad = tmp_path / "bad.yaml"
    bad.write_text("topology: 1p1d\nprefil: {}\n")
    with pytest.raises(ValueError, match="unknown keys prefil"):
        apply_file(LaunchConfig(), load_file(bad))
    bad.write_text("topology: 1p1d\nprefill: {ports: [1, 2]}\n")
    cfg = LaunchConfig()
    apply_file(cfg, load_file(bad))
    with pytest.raises(ValueError, match="1 prefill instance"):
        cfg.validate()


def test_busy_explicit_port_is_an_error() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        with pytest.raises(ValueError, match="not free"):
            build_deployment(LaunchConfig(model="m", port=busy, gpus="none"), env={})
        # the default proxy port falls back to a free one when busy
        dep = build_deployment(LaunchConfig(model="m", gpus="none", base_port=None), env={})
        assert dep.proxy.port != busy


def _up(*args: str, drop_env: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in drop_env}
    return subprocess.run([sys.executable, "-m", "pdserve", "up", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_dry_run_pdserve_is_a_runnable_script(tmp_path: Path) -> None:
    out = _up("./tiny", "--dry-run", "--gpus", "none", "--log-dir", str(tmp_path), "--port", "0",
              "--decode-arg=--max-num-seqs 8", "--", "--block-size", "8")
    assert out.returncode == 0, out.stderr
    script = out.stdout
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0  # valid shell syntax
    lines = [ln for ln in script.splitlines() if " serve " in ln]
    assert len(lines) == 2
    prefill, decode = (shlex.split(ln.rstrip(" \\")) for ln in lines)
    assert "kv_producer" in " ".join(prefill) and "kv_consumer" in " ".join(decode)
    assert prefill[-2:] == ["--block-size", "8"] and decode[-4:] == ["--block-size", "8", "--max-num-seqs", "8"]
    assert "taskset" in prefill and f"{tmp_path}/prefill.log" in script and f"{tmp_path}/proxy.log" in script
    assert "pdserve proxy" in script and "--prefill http://127.0.0.1:" in script
    # the instances inherit a secret generated when the script runs (not one written into it)
    exports = [ln for ln in script.splitlines() if ln.startswith("export PDSERVE_KV_SECRET=")]
    assert len(exports) == 1 and "token_hex(32)" in exports[0]


def test_dry_run_vllm_engine() -> None:
    out = _up("Qwen/Qwen2.5-7B-Instruct", "--engine", "vllm", "--gpus", "0,1", "--dry-run", "--base-port", "8100",
              "--port", "0", drop_env=("UCX_NET_DEVICES", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"))
    assert out.returncode == 0, out.stderr
    serve = [shlex.split(ln.rstrip(" \\")) for ln in out.stdout.splitlines() if "vllm serve" in ln]
    assert len(serve) == 2
    (p_env, p_cmd), (d_env, d_cmd) = (
        ([w for w in words if "=" in w and w.split("=")[0].isupper()], words) for words in serve
    )
    assert "CUDA_VISIBLE_DEVICES=0" in p_env and "CUDA_VISIBLE_DEVICES=1" in d_env
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT=8300" in p_env and "VLLM_NIXL_SIDE_CHANNEL_PORT=8301" in d_env
    assert "UCX_NET_DEVICES=all" in p_env and "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y" in d_env
    i = p_cmd.index("vllm")
    assert p_cmd[i : i + 7] == ["vllm", "serve", "Qwen/Qwen2.5-7B-Instruct", "--host", "127.0.0.1", "--port", "8100"]
    assert json.loads(p_cmd[p_cmd.index("--kv-transfer-config") + 1])["kv_role"] == "kv_producer"
    assert json.loads(d_cmd[d_cmd.index("--kv-transfer-config") + 1])["kv_role"] == "kv_consumer"
    assert "--port 8200" in " ".join(d_cmd)
    proxy = next(ln for ln in out.stdout.splitlines() if "pdserve proxy" in ln)
    assert "--prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200" in proxy


def test_bad_arguments_exit_2() -> None:
    assert _up("--topology", "3x3", "--dry-run").returncode == 2
    out = _up("--exit", "--dry-run")
    assert out.returncode == 2 and "--demo" in out.stderr
    out = _up("--engine", "vllm", "--gpus", "none")
    if out.returncode == 2:  # no vllm on PATH here
        assert "vllm" in out.stderr


def test_instances_sharing_a_gpu_split_its_memory() -> None:
    cfg = LaunchConfig(model="m")
    dep = build_deployment(cfg, gpus=["0"], env={})  # the one-GPU box: prefill and decode on GPU 0
    p, d = dep.instances
    assert (p.gpu, d.gpu) == ("0", "0")
    # each instance's own share (as vLLM reads the flag): together what one instance alone takes; decode starts
    # after prefill is up
    assert p.argv[-2:] == d.argv[-2:] == ["--gpu-memory-utilization", "0.45"]
    assert (p.wave, d.wave) == (0, 1) and any("GPU 0 is shared" in n for n in dep.notes)
    vllm = build_deployment(LaunchConfig(model="m", engine="vllm"), gpus=["0"], env={})
    assert [s.argv[-1] for s in vllm.instances] == ["0.45", "0.45"] and {s.wave for s in vllm.instances} == {0}
    # one GPU each, or the user's own setting: untouched
    two = build_deployment(cfg, gpus=["0", "1"], env={})
    assert all("--gpu-memory-utilization" not in s.argv and s.wave == 0 for s in two.instances)
    own = LaunchConfig(model="m", serve_args=["--gpu-memory-utilization=0.3"])
    assert all(s.argv.count("--gpu-memory-utilization=0.3") == 1 and s.wave == 0
               for s in build_deployment(own, gpus=["0"], env={}).instances)


def test_tools_do_not_import_torch() -> None:
    code = ("import sys, pdserve.launch.cli, pdserve.preflight.cli, pdserve.preflight.plan, pdserve.launch.demo, pdserve.preflight.gpu; "
            "print(' '.join(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_tensor_parallel_instances_get_one_gpu_per_rank() -> None:
    cfg = LaunchConfig(model="m", topology=parse_topology("1p2d"))
    cfg.pools["prefill"].tp = 2
    dep = build_deployment(cfg.validate(), gpus=["0", "1", "2", "3"], env={})
    p, d0, d1 = dep.instances
    assert (p.gpu, d0.gpu, d1.gpu) == ("0,1", "2", "3")
    assert p.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert p.argv[p.argv.index("--tensor-parallel-size") + 1] == "2"
    assert "--tensor-parallel-size" not in d0.argv
    # a rank count the GPUs cannot hold, or instances overlapping on part of their GPUs, are refused
    with pytest.raises(ValueError, match="tensor-parallel size 2 but --gpus gives 1"):
        build_deployment(cfg, gpus=["0"], env={})
    two = LaunchConfig(model="m", topology=parse_topology("2p1d"))
    two.pools["prefill"].tp = 2
    with pytest.raises(ValueError, match="overlap on GPU"):
        build_deployment(two, gpus=["0", "1", "2"], env={})
    with pytest.raises(ValueError, match="overlap on GPU 0"):  # decode on GPU 0 of the prefills' 0,1
        build_deployment(two, gpus=["0", "1"], env={})
    # instances on the same whole set share it as one-GPU instances share theirs
    both = LaunchConfig(model="m")
    both.pools["prefill"].tp = both.pools["decode"].tp = 2
    shared = build_deployment(both, gpus=["0", "1"], env={})
    assert [s.gpu for s in shared.instances] == ["0,1", "0,1"]
    assert shared.instances[0].argv[-2:] == ["--gpu-memory-utilization", "0.45"]
    assert any("GPU 0,1 is shared" in n for n in shared.notes)


def test_tensor_parallel_from_flags_files_and_serve_args(tmp_path: Path) -> None:
    from pdserve.launch.cli import add_arguments, config_from_args

    parser = __import__("argparse").ArgumentParser()
    add_arguments(parser)
    cfg = config_from_args(parser.parse_args(["m", "--prefill-tp", "2", "--decode-tp", "4", "--gpus", "none"]))
    assert (cfg.tensor_parallel_size("prefill"), cfg.tensor_parallel_size("decode")) == (2, 4)
    # CPU mode: cores in proportion to the ranks (one process per rank)
    dep = build_deployment(cfg, cpus=list(range(12)), env={})
    p, d = dep.instances
    assert p.cpus == [0, 1, 2, 3] and d.cpus == list(range(4, 12)) and p.env["OMP_NUM_THREADS"] == "4"
    assert d.argv[d.argv.index("--tensor-parallel-size") + 1] == "4"
    # the serve arguments' own flag counts, and must not contradict the pool's
    cfg = LaunchConfig(model="m", serve_args=["-tp", "2"], gpus="none")
    assert cfg.tensor_parallel_size("decode") == 2
    dep = build_deployment(cfg.validate(), cpus=list(range(8)), env={})
    assert all(s.argv.count("-tp") == 1 and "--tensor-parallel-size" not in s.argv for s in dep.instances)
    cfg.pools["decode"].tp = 4
    with pytest.raises(ValueError, match="tensor-parallel size 4 but its serve arguments say 2"):
        cfg.validate()
    f = tmp_path / "up.yaml"
    f.write_text("model: m\ndecode: {tp: 2}\n")
    cfg = LaunchConfig()
    apply_file(cfg, load_file(str(f)), str(f))
    assert cfg.validate().tensor_parallel_size("decode") == 2 and cfg.tensor_parallel_size("prefill") == 1
