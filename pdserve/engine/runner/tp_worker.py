"""A tensor-parallel worker: ranks 1..N-1 of an engine, each its own process (`python -m
pdserve.engine.runner.tp_worker --fd N`), started by `pdserve.engine.runner.tp_executor`.

It builds a ModelRunner over its shard (weights, KV pool, attention backend, CUDA graphs), then replays the
steps rank 0 sends over its pipe until told to stop, its pipe closes, or a collective fails. It never
schedules, samples or serves HTTP. It dies with its parent (a watchdog thread polls the parent pid; the
pipe's EOF ends the step loop too), so a killed engine leaves no rank behind.

Pipe protocol: the typed messages of `tp_messages`, pickled on a `multiprocessing.connection.Connection`
over a socketpair (WorkerInit, then steps for ModelRunner.replay until Stop; Hello, then Ready or Failed back).
A second socketpair (`--rpc-fd`) carries calls into the rank beside the steps (`rank_rpc`): its KV transfer
agent (`kv_rank.RankKVService`), served once the runner exists.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

from pdserve.engine.runner.tp_messages import Failed, Hello, Ready, Stop, WorkerInit, recv, send

log = logging.getLogger("pdserve.parallel")


def _die_with_parent(parent: int, poll_s: float = 0.5) -> None:
    """Exit when the engine process is gone, even in the middle of a collective. (PR_SET_PDEATHSIG would
    fire when the engine's *thread* that started us ends, which is not the engine's death.)"""

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(poll_s)

    threading.Thread(target=watch, name="pdserve-tp-parent-watch", daemon=True).start()


def run(conn: Connection, rpc_conn: Connection) -> int:
    init = recv(conn)
    assert isinstance(init, WorkerInit), init
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s %(name)s [tp rank {init.rank}]: %(message)s")
    import torch

    from pdserve.engine.runner.model_runner import ModelRunner
    from pdserve.kv_transfer.kv_rank import RankKVService
    from pdserve.parallel import rank_rpc
    from pdserve.parallel.comm import TPGroup, connect_store

    if init.torch_threads:
        torch.set_num_threads(init.torch_threads)
    device = torch.device(init.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    send(conn, Hello())
    try:
        store = connect_store(init.store_port, init.size, init.setup_timeout_s)
        group = TPGroup(store, init.rank, init.size, device, timeout_s=init.timeout_s,
                        setup_timeout_s=init.setup_timeout_s)
        runner = ModelRunner(init.config, init.model_cfg, init.model_dir, tp=group)
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, which names it in its error
        send(conn, Failed(f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return 1
    kv = RankKVService(runner.kv_pool)
    threading.Thread(target=rank_rpc.serve, args=(rpc_conn, kv.handlers()), name="pdserve-rank-rpc-serve",
                     daemon=True).start()
    send(conn, Ready(runner.num_blocks, os.getpid()))
    while True:
        try:
            msg = recv(conn)
        except (EOFError, OSError):
            log.info("the engine closed the step pipe; exiting")
            return 0
        if isinstance(msg, Stop):
            return 0
        try:
            runner.replay(msg)
        except BaseException:  # noqa: BLE001 - a failed collective: rank 0 fails too; leave at once
            log.exception("tensor-parallel step failed")
            return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.engine.runner.tp_worker")
    p.add_argument("--fd", type=int, required=True, help="the engine's end of the step pipe (inherited)")
    p.add_argument("--rpc-fd", type=int, required=True, help="the engine's end of the call pipe (inherited)")
    p.add_argument("--parent", type=int, required=True, help="the engine's pid")
    args = p.parse_args(argv)
    if os.getppid() != args.parent:
        return 1
    _die_with_parent(args.parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the engine decides
    conn = Connection(args.fd)
    rpc_conn = Connection(args.rpc_fd)
    try:
        code = run(conn, rpc_conn)
    finally:
        conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip torch's slow interpreter teardown


if __name__ == "__main__":
    main()
