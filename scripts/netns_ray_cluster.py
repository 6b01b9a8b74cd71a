"""`pdserve up --ray` on a two-node Ray cluster whose nodes are network-namespace hosts of this machine.

    sudo python scripts/netns_ray_cluster.py MODEL_DIR [--check]

Three hosts on a private bridge (addresses in 10.200.0.0/24, inside the namespaces only): the Ray head (offers
`prefill_node`; runs the driver, the proxy and the prefill), a second Ray node (offers `decode_node`; runs the
decode) and a client host. Ray has token authentication on (one random token, by environment) and is stopped by
PID, never with `ray stop`. Without --check it prints the hosts and waits (Ctrl-C ends it): talk to the
deployment from the client host, e.g. `ip netns exec CLIENT_NS curl PROXY/v1/models`. With --check it sends a
few greedy prompts through the proxy, compares them token by token with a collocated engine in this process,
and exits 0 when all match. Everything (the app, Ray, the namespaces) is removed on exit, also after an error
or SIGTERM.
"""

from __future__ import annotations

import argparse
import re
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pdserve.testing import netns
from pdserve.testing.pd_cluster import answer_token_ids, completion_body
from pdserve.testing.ray_netns import RayNetnsCluster

PROMPTS = ("The quick brown fox", "one two three four five six seven eight nine ten " * 6, "Hello")
MAX_TOKENS = 16
READY_TIMEOUT_S = 600.0


def wait_ready(proc: netns.Proc) -> dict[str, str]:
    """The fields of `pdserve up`'s PDSERVE_READY line (read from its log)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if m := re.search(r"^PDSERVE_READY (.*)$", proc.log(tail=1 << 20), re.M):
            return dict(w.split("=", 1) for w in shlex.split(m.group(1)))
        if proc.popen.poll() is not None:
            raise RuntimeError(f"pdserve up exited:\n{proc.log()}")
        time.sleep(1.0)
    raise TimeoutError(f"pdserve up not ready:\n{proc.log()}")


def check(bed: netns.Testbed, client: netns.Host, info: dict[str, str], model: str) -> bool:
    from pdserve import LLM, SamplingParams
    from pdserve.inputs import TokensPrompt

    reference = LLM(model, device="cpu")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    ok = True
    for prompt in PROMPTS:
        want: list[int] = []
        for stream in (False, True):  # the plain answer first: it names the prompt's token ids
            body = completion_body(prompt, MAX_TOKENS, stream, model=info["model"])
            with bed.entered(client):
                r = httpx.post(f"{info['proxy']}/v1/completions", json=body, timeout=120)
            got = answer_token_ids(r.status_code, r.content, stream)
            if not stream and r.status_code == 200:
                ids = r.json()["choices"][0]["prompt_token_ids"]
                want = list(reference.generate([TokensPrompt(prompt_token_ids=ids)], params)[0].outputs[0].token_ids)
            same = got == want
            ok &= same
            print(f"{'exact' if same else 'DIFFERENT'}  stream={stream}  {prompt[:30]!r}: {got}")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="model folder")
    ap.add_argument("--check", action="store_true", help="compare a few answers with a collocated engine, then exit")
    args = ap.parse_args()
    reason = netns.unavailable_reason()
    if reason is not None:
        print(f"netns_ray_cluster: {reason}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds like Ctrl-C: everything torn down
    logs = Path(tempfile.mkdtemp(prefix="netns-ray-"))
    model = str(Path(args.model).absolute())
    with netns.Testbed(3, tag="ray") as bed:
        head, other, client = bed.hosts
        cluster = RayNetnsCluster(bed, head, [other], logs,
                                  resources={head.addr: {"prefill_node": 1}, other.addr: {"decode_node": 1}})
        up: netns.Proc | None = None
        try:
            cluster.start()
            up = bed.spawn(head, [sys.executable, "-m", "pdserve", "up", model, "--ray", cluster.address,
                                  "--topology", "1p1d", "--log-dir", str(logs / "app"),
                                  "--prefill-resources", '{"prefill_node": 1}',
                                  "--decode-resources", '{"decode_node": 1}'],
                           env=cluster.env, log_path=logs / "pdserve-up.log")
            info = wait_ready(up)
            for role in ("proxy", "prefill", "decode"):
                print(f"{role:<8} {info[role]}")
            print(f"ray head {cluster.address} (netns {head.ns}), node {other.addr} (netns {other.ns})")
            print(f"client   {client.addr} (netns {client.ns}); logs in {logs}")
            if args.check:
                return 0 if check(bed, client, info, model) else 1
            print("up; Ctrl-C to tear down")
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            return 0
        finally:
            if up is not None:
                up.stop(timeout=120)  # SIGTERM: pdserve up stops the app (actors, placement groups)
            left = cluster.stop()
            if left:
                print(f"netns_ray_cluster: Ray processes left after stop: {left}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
