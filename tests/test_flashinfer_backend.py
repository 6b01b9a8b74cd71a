"""`--attention-backend flashinfer` where FlashInfer is not installed (CPU CI): the flag is accepted by
`pdserve serve`, `pdserve up` and `LLM(...)`, refused at start-up with one line naming the missing package
(before any weights load), refused for what the backend cannot serve, and the page table it plans a step from
matches the engine's block tables. Its kernels (vs our Triton path and float32 SDPA) and speed are measured
on the H200 by benchmarks/gpu_suite.py (BENCHMARKS.md, issue 21)."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest
import torch
from server_utils import free_port, make_model_dir
from test_input_hardening import one_error_line, pdserve

from pdserve.attention import flashinfer_support as fis
from pdserve.attention.fp8_kv import fp8_format
from pdserve.attention.long_prefill import LongPrefillConfig, plan_chunks
from pdserve.engine.runner.model_runner import check_attention_backend, select_attention_backend
from pdserve.testing.gpu_correctness import make_paged_case

flashinfer_missing = pytest.mark.skipif(importlib.util.find_spec("flashinfer") is not None,
                                        reason="FlashInfer is installed here: the missing-package path cannot run")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("flashinfer"))


@flashinfer_missing
def test_a_missing_package_is_named_before_anything_else() -> None:
    # named first, even on a CPU device, which the backend would refuse too
    for call in (lambda: select_attention_backend(torch.device("cpu"), None, "flashinfer", torch.bfloat16),
                 lambda: check_attention_backend("flashinfer", torch.device("cpu"))):
        with pytest.raises(ValueError, match=r"needs the flashinfer-python package.*pip install flashinfer-python==0\.7\.4"):
            call()


def test_what_the_backend_cannot_serve_is_refused() -> None:
    with pytest.raises(ValueError, match="needs a CUDA device"):
        fis.check_usable(torch.device("cpu"), torch.bfloat16, None)
    with pytest.raises(ValueError, match=r"fp8 KV cache \(--kv-cache-dtype fp8\*\) needs --attention-backend triton"):
        fis.check_usable(torch.device("cuda"), torch.bfloat16, fp8_format("fp8"))
    with pytest.raises(ValueError, match="runs bf16/fp16 models, not torch.float32"):
        fis.check_usable(torch.device("cuda"), torch.float32, None)
    fis.check_usable(torch.device("cuda"), torch.float16, None)  # what it serves (a device object needs no GPU)
    with pytest.raises(ValueError, match="must be one of"):
        check_attention_backend("flash-attn", torch.device("cpu"))


def test_paged_plan_inputs_follow_the_block_tables() -> None:
    # a partial last page, an exactly full one, a decode row, and a table wider than every sequence needs
    q_lens, seq_lens = [5, 1, 40, 16], [37, 16, 40, 32]
    c = make_paged_case(q_lens, seq_lens, 4, 2, 8, block_size=16, dtype=torch.float32, device="cpu", seed=1,
                        table_width=7)
    qo_indptr, kv_indptr, last_page_len, positions = fis.paged_plan_inputs(c.meta)
    assert qo_indptr.dtype == kv_indptr.dtype == last_page_len.dtype == torch.int32
    assert qo_indptr.tolist() == [0, 5, 6, 46, 62]
    assert kv_indptr.tolist() == [0, 3, 4, 7, 9]
    assert last_page_len.tolist() == [5, 16, 8, 16]
    pages = c.meta.block_tables.reshape(-1)[torch.from_numpy(positions)].tolist()
    want = [b for i, s in enumerate(seq_lens) for b in c.meta.block_tables[i, : (s + 15) // 16].tolist()]
    assert pages == want and len(set(pages)) == len(pages)  # each sequence's own blocks, in order


@flashinfer_missing
def test_serve_refuses_with_one_line_before_loading(model_dir: Path) -> None:
    out = pdserve("serve", str(model_dir), "--port", str(free_port()), "--attention-backend", "flashinfer")
    assert out.returncode == 1
    assert "flashinfer-python" in one_error_line(out, "pdserve serve: error:")


@flashinfer_missing
def test_llm_refuses_before_loading(model_dir: Path) -> None:
    from pdserve.llm import LLM

    with pytest.raises(ValueError, match="flashinfer-python"):
        LLM(str(model_dir), attention_backend="flashinfer", device="cpu")


def test_up_passes_the_backend_to_every_instance() -> None:
    from pdserve.launch.cli import add_arguments, config_from_args
    from pdserve.launch.spec import build_deployment

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = config_from_args(parser.parse_args(["m", "--gpus", "none", "--attention-backend", "flashinfer"]))
    dep = build_deployment(cfg, cpus=[0, 1], env={})
    assert dep.instances
    for inst in dep.instances:
        assert inst.argv[inst.argv.index("--attention-backend") + 1] == "flashinfer", inst.name
    plain = build_deployment(config_from_args(parser.parse_args(["m", "--gpus", "none"])), cpus=[0, 1], env={})
    assert not any("--attention-backend" in s.argv for s in plain.instances)


def test_which_steps_go_to_flashinfer() -> None:
    """Decode and tiny steps stay on Triton; with cuDNN's long-prefill path configured, steps with a chunk it
    plans take that path (measured faster there), every other prefill step FlashInfer."""
    def meta(q_lens: list[int], seq_lens: list[int]):
        return make_paged_case(q_lens, seq_lens, 2, 1, 8, dtype=torch.float32, device="cpu", spare_blocks=0).meta

    def takes(m, cfg, bar: float = 0.0) -> bool:  # Llama-3.1-8B's 32 heads of 128
        return fis.takes_flashinfer(m, cfg, 32, 128, bar)

    cudnn = LongPrefillConfig()
    for cfg in (None, cudnn):
        assert not takes(meta([1, 1], [300, 40]), cfg)  # decode
        assert not takes(meta([64, 1], [64, 40]), cfg)  # at most TRITON_MAX_Q query tokens
        assert takes(meta([65, 1], [100, 40]), cfg)
        assert takes(meta([512] * 8, [2048] * 8), cfg, fis.FLASHINFER_MIN_LAYER_FLOPS)  # FlashInfer's best shape
        # too little work to pay for the per-step plan
        assert not takes(meta([512, 1], [2048, 40]), cfg, fis.FLASHINFER_MIN_LAYER_FLOPS)
    fresh, chunk = meta([8192], [8192]), meta([8192, 1], [32768, 50])
    assert takes(fresh, None) and takes(chunk, None)
    assert not takes(fresh, cudnn) and not takes(chunk, cudnn)
    # long enough for the long-prefill path, but no piece it would plan (no aligned context, padding too dear)
    odd = meta([2050], [2150])
    assert not plan_chunks(odd, cudnn.min_q, cudnn.ctx_align, cudnn.q_bucket)
    assert takes(odd, cudnn)


def test_step_attention_flops_is_the_causal_count() -> None:
    from pdserve.attention.long_prefill import causal_chunk_flops

    m = make_paged_case([512, 1, 100], [2048, 40, 100], 2, 1, 8, dtype=torch.float32, device="cpu").meta
    want = sum(causal_chunk_flops(32, 128, q, s) for q, s in ((512, 2048), (1, 40), (100, 100)))
    assert fis.step_attention_flops(m, 32, 128) == want
    # the bar sits between a lone 512-token chunk and eight of them (BENCHMARKS.md's shape)
    assert causal_chunk_flops(32, 128, 512, 2048) < fis.FLASHINFER_MIN_LAYER_FLOPS < 8 * causal_chunk_flops(
        32, 128, 512, 2048)
