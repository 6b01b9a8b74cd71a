"""Tensor parallelism on CPU (gloo, float32): TP=2 is token-identical to TP=1 and to transformers for the
three families, including a model with fewer KV heads than ranks; clear errors for what cannot run; a
killed worker rank stops the engine (and the server exits) instead of hanging a collective.

Greedy argmax over float32 sums taken in a different order (two partial matmuls plus an all-reduce instead
of one matmul) agrees here because the tiny models' init gives clear margins (tests/tiny_models.py); an
exact tie would be a property of the model, not of the sharding.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import torch
from engine_utils import hf_greedy, make_engine, mixed_prompts, run_engine
from server_utils import PdserveProcess, free_port, make_model_dir

from pdserve.types.sampling_params import SamplingParams
from pdserve.types.tp_layout import (
    HeadSegment,
    TensorParallelError,
    TPShard,
    check_tensor_parallel,
    head_sources,
)

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)

# name -> tiny model options: the three families, and a Llama with one KV head (replicated over 2 ranks),
# tied embeddings, a vocabulary that does not split evenly and the row-parallel biases
MODELS = {
    "llama": dict(arch="llama"),
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3"),
    "llama-1kv": dict(arch="llama", num_key_value_heads=1, tie=True, vocab_size=321, attention_bias=True,
                      mlp_bias=True),
}


# ---- layout (no processes) -----------------------------------------------------------------------------
def test_check_tensor_parallel_names_what_does_not_split():
    check_tensor_parallel(2, num_heads=4, num_kv_heads=2, intermediate_size=128)
    check_tensor_parallel(4, num_heads=4, num_kv_heads=1, intermediate_size=128)  # KV heads replicated
    with pytest.raises(TensorParallelError, match="does not divide the model's 4 attention heads"):
        check_tensor_parallel(3, num_heads=4, num_kv_heads=2, intermediate_size=128)
    with pytest.raises(TensorParallelError, match="6 KV heads: one must divide the other"):
        check_tensor_parallel(4, num_heads=24, num_kv_heads=6, intermediate_size=128)
    with pytest.raises(TensorParallelError, match="intermediate size 100"):
        check_tensor_parallel(8, num_heads=8, num_kv_heads=8, intermediate_size=100)
    with pytest.raises(TensorParallelError, match="positive"):
        check_tensor_parallel(0, num_heads=4, num_kv_heads=2, intermediate_size=128)


def test_shards_cover_the_model():
    shards = [TPShard(r, 4, 32, 8, 1000, 50001) for r in range(4)]
    assert [(s.head_start, s.heads) for s in shards] == [(0, 8), (8, 8), (16, 8), (24, 8)]
    assert [(s.kv_start, s.kv_heads) for s in shards] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [(s.vocab_start, s.vocab_end) for s in shards][-1] == (37503, 50001)
    assert sum(s.vocab_end - s.vocab_start for s in shards) == 50001
    replicated = [TPShard(r, 8, 32, 2, 1000, 100) for r in range(8)]
    assert [(s.kv_start, s.kv_heads) for s in replicated] == [(0, 1)] * 4 + [(1, 1)] * 4
    # each rank's query heads use its one KV head: query head q -> KV head q // (32 // 2)
    assert all(s.head_start // 16 == s.kv_start for s in replicated)


def test_head_sources_between_tp_sizes():
    # same TP: rank to rank, all heads
    assert head_sources(8, 1, 2, 2) == [HeadSegment(1, 0, 0, 4)]
    # P TP=2 -> D TP=1: both producer ranks, each whole
    assert head_sources(8, 0, 1, 2) == [HeadSegment(0, 0, 0, 4), HeadSegment(1, 0, 4, 4)]
    # P TP=1 -> D TP=2: half of the one producer's heads
    assert head_sources(8, 1, 2, 1) == [HeadSegment(0, 4, 0, 4)]
    # P TP=4 -> D TP=2 with 8 heads: D rank 1 reads ranks 2 and 3
    assert head_sources(8, 1, 2, 4) == [HeadSegment(2, 0, 0, 2), HeadSegment(3, 0, 2, 2)]
    # replicated on P (2 KV heads, P TP=4: ranks 0,1 hold head 0 and 2,3 head 1) -> D TP=1: read each once
    assert head_sources(2, 0, 1, 4) == [HeadSegment(0, 0, 0, 1), HeadSegment(2, 0, 1, 1)]
    # replicated on both: D rank 3 of 4 wants head 1, from the producer rank vLLM picks (3 * 2 // 4 = 1)
    assert head_sources(2, 3, 4, 2) == [HeadSegment(1, 0, 0, 1)]
    # D TP=4 over 8 heads from P TP=2: D rank 3 reads producer 1's heads 2..3
    assert head_sources(8, 3, 4, 2) == [HeadSegment(1, 2, 0, 2)]


def test_more_ranks_than_gpus_is_refused():
    from pdserve.engine.runner.tp_executor import rank_devices

    with pytest.raises(TensorParallelError, match=r"needs 2 GPUs, but \d+ (is|are) visible"):
        rank_devices(torch.device("cuda"), 2 + torch.cuda.device_count())
    with pytest.raises(TensorParallelError, match="CUDA_VISIBLE_DEVICES"):
        rank_devices(torch.device("cuda", 1), 2)
    assert rank_devices(torch.device("cpu"), 3) == [torch.device("cpu")] * 3


def test_engine_refuses_a_tp_size_that_does_not_divide_the_heads(tiny_llama):
    with pytest.raises(TensorParallelError, match="does not divide the model's 4 attention heads"):
        make_engine(tiny_llama, tensor_parallel_size=3)


# ---- engines with worker processes ---------------------------------------------------------------------
@pytest.mark.parametrize("name", list(MODELS))
def test_tp2_matches_tp1_and_transformers(tiny_model_factory, name):
    model = tiny_model_factory(**MODELS[name])
    prompts = mixed_prompts(320)
    want = hf_greedy(model, prompts, GREEDY.max_tokens)
    # a small token budget: chunked prefills and mixed prefill/decode steps, all through the collectives
    kw = dict(max_num_batched_tokens=48, max_num_seqs=4)
    one = make_engine(model, **kw)
    try:
        assert run_engine(one, prompts, GREEDY) == want
    finally:
        one.shutdown()
    two = make_engine(model, tensor_parallel_size=2, **kw)
    procs = _worker_procs(two)
    try:
        assert two.runner.num_kv_heads == max(1, two.model_cfg.num_kv_heads // 2)
        assert run_engine(two, prompts, GREEDY) == want
        # prefix-cache hits and a second round on the same workers
        again = [p[:20] + [5, 6, 7] for p in prompts[2:4]]
        assert run_engine(two, again, GREEDY) == hf_greedy(model, again, GREEDY.max_tokens)
        assert two.stats().prefix_cache_hits > 0
    finally:
        two.shutdown()
    assert len(procs) == 1 and all(p.poll() is not None for p in procs)


def _worker_procs(engine):
    workers = engine.runner.workers
    return [] if workers is None else list(workers.procs)


@pytest.mark.parametrize("simulate_graphs", [False, True])
def test_tp2_through_the_gpu_step_runner(tiny_llama, monkeypatch, simulate_graphs):
    """The GPU step runner's messages (staged host buffers) replayed by the other rank, on CPU: eager steps,
    and with simulate_graphs the decode graph steps' headers and block-table updates run eagerly (no CUDA
    graphs here), the same code the CUDA path runs around its kernels. The C kernel takes the
    CPU path's int32 tables only, so both ranks use the reference attention (rank 0 set here, the worker
    through the env: this process may have loaded the kernel already), one sequence per step (the GPU path
    leaves block-table padding unset, which only the reference reads)."""
    from pdserve.attention.torch_ref import TorchAttention

    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "0")
    prompts = mixed_prompts(320, lengths=(3, 17, 40))
    want = hf_greedy(tiny_llama, prompts, GREEDY.max_tokens)
    engine = make_engine(tiny_llama, tensor_parallel_size=2, enforce_eager=True, max_num_batched_tokens=32,
                         max_num_seqs=1)
    try:
        engine.runner.backend = TorchAttention()
        engine.runner.use_gpu_step_runner(simulate_graphs=simulate_graphs)
        assert run_engine(engine, prompts, GREEDY) == want
        timing = engine.runner.step_timing
        assert timing.steps > timing.graph_steps and (timing.graph_steps > 0) == simulate_graphs
    finally:
        engine.shutdown()


def test_offline_llm_with_tensor_parallel_size(tiny_model_factory):
    from pdserve.llm import LLM

    model = tiny_model_factory(**MODELS["qwen3"])
    prompts = mixed_prompts(320, lengths=(7, 30))
    llm = LLM(str(model), tensor_parallel_size=2, device="cpu", num_gpu_blocks_override=64,
              skip_tokenizer_init=True)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model, prompts, GREEDY.max_tokens)
    finally:
        llm.engine.shutdown()


def test_a_killed_worker_stops_the_engine_without_hanging(tiny_llama):
    from pdserve.engine.runner.tp_executor import WorkerDiedError

    engine = make_engine(tiny_llama, tensor_parallel_size=2)
    try:
        (proc,) = _worker_procs(engine)
        engine.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=200, ignore_eos=True))
        engine.step()
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        t0 = time.monotonic()
        with pytest.raises((WorkerDiedError, RuntimeError)):
            for _ in range(200):  # bounded: the first step after the death fails
                engine.check_health()
                engine.step()
        assert time.monotonic() - t0 < 30  # the collective failed; it did not sit out a timeout
        with pytest.raises(WorkerDiedError, match="rank 1 .* exited"):
            engine.check_health()
    finally:
        engine.shutdown()


def _tp_workers_of(pid: int) -> list[int]:
    """Pids of the tensor-parallel worker processes whose parent is `pid`."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"pdserve.engine.runner.tp_worker" in cmdline:
            out.append(int(entry.name))
    return out


def test_server_with_a_killed_worker_fails_health_and_exits(tmp_path):
    port = free_port()
    server = PdserveProcess(tmp_path / "serve.log", port, [
        "serve", str(make_model_dir(tmp_path)), "--port", str(port), "--device", "cpu", "--tensor-parallel-size", "2",
        "--num-gpu-blocks-override", "64", "--served-model-name", "tiny"])
    try:
        server.wait_ready()
        info = httpx.get(f"{server.url}/pdserve/info", timeout=5).json()
        assert info["tensor_parallel_size"] == 2
        r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "Hello there", "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] is not None
        workers = _tp_workers_of(server.proc.pid)
        assert len(workers) == 1, workers
        os.kill(workers[0], signal.SIGKILL)
        code = server.proc.wait(60)  # the engine notices, /health answers 503, the server exits
        assert code == 1, server.log()
        assert "tensor-parallel rank 1" in server.log()
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{server.url}/health", timeout=2)
    finally:
        server.stop()
