"""Chaos soak: 2P2D + proxy on network-namespace hosts, bounded load, faults on a schedule, every answer
checked token-exact against a collocated reference (pdserve.testing.chaos). Needs root (namespaces).

    sudo python benchmarks/chaos_soak.py --requests 2000 --rate 8 --fault-every 10 --fault-hold 5 \\
        --out benchmarks/results/chaos_soak.json

Faults that make wrong KV (`--kv-faults flip=0.1,reassign=0.1`: per-request odds in the prefill processes,
pdserve/kv_transfer/faults.py) turn the per-block digests on (`enable_kv_digest`) and count the victims and the
mismatches the decodes caught; the network/process faults can be left out with `--faults none`:

    sudo python benchmarks/chaos_soak.py --requests 1000 --rate 4 --faults none \\
        --kv-faults flip=0.1,reassign=0.1 --policy recompute --out benchmarks/results/chaos_soak_kv.json

Push transfer (`NixlPushConnector` on both pools; the proxy learns the mode on its own) with tensor-parallel
decode instances, the cuts past the proxy's ejection bound included in the default faults:

    sudo python benchmarks/chaos_soak.py --kv-transfer-mode push --decode-tp 2 --requests 1000 --rate 1 \
        --fault-every 15 --fault-hold 4 --out benchmarks/results/chaos_soak_push_tp2.json

Without --model it builds the tests' tiny random-weight Llama (SmolLM2's tokenizer) in a temporary folder.
Prints progress, then the counts as JSON (also written to --out); exits 1 unless corrupted, hung and leaked
are all 0 and every KV fault victim was caught.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from pdserve.testing import netns
from pdserve.testing.chaos import (
    FAULTS,
    SoakConfig,
    count_kv_faults,
    ejection_bound_s,
    kv_fault_env,
    run_soak,
)
from pdserve.testing.pd_cluster import PDCluster, hosts_needed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: a tiny random Llama built here)")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rate", type=float, default=8.0, help="requests started per second")
    ap.add_argument("--fault-every", type=float, default=10.0, help="seconds between fault starts")
    ap.add_argument("--fault-hold", type=float, default=5.0, help="seconds a cut or slow link lasts")
    ap.add_argument("--long-hold", type=float, default=SoakConfig.long_hold_s,
                    help=f"seconds a long cut lasts (past the proxy's ejection bound, {ejection_bound_s():g} s)")
    ap.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, round-robin ({', '.join(FAULTS)})")
    ap.add_argument("--policy", default="fail", choices=("fail", "recompute"), help="kv_load_failure_policy")
    ap.add_argument("--kv-faults", default="", help="test-only wrong-KV faults in the prefills, e.g. "
                    "flip=0.1,reassign=0.1 (per-request odds); turns enable_kv_digest on")
    ap.add_argument("--num-gpu-blocks", type=int, default=None,
                    help="KV pool blocks of every instance, with --max-model-len 512 (a small pool reuses "
                         "reassigned blocks sooner)")
    ap.add_argument("--kv-transfer-mode", default="pull", choices=("pull", "push"),
                    help="NixlConnector (pull) or NixlPushConnector (push) on both pools")
    ap.add_argument("--prefill-tp", type=int, default=1, help="tensor-parallel size of each prefill instance")
    ap.add_argument("--decode-tp", type=int, default=1, help="tensor-parallel size of each decode instance")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the counts as JSON here")
    args = ap.parse_args()
    reason = netns.unavailable_reason()
    if reason is not None:
        print(f"chaos_soak: {reason}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="chaos-soak-"))
    if args.model is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from server_utils import make_model_dir  # the tests' tiny random Llama: no download

        model_dir = make_model_dir(work)
    else:
        model_dir = Path(args.model)
    faults = () if args.faults == "none" else tuple(args.faults.split(","))
    cfg = SoakConfig(requests=args.requests, rate=args.rate, fault_every_s=args.fault_every,
                     fault_hold_s=args.fault_hold, long_hold_s=args.long_hold, faults=faults, seed=args.seed)
    rates = {k: float(v) for k, v in (kv.split("=") for kv in args.kv_faults.split(",") if kv)}
    fault_log = work / "kv-faults.jsonl"
    started = time.monotonic()
    with netns.Testbed(hosts_needed(2, 2), tag="soak") as bed:
        cluster = PDCluster(bed, model_dir, work, policy=args.policy,
                            kv_extra={"enable_kv_digest": True} if rates else None,
                            prefill_env=kv_fault_env(fault_log, args.seed, **rates) if rates else None,
                            serve_args=("--num-gpu-blocks-override", str(args.num_gpu_blocks), "--max-model-len",
                                        "512") if args.num_gpu_blocks else (),
                            transfer_mode=args.kv_transfer_mode, prefill_tp=args.prefill_tp, decode_tp=args.decode_tp)
        try:
            cluster.start()
            print(f"2P2D ({args.kv_transfer_mode}, prefill TP={args.prefill_tp}, decode TP={args.decode_tp}) up on "
                  f"{bed.switch_ns} in {time.monotonic() - started:.0f}s; logs in {work}", flush=True)
            result = run_soak(cluster, cfg, log=lambda line: print(line, flush=True))
            count_kv_faults(result, fault_log, [n.log_path for n in cluster.decode])
        finally:
            cluster.stop()
    # the counts, then the options they were run with (faults as run, the long cuts' hold)
    text = json.dumps({**json.loads(result.to_json()), "options": {**vars(args), "faults": list(faults)}}, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    uncaught = sum(result.kv_victims.values()) - result.kv_caught
    return 0 if result.corrupted == result.hung == result.leaked == 0 and uncaught <= 0 else 1


if __name__ == "__main__":
    sys.exit(main())
