"""A multi-host pdserve deployment on this machine: every instance on its own network-namespace host.

    sudo python scripts/netns_testbed.py MODEL_DIR [--prefill 2] [--decode 2] [--check]

Hosts (addresses in 10.200.0.0/24 inside the namespaces only): the proxy, P prefill and D decode instances,
a collocated reference and a client host, all on one private bridge; KV moves over NIXL/UCX TCP between
them. Without --check it prints the hosts and waits (Ctrl-C ends it): talk to the deployment from the client
host, e.g. `ip netns exec CLIENT_NS curl http://PROXY:8000/v1/models`, and inject faults with `ip -n SWITCH_NS
link set pN down|up` or `tc -n SWITCH_NS qdisc replace dev pN root tbf rate 10mbit burst 32kb latency 400ms`.
With --check it sends a few greedy prompts through the proxy, compares them token by token with the collocated
instance, and exits 0 when all match. Everything (processes, namespaces, the bridge) is removed on exit, also
after an error or SIGTERM, and namespaces a crashed earlier run left are removed at start.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pdserve.testing import netns
from pdserve.testing.pd_cluster import PDCluster, answer_token_ids, completion_body, hosts_needed

PROMPTS = ("The quick brown fox", "one two three four five six seven eight nine ten " * 6, "Hello")


def check(cluster: PDCluster) -> bool:
    ok = True
    with cluster.client(), httpx.Client(timeout=120) as http:
        for prompt in PROMPTS:
            for stream in (False, True):
                answers = []
                for url in (cluster.collocated.url, cluster.proxy.url):
                    r = http.post(f"{url}/v1/completions", json=completion_body(prompt, 16, stream))
                    answers.append(answer_token_ids(r.status_code, r.content, stream))
                same = answers[0] == answers[1] and isinstance(answers[0], list)
                ok &= same
                print(f"{'exact' if same else 'DIFFERENT'}  stream={stream}  {prompt[:30]!r}: {answers[1]}")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="model folder (served as 'tiny')")
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--check", action="store_true", help="compare a few answers with the collocated one, then exit")
    args = ap.parse_args()
    reason = netns.unavailable_reason()
    if reason is not None:
        print(f"netns_testbed: {reason}", file=sys.stderr)
        return 2
    # SIGTERM unwinds like Ctrl-C, so the with-block below tears everything down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    logs = Path(tempfile.mkdtemp(prefix="netns-testbed-"))
    with netns.Testbed(hosts_needed(args.prefill, args.decode), tag="tb") as bed:
        cluster = PDCluster(bed, Path(args.model), logs, n_prefill=args.prefill, n_decode=args.decode)
        try:
            cluster.start()
            for node in cluster.nodes:
                print(f"{node.role:<10} {node.url:<26} netns {node.host.ns}  switch port {node.host.port_dev}")
            print(f"client     {cluster.client_host.addr:<26} netns {cluster.client_host.ns}")
            print(f"switch namespace {bed.switch_ns}; logs in {logs}")
            if args.check:
                return 0 if check(cluster) else 1
            print("up; Ctrl-C to tear down")
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            return 0
        finally:
            cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
