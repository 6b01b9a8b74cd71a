"""`pdserve up` across network-namespace hosts (pdserve.testing.netns): one bed of four hosts for the module.

- A two-node Ray cluster across hosts (pdserve.testing.ray_netns): `ray start --head` on host 0 (offering
  `prefill_node`), `ray start --address` on host 1 (offering `decode_node`), each node with its host's address,
  token authentication on. `pdserve up --ray HEAD:6379`, run on host 0, places the prefill on host 0 and the
  decode on host 1; answers through the proxy, asked from the client host, are token-exact with a collocated
  engine and the KV crossed the bridge over NIXL. Every process of the cluster and the app lives in the bed's
  namespaces and listens on its host's address or that namespace's wildcard, never on loopback only. The decode's server is SIGKILLed mid-load: Ray restarts it, no request hangs, answers are exact
  again. Ray is stopped by PID (never `ray stop`) and nothing of it is left.
- Plain `pdserve up` (no Ray) cannot place processes on several hosts: the whole deployment (proxy, 1P1D) runs
  on host 2 with `--host` its address; its decode instance is SIGKILLed under load, `pdserve up` restarts it,
  no request hangs, the answers afterwards are token-exact and no KV stays held.

Requests come from host 3. The reference is the engine in this process (collocated, greedy). Needs root for
namespaces and Ray (the `ray` extra): skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from engine_utils import make_engine, run_engine
from launch_helpers import Up, kill_leftovers, listening_addresses, wait_until
from server_utils import make_model_dir

from pdserve.launch.procs import descendants, pid_alive
from pdserve.testing import netns
from pdserve.testing.pd_cluster import answer_token_ids, completion_body, idle_problems
from pdserve.types.sampling_params import SamplingParams

pytest.importorskip("nixl_cu12", reason="NIXL is not installed (pip install --no-deps nixl-cu12==1.5.1)")
_REASON = netns.unavailable_reason()
pytestmark = [pytest.mark.skipif(_REASON is not None, reason=f"no network namespaces: {_REASON}"),
              pytest.mark.timeout(600)]

STARTUP_S = 300  # bounds only: a loaded 2-core box imports torch in several processes at once
REQUEST_TIMEOUT_S = 60.0  # a request with no answer by then counts as hung
MAX_TOKENS = 12
KV_SETTLE_S = 60.0  # bound for KV to be free again: a lease held for a killed decode expires after 30 s
PROMPTS = ["Hi", "alpha river stone cloud seven orange signal quiet market engine " * 3,
           " ".join(f"word{i % 17}" for i in range(90))]


@pytest.fixture(scope="module")
def bed() -> Iterator[netns.Testbed]:
    with netns.Testbed(4, tag="up") as the_bed:
        yield the_bed


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    return make_model_dir(tmp_path_factory.mktemp("netns-up-model"))


class Reference:
    """Greedy tokens of a collocated engine in this process, by prompt token ids (memoised)."""

    def __init__(self, model_dir: Path) -> None:
        self.engine = make_engine(model_dir)
        self._memo: dict[tuple[int, ...], list[int]] = {}

    def __call__(self, prompt_ids: list[int]) -> list[int]:
        key = tuple(prompt_ids)
        if key not in self._memo:
            sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
            self._memo[key] = run_engine(self.engine, [prompt_ids], sp)[0]
        return self._memo[key]


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Reference:
    return Reference(model_dir)


def ask(proxy: str, model: str, prompt: str, stream: bool) -> tuple[list[int] | str, list[int]]:
    """(generated ids or an error line, prompt ids) of one greedy completion; the caller is on a bed host."""
    body = completion_body(prompt, MAX_TOKENS, stream, model=model)
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
        r = http.post(f"{proxy}/v1/completions", json=body)
    prompt_ids: list[int] = []
    if r.status_code == 200 and not stream:
        prompt_ids = r.json()["choices"][0]["prompt_token_ids"]
    return answer_token_ids(r.status_code, r.content, stream), prompt_ids


def expected_answers(bed: netns.Testbed, client: netns.Host, proxy: str, model: str,
                     reference: Reference) -> dict[str, list[int]]:
    """Each prompt asked once through the deployment: the answer must be the reference's; returns prompt -> ids."""
    out = {}
    with bed.entered(client):
        for prompt in PROMPTS:
            got, prompt_ids = ask(proxy, model, prompt, stream=False)
            assert isinstance(got, list), got
            assert got == reference(prompt_ids), prompt[:30]
            streamed, _ = ask(proxy, model, prompt, stream=True)
            assert streamed == got, prompt[:30]
            out[prompt] = got
    return out


class Load:
    """Two client threads on the client host asking the prompts in turn (half streamed) until stopped. Every
    answer is recorded: ids (checked against `expected`), a clean error, or a hang (no answer in the timeout)."""

    def __init__(self, bed: netns.Testbed, client: netns.Host, proxy: str, model: str,
                 expected: dict[str, list[int]]) -> None:
        self.args = (bed, client, proxy, model)
        self.expected = expected
        self.ok: list[float] = []  # start times of exact answers
        self.errors: list[str] = []
        self.wrong: list[str] = []
        self.hung: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(2)]
        for t in self._threads:
            t.start()

    def _run(self, k: int) -> None:
        bed, client, proxy, model = self.args
        n = k
        with bed.entered(client):
            while not self._stop.is_set():
                prompt = PROMPTS[n % len(PROMPTS)]
                start = time.monotonic()
                try:
                    got, _ = ask(proxy, model, prompt, stream=n % 2 == 1)
                except httpx.TimeoutException as e:
                    got = e
                except httpx.HTTPError as e:  # refused/reset while a server restarts: clean, not a hang
                    got = f"{type(e).__name__}: {e}"
                with self._lock:
                    if isinstance(got, Exception):
                        self.hung.append(f"{prompt[:20]!r}: {got!r}")
                    elif isinstance(got, str):
                        self.errors.append(got)
                    elif got == self.expected[prompt]:
                        self.ok.append(start)
                    else:
                        self.wrong.append(f"{prompt[:20]!r}: {got} != {self.expected[prompt]}")
                if isinstance(got, str):
                    time.sleep(0.2)
                n += 2

    def exact_since(self, t: float) -> int:
        with self._lock:
            return sum(1 for s in self.ok if s >= t)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=REQUEST_TIMEOUT_S + 15)
        assert not any(t.is_alive() for t in self._threads), "a client is stuck past its timeout"


def net_namespace(pid: int) -> str:
    """The network namespace a process runs in ("" once it is gone)."""
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return ""


def test_ray_two_nodes_across_hosts_prefill_and_decode_apart(bed: netns.Testbed, model_dir: Path,
                                                             reference: Reference, tmp_path: Path) -> None:
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'pdserve[ray]')")
    from pdserve.testing.ray_netns import RayNetnsCluster

    head, other, _, client = bed.hosts
    ray_cluster = RayNetnsCluster(bed, head, [other], tmp_path, num_cpus=1,
                                  resources={head.addr: {"prefill_node": 1}, other.addr: {"decode_node": 1}})
    up: Up | None = None
    seen: set[int] = set()
    try:
        nodes = ray_cluster.start().alive_nodes()
        assert sorted(n["ip"] for n in nodes) == sorted([head.addr, other.addr]), nodes
        up = Up([str(model_dir), "--ray", ray_cluster.address, "--topology", "1p1d", "--port", "0",
                 "--prefill-resources", '{"prefill_node": 1}', "--decode-resources", '{"decode_node": 1}',
                 "--log-dir", str(tmp_path / "logs"), "--serve-arg=--max-model-len 512 --num-gpu-blocks-override 128",
                 "--proxy-arg=--health-interval 1"],
                cwd=tmp_path, env={**os.environ, **head.env(), **ray_cluster.env}, prefix=("ip", "netns", "exec", head.ns))
        info = up.ready(STARTUP_S)
        # placement: proxy and prefill on the head's host, decode on the other, each at its host's address
        assert urlsplit(info["proxy"]).hostname == head.addr, info
        assert urlsplit(info["prefill"]).hostname == head.addr, info
        assert urlsplit(info["decode"]).hostname == other.addr, info

        def app_status() -> dict:
            with bed.entered(client):
                return httpx.get(info["autoscaler"] + "/pdserve/app", timeout=10).json()

        decode = next(i for i in app_status()["instances"] if i["role"] == "decode")
        with bed.entered(client):
            side = httpx.get(info["prefill"] + "/pdserve/info", timeout=10).json()["side_channel_host"]
        assert side == head.addr  # advertised to the decode on the other host, never 127.0.0.1
        expected = expected_answers(bed, client, info["proxy"], info["model"], reference)
        with bed.entered(client):
            metrics = httpx.get(info["decode"] + "/metrics", timeout=10).text
        pulls = sum(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("vllm:nixl_xfer_time_seconds_count"))
        assert pulls >= len(PROMPTS)  # the KV crossed the bridge from host 0 to host 1 over NIXL

        # every Ray process and every instance runs inside the bed (so nothing of theirs listens or talks
        # outside it): the head's processes in host 0's namespace, the other node's in host 1's
        seen = ray_cluster.process_ids() | {int(info["pid"])}
        bed_namespaces = {net_namespace(p.pid) for p in ray_cluster.nodes}
        assert len(bed_namespaces) == 2 and net_namespace(os.getpid()) not in bed_namespaces
        assert {net_namespace(p) for p in seen} - {""} == bed_namespaces
        # what they listen on: their host's address or the wildcard (which in a namespace is that host's own
        # interfaces); nothing only on loopback, which a peer on the other host could not reach; the pdserve
        # servers (HTTP, KV side channel, NIXL) on their host's address alone
        host_of = {net_namespace(p.pid): p.host.addr for p in ray_cluster.nodes}
        listening = listening_addresses(sorted(seen))
        for pid, addrs in listening.items():
            assert {a for a, _ in addrs} <= {host_of.get(net_namespace(pid)), "0.0.0.0", "::"}, (pid, addrs)
        for inst in app_status()["instances"]:
            addrs = listening[inst["server_pid"]]
            assert addrs and {a for a, _ in addrs} == {urlsplit(inst["url"]).hostname}, (inst, addrs)

        # SIGKILL of the decode instance's server under load: Ray restarts it on the same node; no hang
        load = Load(bed, client, info["proxy"], info["model"], expected)
        try:
            assert wait_until(lambda: load.exact_since(0) >= 2, 120, 0.2), (load.errors, load.hung)
            os.kill(decode["server_pid"], signal.SIGKILL)
            killed = time.monotonic()

            def restarted() -> bool:
                now = next(i for i in app_status()["instances"] if i["role"] == "decode")
                return now["state"] == "serving" and now["server_pid"] not in (None, decode["server_pid"])

            assert wait_until(restarted, STARTUP_S, 1.0), (app_status(), up.output[-3000:])
            back = time.monotonic()
            assert wait_until(lambda: load.exact_since(back) >= 4, 180, 0.5), (load.errors[-5:], load.hung)
        finally:
            load.stop()
        assert not load.wrong and not load.hung, (load.wrong[:3], load.hung[:3])
        now = next(i for i in app_status()["instances"] if i["role"] == "decode")
        assert urlsplit(now["url"]).hostname == other.addr  # back on its node
        print(json.dumps({"exact": len(load.ok), "clean_errors": len(load.errors),
                          "restart_s": round(back - killed, 1)}))
        seen |= ray_cluster.process_ids()
        assert up.stop(signal.SIGTERM, timeout=120) == 0, up.output[-3000:]
    finally:
        if up is not None:
            up.kill()
        left = ray_cluster.stop()
        kill_leftovers(left)
    assert not left, f"Ray processes outlived their nodes' stop: {left}"
    assert not [p for p in seen if pid_alive(p)]


def test_sigkill_under_pdserve_up_on_a_namespace_host(bed: netns.Testbed, model_dir: Path,
                                                      reference: Reference, tmp_path: Path) -> None:
    _, _, host, client = bed.hosts
    up = Up([str(model_dir), "--topology", "1p1d", "--host", host.addr, "--port", "0",
             "--log-dir", str(tmp_path / "logs"), "--max-restarts", "3",
             "--serve-arg=--max-model-len 512 --num-gpu-blocks-override 128",
             "--proxy-arg=--health-interval 1 --instance-wait-timeout 10"],
            cwd=tmp_path, env={**os.environ, **host.env()}, prefix=("ip", "netns", "exec", host.ns))
    pids: list[int] = []
    try:
        info = up.ready(STARTUP_S)
        for role in ("proxy", "prefill", "decode"):
            assert urlsplit(info[role]).hostname == host.addr, info
        pids = [int(p) for p in info["pids"].split(",")]
        decode_pid = pids[1]
        assert net_namespace(decode_pid) == net_namespace(up.proc.pid) != net_namespace(os.getpid())
        expected = expected_answers(bed, client, info["proxy"], info["model"], reference)
        load = Load(bed, client, info["proxy"], info["model"], expected)
        try:
            assert wait_until(lambda: load.exact_since(0) >= 2, 120, 0.2), (load.errors, load.hung)
            os.kill(decode_pid, signal.SIGKILL)
            up.wait_for("decode ready again", STARTUP_S)
            new_pid = int(up.wait_for(r"decode restarted \(pid (\d+)\)", 10).group(1))
            pids.append(new_pid)
            assert new_pid != decode_pid and not pid_alive(decode_pid)
            assert net_namespace(new_pid) == net_namespace(up.proc.pid)  # restarted on the same host
            back = time.monotonic()
            assert wait_until(lambda: load.exact_since(back) >= 4, 180, 0.5), (load.errors[-5:], load.hung)
        finally:
            load.stop()
        assert not load.wrong and not load.hung, (load.wrong[:3], load.hung[:3])
        assert "was killed by SIGKILL; restarting it" in up.output and "crash loop" not in up.output
        # nothing held after the kill: the prefill frees what it leased to the killed decode when the lease
        # expires (kv_lease_duration, 30 s by default), the restarted decode starts empty
        with bed.entered(client):
            assert not idle_problems({"prefill": info["prefill"], "decode": info["decode"]}, timeout=KV_SETTLE_S)
        print(json.dumps({"exact": len(load.ok), "clean_errors": len(load.errors)}))
        pids += list(descendants({up.proc.pid}))
        assert up.stop(signal.SIGTERM) == 0, up.output[-3000:]
        assert wait_until(lambda: not any(pid_alive(p) for p in pids), 30)
    finally:
        up.kill()
        kill_leftovers(pids)
