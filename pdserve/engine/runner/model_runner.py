"""Builds each step's flattened batch, runs the decoder over the paged KV pool and samples.

Decides *how* a step runs, never *what* runs (that is the scheduler's job).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from pdserve.attention import fp8_kv
from pdserve.attention.base import AttentionMetadata
from pdserve.engine.request import Request
from pdserve.engine.runner.host_batch import HostBatch
from pdserve.engine.runner.sampler import Sampler
from pdserve.engine.runner.step_timing import StepTiming
from pdserve.engine.runner.tp_messages import CpuStep, StepMessage, UseGpuStepRunner
from pdserve.kv_transfer.compat import HEAD_MAJOR_LAYOUT, POOL_LAYOUT
from pdserve.model.config import ModelConfig
from pdserve.model.kv_scales import use_checkpoint_kv_scales
from pdserve.model.loader import build_model
from pdserve.types.engine_config import DEFAULT_GPU_BUDGET, EngineConfig
from pdserve.types.outputs import TokenLogprob

if TYPE_CHECKING:
    from pdserve.engine.runner.step_runner import LaunchedDecode
    from pdserve.parallel.comm import TPGroup

log = logging.getLogger("pdserve.engine")


class RankWorkers(Protocol):
    """What the runner asks of the processes of ranks 1..N-1 (tp_executor.TPWorkers sets itself here; the
    runner does not import the executor, which imports the runner)."""

    def check_alive(self) -> None: ...

    def shutdown(self) -> None: ...

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# what the CPU attention kernels take as int32 (the rest of a step's inputs are int64)
_INT32_SEGMENTS = ("query_start_loc", "seq_lens", "block_tables")


def resolve_device(name: str) -> torch.device:
    """`auto`, `cpu`, `cuda` or `cuda:N`; a ValueError (one readable line) for anything this machine lacks."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device (expected auto, cpu, cuda or cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available here (torch {torch.__version__}, "
                         f"CUDA {torch.version.cuda or 'not compiled in'}); use --device cpu or auto")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name}: only cpu and cuda are supported")
    return device


def resolve_dtype(name: str, model_cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # exact against HF on CPU, and CPU bf16 matmuls are not faster here
    dtype = _DTYPES.get(model_cfg.torch_dtype, torch.bfloat16)
    return torch.bfloat16 if dtype == torch.float32 else dtype


ATTENTION_BACKENDS = ("auto", "triton", "triton-cudnn", "flashinfer")


def select_attention_backend(device: torch.device, kv_format: fp8_kv.Fp8Format | None = None,
                             name: str = "auto", dtype: torch.dtype | None = None):
    """auto: on CUDA the Triton kernels, with long prefill chunks on cuDNN where its attention runs
    (pdserve/attention/long_prefill.py); on CPU the paged C kernel. triton / triton-cudnn: force either.
    flashinfer (optional package): prefill steps without long chunks on FlashInfer's paged kernel, the rest
    as triton-cudnn (pdserve/attention/flashinfer_backend.py); dtype: the model's, which it must support.
    An fp8 KV cache (kv_format): the Triton kernels read and write it themselves; the backends that read
    only float caches (CPU, the torch reference) are wrapped in Fp8GatherAttention."""
    if name == "flashinfer":
        check_attention_backend(name, device, dtype, kv_format)
        from pdserve.attention import long_prefill  # GPU-only, imported lazily
        from pdserve.attention.flashinfer_backend import FlashInferAttention

        cudnn = long_prefill.cudnn_usable(device)  # long chunks: cuDNN partials measured faster than FlashInfer
        return FlashInferAttention(device, long_prefill=long_prefill.LongPrefillConfig() if cudnn else None)
    backend = _kernel_backend(device, name, kv_format)
    if kv_format is not None and getattr(backend, "kv_format", None) is None:
        from pdserve.attention.fp8_gather import Fp8GatherAttention

        return Fp8GatherAttention(backend, kv_format)
    return backend


def check_attention_backend(name: str, device: torch.device, dtype: torch.dtype | None = None,
                            kv_format: fp8_kv.Fp8Format | None = None) -> None:
    """What can be refused before the weights load: an unknown name; for flashinfer a missing package (named
    first, even where the device is wrong too), a CPU device, an fp8 KV cache or a float32 model."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "flashinfer":
        from pdserve.attention import flashinfer_support as fis

        fis.import_flashinfer()
        fis.check_usable(device, dtype, kv_format)


def _kernel_backend(device: torch.device, name: str = "auto", kv_format: fp8_kv.Fp8Format | None = None):
    """The device's attention kernels (the Triton ones take kv_format themselves)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if device.type == "cuda":
        try:
            from pdserve.attention import long_prefill  # GPU-only, imported lazily
            from pdserve.attention.triton_backend import TritonAttention
        except ImportError:
            log.warning("GPU attention kernels unavailable; using the torch SDPA reference backend")
            from pdserve.attention.torch_ref import TorchAttention

            return TorchAttention()
        use_cudnn = name == "triton-cudnn" or (name == "auto" and long_prefill.cudnn_usable(device))
        if name == "triton-cudnn" and not long_prefill.cudnn_usable(device):
            raise ValueError("--attention-backend triton-cudnn: cuDNN's fused attention does not run here")
        return TritonAttention(long_prefill=long_prefill.LongPrefillConfig() if use_cudnn else None,
                               kv_format=kv_format)
    if name != "auto":
        raise ValueError(f"--attention-backend {name} needs a CUDA device")
    from pdserve.attention.cpu_paged import CpuPagedAttention
    from pdserve.cpu import native

    return CpuPagedAttention(native.load())


class ModelRunner:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, model_dir: Path | None,
                 tp: TPGroup | None = None, extra_block_bytes: int = 0):
        """tp: this rank's tensor-parallel group (None: one process, no collectives). Every rank builds a
        ModelRunner over its shard; rank 0's runs in the engine process and forwards each step's inputs to
        the others (`step_sink`), which replay them (`replay`). extra_block_bytes: memory another pool
        indexed by the same block ids takes per block (a speculative draft model's KV), sized in with it."""
        self.config = config
        self.extra_block_bytes = extra_block_bytes
        self.model_cfg = model_cfg
        self.tp = tp
        # ranks 1..N-1 when this is rank 0 of a TP group (set by pdserve.engine.runner.tp_executor)
        self.workers: RankWorkers | None = None
        self.step_sink: Callable[[StepMessage], None] | None = None
        # layer-pipelined push: for a step's batch, a per-layer callback (KVConnector.step_hook), on either path
        # (the GPU step runner runs such a step eagerly; the callback records a CUDA event per layer)
        self.layer_hook: Callable[[list], Callable[[int], None] | None] | None = None
        self.device = resolve_device(config.device) if tp is None else tp.device
        if self.device.type == "cuda" and "OMP_NUM_THREADS" not in os.environ:
            # The host only stages inputs here; a full-width OpenMP pool per server process makes
            # instances sharing a host (collocated replicas, P next to D) spin against each other.
            log.info("reducing torch CPU threads from %d to 1 (set OMP_NUM_THREADS to choose)",
                     torch.get_num_threads())
            torch.set_num_threads(1)
        self.dtype = resolve_dtype(config.dtype, model_cfg, self.device)
        # None: KV in the model's dtype; else the pool is uint8 blocks of fp8 values and their scales (fp8_kv)
        self.kv_format = fp8_kv.fp8_format(config.kv_cache_dtype)
        check_attention_backend(config.attention_backend, self.device, self.dtype, self.kv_format)  # before loading
        self.block_size = config.block_size
        torch.manual_seed(config.seed)
        self.model = build_model(model_cfg, model_dir, self.dtype, self.device, config.load_format, config.seed,
                                 tp=tp)
        self.num_kv_heads = self.model.shard.kv_heads  # this rank's share of the KV heads
        self.cpu_threads = None
        self.last_step_threads: int | None = None  # the torch threads the last CPU step ran on (the step log's)
        if self.device.type == "cpu":
            from pdserve.cpu.allocator import keep_freed_memory
            from pdserve.cpu.packed_linear import pack_linears
            from pdserve.cpu.threads import StepThreads

            keep_freed_memory()  # steps reuse freed activation memory instead of faulting fresh pages in
            pack_linears(self.model, self.dtype)
            self.cpu_threads = StepThreads.from_env()
            log.info("CPU threads: %s", self.cpu_threads)
        # the checkpoint's static k_scale/v_scale for an fp8 pool, else per-row scales (logged; /pdserve/info)
        self.kv_scales_source = use_checkpoint_kv_scales(self.model, self.kv_format)
        self.backend = select_attention_backend(self.device, self.kv_format, config.attention_backend, self.dtype)
        # the fused CPU ops store K/V into a float pool themselves: an fp8 pool takes the plain path
        if (self.device.type == "cpu" and self.dtype == torch.float32 and self.kv_format is None
                and self.backend.lib is not None):
            from pdserve.cpu.ops import CpuOps

            self.model.fused_ops = CpuOps(self.backend.lib, self.backend)
        # A CPU float pool keeps each (layer, K|V) region of a block head-major, as vLLM's CPU backend
        # does (vllm/v1/attention/backends/cpu_attn.py: [num_blocks, num_kv_heads, block_size, head_size]):
        # the paged decode kernel then streams one run of block_size * head_dim values per head. Token-major
        # regions gave it a head's rows 256 B at a time, every num_kv_heads rows, which it read from DRAM
        # at half the rate (benchmarks/bench_cpu_kv_layout.py on the 2-core EPYC box, batch 4 x 576 keys x 30
        # layers of SmolLM2: 15.4 ms a step token-major in blocks of 16, 9.3 ms head-major in blocks of 128,
        # 12.7 ms token-major in 128). GPU kernels are written for token-major
        # (vLLM's NHD), and the fp8 format lays out its regions itself (pdserve.attention.fp8_kv).
        self.kv_layout = HEAD_MAJOR_LAYOUT if self.device.type == "cpu" and self.kv_format is None else POOL_LAYOUT
        self.num_blocks = self._decide_num_blocks()
        # The block-contiguous pool: one block spans every layer, so one NIXL descriptor moves one block.
        # torch.zeros touches every page now, not during the first transfer.
        self.kv_pool = torch.zeros(self.pool_shape(self.num_blocks), dtype=self.kv_storage_dtype, device=self.device)
        # What the model and the attention backends index: [block, layer, K|V, token, head, dim] over the
        # pool's memory whatever its layout (a head-major pool as a transposed view: the kernels take strides).
        self.kv_cache = self.kv_pool.transpose(3, 4) if self.kv_layout == HEAD_MAJOR_LAYOUT else self.kv_pool
        self.sampler = Sampler(config.seed)
        # CUDA: fused kernels, pinned batched inputs, decode CUDA graphs, greedy argmax on the device.
        self.gpu = None
        self._cpu_timing = StepTiming()  # stays zero: the CPU path has no graphs and no device to wait on
        if self.device.type == "cuda":
            self.use_gpu_step_runner()

    def use_gpu_step_runner(self, simulate_graphs: bool = False) -> None:
        """Run steps through the CUDA path (on CPU too with simulate_graphs, for tests), built from this
        runner's model, pool, attention backend and sampler."""
        from pdserve.engine.runner.step_runner import GpuStepRunner  # GPU-only, imported lazily
        from pdserve.types.speculative_config import SpeculativeConfig

        cfg = self.config
        if self.step_sink is not None:
            # rank 0: the other ranks switch first; graph capture runs collectives, which every rank must join
            self.step_sink(UseGpuStepRunner(simulate_graphs))
        spec = SpeculativeConfig.parse(cfg.speculative_config)
        self.gpu = GpuStepRunner(
            self.model, self.kv_cache, self.backend, self.sampler, block_size=self.block_size,
            max_num_seqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len or self.model_cfg.max_position_embeddings,
            enforce_eager=cfg.enforce_eager or not getattr(self.backend, "supports_graphs", True),
            simulate_graphs=simulate_graphs, num_spec_tokens=spec.num_speculative_tokens if spec else 0)
        self.gpu.step_sink = self.step_sink

    def set_step_sink(self, sink: Callable[[StepMessage], None] | None) -> None:
        """Rank 0 of a TP group: `sink(message)` hands each step's inputs to the other ranks before this
        rank runs it."""
        self.step_sink = sink
        if self.gpu is not None:
            self.gpu.step_sink = sink

    def replay(self, msg: StepMessage) -> None:
        """Ranks 1..N-1: run the step rank 0 described (their outputs are rank 0's through the collectives)."""
        if isinstance(msg, CpuStep):
            if self.cpu_threads is not None:
                self.cpu_threads.apply(int(msg.input_ids.shape[0]))
            with torch.inference_mode():
                self._forward_cpu(msg.input_ids, msg.positions, msg.meta, msg.rows)
        elif isinstance(msg, UseGpuStepRunner):
            self.use_gpu_step_runner(simulate_graphs=msg.simulate_graphs)
        else:
            assert self.gpu is not None, f"{type(msg).__name__} for a rank without the GPU step runner"
            self.gpu.replay(msg)

    def observe_idle(self) -> None:
        """Called while the engine idles between steps (CPU: the step threads' spare-core window)."""
        if self.cpu_threads is not None:
            self.cpu_threads.observe()

    def check_alive(self) -> None:
        """Raises when a tensor-parallel worker rank has died (a no-op with one rank)."""
        if self.workers is not None:
            self.workers.check_alive()

    def shutdown(self) -> None:
        if self.workers is not None:
            self.workers.shutdown()
            self.workers = None

    @property
    def step_timing(self) -> StepTiming:
        """Accumulated host-side step counters (graph steps, time waiting on the device); reset() them."""
        return self.gpu.timing if self.gpu is not None else self._cpu_timing

    # ---- sizing ------------------------------------------------------------------------------
    @property
    def kv_storage_dtype(self) -> torch.dtype:
        """The pool's element type: the model's dtype, or uint8 bytes for an fp8 cache."""
        return self.dtype if self.kv_format is None else torch.uint8

    @property
    def kv_cache_dtype(self) -> str:
        """What the KV cache stores, as /pdserve/info and the handshake name it."""
        return str(self.dtype).removeprefix("torch.") if self.kv_format is None else self.kv_format.name

    @property
    def kv_scales(self) -> str:
        """Where the KV cache's quantization scales live (`none` for an unquantized cache)."""
        return "none" if self.kv_format is None else fp8_kv.SCALE_SCHEME

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        c = self.model_cfg
        row = c.head_dim if self.kv_format is None else self.kv_format.row_bytes(c.head_dim)
        if self.kv_layout == HEAD_MAJOR_LAYOUT:
            return (num_blocks, c.num_layers, 2, self.num_kv_heads, self.block_size, row)
        return (num_blocks, c.num_layers, 2, self.block_size, self.num_kv_heads, row)

    @property
    def block_bytes(self) -> int:
        elem = torch.tensor([], dtype=self.kv_storage_dtype).element_size()
        n = 1
        for dim in self.pool_shape(1):
            n *= dim
        return n * elem

    def _decide_num_blocks(self) -> int:
        if self.config.num_gpu_blocks_override:
            return self.config.num_gpu_blocks_override
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            # Blocks the caching allocator kept from loading (a dummy or converted weight's temporaries) are
            # free memory, not this instance's: hand them back before measuring, or instances sharing a GPU
            # each count the other's cache as used.
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            # A per-instance share of the GPU, as vLLM's flag means it: other processes on the same GPU
            # (a P next to its D) count only through what is actually free.
            own = torch.cuda.memory_reserved(self.device)
            budget = min(total * self.config.gpu_memory_utilization - own, free)
            budget -= 2 * 1024**3  # headroom for activations, CUDA graphs and the CUDA context
            budget -= self._extra_activation_bytes()
        else:
            budget = self.config.cpu_kv_cache_gb * 1024**3
        blocks = int(budget // (self.block_bytes + self.extra_block_bytes))
        if self.tp is not None:
            blocks = self.tp.min_int(blocks)  # one block table drives every rank: the tightest one decides
        if blocks < 1:
            detail = ""
            if self.device.type == "cuda":
                detail = (f" (GPU free {free / 2**30:.1f} of {total / 2**30:.1f} GiB, this process holds "
                          f"{own / 2**30:.1f} GiB, share {self.config.gpu_memory_utilization:g})")
            raise RuntimeError("no memory left for the KV cache; lower the model size or raise the memory budget"
                               + detail)
        return blocks

    def _extra_activation_bytes(self) -> int:
        """Activations of the largest step beyond what a step of the default GPU budget needs (which the fixed
        headroom covers): a step of up to max(max_num_batched_tokens, prefill_only_chunk) tokens holds ~4
        hidden-sized rows, q/k/v and 3 MLP-intermediate rows per token at once."""
        cfg, c = self.config, self.model_cfg
        largest = max(cfg.max_num_batched_tokens or DEFAULT_GPU_BUDGET, cfg.prefill_only_chunk(self.device.type))
        elem = torch.tensor([], dtype=self.dtype).element_size()
        per_token = elem * (4 * c.hidden_size + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
                            + 3 * c.intermediate_size)
        return max(0, largest - DEFAULT_GPU_BUDGET) * per_token

    @property
    def layout(self) -> str:
        """The pool's memory order, as the KV handshake names it (`kv_transfer.compat`)."""
        return self.kv_layout

    # ---- one step ----------------------------------------------------------------------------
    def _prepare(self, batch: list[tuple[Request, int]], rows: list[int] | None = None,
                 ) -> tuple[HostBatch, torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step's flattened batch (HostBatch, as the GPU step runner builds it; `rows` as there) and its input
        ids, positions and attention metadata as the CPU kernels take them: block tables zero-padded, each
        segment its own tensor (a tensor-parallel step message then carries the step's values, not the whole
        buffer)."""
        buf = np.zeros(HostBatch.max_size_of(batch, self.block_size), dtype=np.int64)
        hb = HostBatch(batch, self.block_size, buf, rows=rows)

        def segment(name: str) -> torch.Tensor:
            dtype = torch.int32 if name in _INT32_SEGMENTS else torch.int64
            return torch.from_numpy(hb.view(buf, name)).to(self.device, dtype, copy=True)

        return hb, segment("ids"), segment("positions"), hb.shape().attention_metadata(segment, self.block_size)

    # ---- async scheduling (pdserve.engine.runner.async_decode) -----------------------------------------
    @property
    def can_launch_async(self) -> bool:
        """Decode steps can be launched before the previous one's tokens are read (the GPU step path with
        graphs, one rank); the CPU path has no device to overlap with."""
        return self.gpu is not None and self.gpu.can_launch_async

    def launch_decode(self, reqs: list[Request], positions: list[int], prev: LaunchedDecode | None = None,
                      src_rows: list[int] | None = None) -> LaunchedDecode | None:
        """GpuStepRunner.launch_decode (None: nothing launched)."""
        assert self.gpu is not None
        return self.gpu.launch_decode(reqs, positions, prev, src_rows)

    def collect_decode(self, launched: LaunchedDecode) -> list[int]:
        """The launched step's tokens, once on the host (GpuStepRunner.collect_decode)."""
        assert self.gpu is not None
        return self.gpu.collect_decode(launched)

    @torch.inference_mode()
    def execute(self, batch: list[tuple[Request, int]]) -> tuple[list[Request], list[int], list[TokenLogprob | None]]:
        """Runs the step; returns the requests that reached their frontier, their sampled tokens and
        logprobs. Requests mid-way through a chunked prefill sample nothing."""
        # push transfer: the step's push jobs are linked to their requests here, and the per-layer callback
        # (layer-pipelined push) goes to the forward on either path
        on_layer = self.layer_hook(batch) if self.layer_hook is not None else None
        if self.gpu is not None:
            return self.gpu.execute(batch, on_layer)
        started = time.perf_counter()
        sampling, logits = self._run_cpu(batch, on_layer)
        if logits is None:
            return [], [], []
        tokens, logprobs = self.sampler.sample(logits, sampling)
        self._record_cpu_step(batch, started)
        return sampling, tokens, logprobs

    @torch.inference_mode()
    def execute_logits(self, batch: list[tuple[Request, int]]) -> tuple[list[Request], torch.Tensor | None]:
        """Runs the step without sampling: the requests at their frontier and the raw logits of their rows
        (spec_decode.rows: k + 1 rows for a request verifying k drafts), for the speculative decoding
        rejection sampler. On the GPU an eager step (execute_verify takes the verify graphs)."""
        if self.gpu is not None:
            return self.gpu.execute_logits(batch)
        started = time.perf_counter()
        out = self._run_cpu(batch)
        self._record_cpu_step(batch, started)
        return out

    @torch.inference_mode()
    def execute_verify(self, batch: list[tuple[Request, int]],
                       ) -> tuple[list[Request], torch.Tensor | None, list[int] | None]:
        """A speculative verify step: execute_logits' requests and logits, plus the rows' raw argmax ids where
        the GPU's verify graph computed them for a batch that needs nothing else (else None). On the GPU from
        the verify CUDA graphs where the step fits one (pdserve.engine.runner.verify_graphs)."""
        if self.gpu is not None:
            return self.gpu.execute_verify(batch)
        reqs, logits = self.execute_logits(batch)
        return reqs, logits, None

    def _run_cpu(self, batch: list[tuple[Request, int]], on_layer: Callable[[int], None] | None = None,
                 ) -> tuple[list[Request], torch.Tensor | None]:
        """The step's forward: (requests at their frontier, logits of their rows), None when none samples.
        Rows that give prompt logprobs come first in the forward (every TP rank gathers the same rows); their
        logprobs are recorded on their requests here, so callers see only the sampling rows."""
        if self.cpu_threads is not None:
            self.last_step_threads = self.cpu_threads.apply(sum(n for _, n in batch))
        hb, input_ids, positions, meta = self._prepare(batch)
        if self.step_sink is not None:
            self.step_sink(CpuStep(input_ids, positions, meta, hb.rows))
        logits = self._forward_cpu(input_ids, positions, meta, hb.rows, on_layer)
        return hb.sampling, hb.sampling_logits(logits)

    def _record_cpu_step(self, batch: list[tuple[Request, int]], started: float) -> None:
        if self.cpu_threads is not None and self.last_step_threads is not None:
            self.cpu_threads.record(sum(n for _, n in batch), self.last_step_threads, time.perf_counter() - started)

    def _forward_cpu(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                     rows: list[int], on_layer: Callable[[int], None] | None = None) -> torch.Tensor | None:
        """The model over one step's flattened batch; logits of `rows` (None when no row samples)."""
        hidden = self.model(input_ids, positions, self.kv_cache, meta, self.backend, on_layer)
        if not rows:
            return None
        return self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
