"""Engine configuration. Field names follow `vllm serve` flags where the meaning is the same."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's CacheDType names that pdserve implements (vllm/config/cache.py); pdserve.attention.fp8_kv stores them
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
# An fp8 cache row is head_dim fp8 bytes + this many bytes of scale (a bfloat16 per token and KV head)
KV_FP8_SCALE_BYTES = 2


def canonical_kv_cache_dtype(name: str) -> str:
    """`auto`, `fp8_e4m3` or `fp8_e5m2` (`fp8` means `fp8_e4m3`, as in vLLM on CUDA); ValueError otherwise."""
    key = str(name).strip().lower()
    if key not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return "fp8_e4m3" if key == "fp8" else key


# A step without decode rows may give one long prompt this many tokens on the GPU (measured on the H200:
# BENCHMARKS.md, issue 21 "Third pass": a 32k prompt at 75.9 % of the matmul rate in one step, 73.6 % in
# 8192-token chunks)
PREFILL_ONLY_CHUNK_GPU = 32768
DEFAULT_GPU_BUDGET = 8192  # max_num_batched_tokens' default on the GPU (2048 on CPU)

CPU_BLOCK_SIZE = 128
GPU_BLOCK_SIZE = 16


def default_block_size(device: str) -> int:
    """The KV block size an engine on `device` (`auto`, `cpu`, `cuda[:N]`) gets when none is given."""
    if device == "auto":
        import torch  # only here: which device `auto` means

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return CPU_BLOCK_SIZE if device == "cpu" else GPU_BLOCK_SIZE


@dataclass
class EngineConfig:
    model: str | None = None  # HF folder path or a short name of an embedded model; None = the default
    served_model_name: str | None = None
    tokenizer: str | None = None  # defaults to the model folder
    dtype: str = "auto"  # auto = config.json's torch_dtype on GPU, float32 on CPU
    device: str = "auto"  # auto = cuda if available else cpu
    load_format: str = "auto"  # auto (safetensors) | dummy (random weights in the real shapes)
    seed: int = 0
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # token budget per step (chunked prefill); default 2048 CPU / 8192 GPU
    # a step without decode rows may give one long prompt a chunk of up to this many tokens (Scheduler);
    # None: 32768 on GPU, off on CPU; 0: off
    prefill_only_chunk_tokens: int | None = None
    # tokens per KV block; None: 128 on CPU, 16 on CUDA, as vLLM picks them (vllm/platforms/cpu.py sets 128
    # when the user gave none: its CPU attention, like pdserve's, streams a head's block_size rows at once)
    block_size: int | None = None
    # vLLM's --kv-cache-dtype: auto (the model's dtype) | fp8 (= fp8_e4m3) | fp8_e4m3 | fp8_e5m2
    kv_cache_dtype: str = "auto"
    num_gpu_blocks_override: int | None = None  # fix the KV pool size in blocks (tests force tiny pools)
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gb: float = 1.0  # KV pool size on CPU when num_gpu_blocks_override is unset
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    enforce_eager: bool = False  # GPU: disable CUDA graphs
    # vLLM's --async-scheduling: launch the next decode step before this one's tokens are read (GPU graph
    # steps; pdserve.engine.runner.async_decode). None: PDSERVE_ASYNC_SCHEDULING, else async_decode.DEFAULT_ON_CUDA
    async_scheduling: bool | None = None
    attention_backend: str = "auto"  # auto | triton | triton-cudnn | flashinfer (GPU; engine.model_runner)
    warm_up: bool | None = None  # a prefill, a mixed step and decodes before serving (JIT); default: on for CUDA
    max_waiting_requests: int | None = None  # queue bound: beyond it new requests are refused (server: 503)
    kv_transfer_config: dict[str, Any] | None = None  # vLLM's --kv-transfer-config JSON
    kv_events_config: dict[str, Any] | None = None  # vLLM's --kv-events-config JSON (pdserve.kv_events)
    # KV offload tiers (pdserve.kv_offload): vLLM's --kv-offloading-size (GiB of host memory for evicted
    # blocks) and --kv-offloading-backend (native); a disk tier under a folder, bounded in GiB
    kv_offloading_size: float | None = None
    kv_offloading_backend: str | None = None
    kv_offloading_disk_path: str | None = None
    kv_offloading_disk_size: float | None = None
    # vLLM's --structured-outputs-config JSON: backend (auto | guidance), disable_any_whitespace,
    # disable_additional_properties
    structured_outputs_config: dict[str, Any] | None = None
    # vLLM's --speculative-config JSON: {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N,
    # "prompt_lookup_min": M, "disable_by_batch_size": B} (pdserve.types.speculative_config)
    speculative_config: dict[str, Any] | None = None
    tensor_parallel_size: int = 1  # ranks; > 1 starts one worker process per extra rank (pdserve.parallel)
    distributed_timeout_s: float = 120.0  # bound on every tensor-parallel collective while serving
    distributed_setup_timeout_s: float = 900.0  # bound on starting the ranks and loading their weights
    extra: dict[str, Any] = field(default_factory=dict)

    def prefill_only_chunk(self, device_type: str) -> int:
        """The longest chunk a step without decode rows may give one long prompt (0: off; Scheduler)."""
        if self.prefill_only_chunk_tokens is not None:
            return max(0, self.prefill_only_chunk_tokens)
        return PREFILL_ONLY_CHUNK_GPU if device_type == "cuda" else 0

    @property
    def kv_offloading(self) -> bool:
        return bool(self.kv_offloading_size)

    @property
    def role(self) -> str:
        """The instance's role in a P/D pair (its kv_transfer_config's kv_role), "engine" without one: a label
        for what it writes (the step log's file name)."""
        return (self.kv_transfer_config or {}).get("kv_role", "engine")

    def _check_offloading(self) -> None:
        size, backend = self.kv_offloading_size, self.kv_offloading_backend
        if backend is not None and backend != "native":
            raise ValueError(f"kv_offloading_backend {backend!r} is not available: pdserve has 'native' "
                             "(its own host-memory and disk tiers)")
        if size is not None and not size > 0:
            raise ValueError(f"kv_offloading_size must be a positive number of GiB, got {size!r}")
        if (self.kv_offloading_disk_path is not None) != (self.kv_offloading_disk_size is not None):
            raise ValueError("the disk KV tier needs both kv_offloading_disk_path and kv_offloading_disk_size")
        if self.kv_offloading_disk_size is not None and not self.kv_offloading_disk_size > 0:
            raise ValueError(f"kv_offloading_disk_size must be a positive number of GiB, got "
                             f"{self.kv_offloading_disk_size!r}")
        if (backend is not None or self.kv_offloading_disk_path is not None) and not size:
            raise ValueError("kv offloading needs kv_offloading_size (GiB of host memory; the disk tier holds "
                             "what the host tier evicts)")
        if size and not self.enable_prefix_caching:
            raise ValueError("kv offloading needs prefix caching (blocks are found again by their prefix hash)")
        if size and self.tensor_parallel_size != 1:
            raise ValueError("kv offloading is not built for tensor parallelism (tensor_parallel_size must be 1)")

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        canonical_kv_cache_dtype(self.kv_cache_dtype)  # ValueError naming the choices
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format must be auto, safetensors or dummy, got {self.load_format!r}")
        if self.block_size is None:
            self.block_size = default_block_size(self.device)
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        so = self.structured_outputs_config or {}
        unknown = set(so) - {"backend", "disable_any_whitespace", "disable_additional_properties",
                             "disable_fallback"}
        if unknown:
            raise ValueError(f"structured_outputs_config: unknown keys {sorted(unknown)}")
        if so.get("backend", "auto") not in ("auto", "guidance"):
            raise ValueError(f"structured_outputs_config.backend {so['backend']!r} is not available: the built-in "
                             "grammar engine is llguidance ('guidance'; 'auto' picks it)")
        from pdserve.types.kv_events_config import KVEventsConfig

        KVEventsConfig.from_json(self.kv_events_config)  # ValueError naming the bad key or value
        self._check_offloading()
        from pdserve.types.speculative_config import SpeculativeConfig

        SpeculativeConfig.parse(self.speculative_config)  # ValueError naming the bad key or value
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
        if self.distributed_timeout_s <= 0 or self.distributed_setup_timeout_s <= 0:
            raise ValueError("distributed timeouts must be positive")
