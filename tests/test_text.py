"""Text layer: tokenizer loading and chat templates, incremental detokenisation, stop strings, the output
processor and logprob shapes. Uses the embedded SmolLM2 tokenizer (a real byte-level BPE + chat template)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pdserve.text.chat import ChatTemplateError, detect_content_format, prepare_messages
from pdserve.text.detokenizer import IncrementalDetokenizer
from pdserve.text.logprobs import LogprobFormatter
from pdserve.text.output import OutputProcessor
from pdserve.text.stop import StopStringMatcher
from pdserve.text.tokenizer import Tokenizer, TokenizerLoadError, load_tokenizer

TEXTS = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), max_codepoint=0x1FAFF), min_size=0, max_size=60
)


@pytest.fixture(scope="module")
def smol_dir() -> Path:
    from pdserve.model.default_model import resolve_model

    return Path(resolve_model("smollm2-135m"))


@pytest.fixture(scope="module")
def tok(smol_dir: Path) -> Tokenizer:
    return load_tokenizer(smol_dir)


# ---- tokenizer ---------------------------------------------------------------------------------------
def test_loading_does_not_import_torch(smol_dir: Path) -> None:
    code = (
        "import sys\nfrom pdserve.text.tokenizer import load_tokenizer\n"
        f"t = load_tokenizer({str(smol_dir)!r})\n"
        "t.encode_chat([{'role': 'user', 'content': 'hi'}])\n"
        "from pdserve.text import output, detokenizer, stop, logprobs, chat\n"
        "import pdserve.api.openai.protocol\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_matches_autotokenizer(tok: Tokenizer, smol_dir: Path) -> None:
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(smol_dir))
    assert type(ref) is type(tok.hf)
    for text in ["Hello world", "  leading spaces\nand 日本語 🎉", "<|im_start|>user\nhi<|im_end|>"]:
        assert tok.encode(text) == ref.encode(text)
        assert tok.decode(tok.encode(text)) == ref.decode(ref.encode(text))
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)


def test_eos_ids_include_generation_config(tok: Tokenizer, smol_dir: Path, tmp_path: Path) -> None:
    assert tok.eos_token_id is not None and tok.eos_token_id in tok.eos_token_ids
    copy = tmp_path / "tok"
    copy.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol_dir / name, copy / name)
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert load_tokenizer(copy).eos_token_ids == {5, 7, tok.eos_token_id}


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(TokenizerLoadError):
        load_tokenizer(tmp_path)


def test_chat_template_rendering(tok: Tokenizer) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    text = tok.apply_chat_template(parts)
    assert "a\nb<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    no_prompt = tok.apply_chat_template(parts, add_generation_prompt=False)
    assert not no_prompt.endswith("<|im_start|>assistant\n")
    ids = tok.encode_chat(parts)
    assert ids == tok.encode(text, add_special_tokens=False)
    cont = tok.apply_chat_template(
        [*parts, {"role": "assistant", "content": "The answer is"}], add_generation_prompt=False,
        continue_final_message=True,
    )
    assert cont.endswith("The answer is")
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template(parts, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([])
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"content": "no role"}])


def test_no_chat_template_is_a_client_error(tok: Tokenizer) -> None:
    bare = Tokenizer(tok.hf, tok.path)
    bare.chat_template = None
    with pytest.raises(ChatTemplateError, match="chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


def test_content_format_detection() -> None:
    string_tpl = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    openai_tpl = "{% for m in messages %}{% for c in m['content'] %}{{ c['text'] }}{% endfor %}{% endfor %}"
    assert detect_content_format(string_tpl) == "string"
    assert detect_content_format(openai_tpl) == "openai"
    msgs = prepare_messages([{"role": "user", "content": "x"}], "openai")
    assert msgs[0]["content"] == [{"type": "text", "text": "x"}]
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]}
    out = prepare_messages([call], "string")[0]
    assert out["content"] == "" and out["tool_calls"][0]["function"]["arguments"] == {"a": 1}


# ---- detokenizer -------------------------------------------------------------------------------------
def _detok_all(tok: Tokenizer, prompt: list[int], ids: list[int], skip: bool = True) -> str:
    d = IncrementalDetokenizer(tok, prompt, skip)
    return "".join(d.step(t) for t in ids) + d.flush()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXTS, prompt=TEXTS)
def test_detokenizer_reproduces_text(tok: Tokenizer, text: str, prompt: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert _detok_all(tok, tok.encode(prompt, add_special_tokens=False), ids) == tok.decode(ids)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_detokenizer_random_ids_match_window_decode(tok: Tokenizer, data: st.DataObject) -> None:
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), min_size=1, max_size=30))
    prompt = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), min_size=1, max_size=8))
    skip = data.draw(st.booleans())
    ctx = [t for t in prompt if not (skip and t in tok.special_token_ids)][-5:]
    full = tok.decode_window(ctx + ids, skip)
    head = tok.decode_window(ctx, skip)
    # A context that ends inside a multi-byte character decodes to U+FFFD, which the next id may complete:
    # then no prefix property holds, for any detokenizer.
    assume(not head.endswith("\ufffd"))
    assert full.startswith(head)
    assert _detok_all(tok, prompt, ids, skip) == full[len(head):]


def test_detokenizer_holds_back_partial_characters(tok: Tokenizer) -> None:
    ids = tok.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1  # the emoji is split over byte tokens
    d = IncrementalDetokenizer(tok, tok.encode("x", add_special_tokens=False))
    pieces = [d.step(t) for t in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == "🎉"


def test_detokenizer_skips_special_tokens(tok: Tokenizer) -> None:
    eos = tok.eos_token_id
    assert eos is not None
    ids = tok.encode("a b", add_special_tokens=False)
    assert _detok_all(tok, [1], [*ids, eos] * 3, skip=True) == tok.decode([*ids, eos] * 3, skip_special_tokens=True)
    assert "<|im_end|>" in _detok_all(tok, [1], [*ids, eos], skip=False)


# ---- stop strings ------------------------------------------------------------------------------------
def _reference_stop(chunks: list[str], stops: list[str], include: bool) -> tuple[str, str | None]:
    """vLLM's semantics: after each chunk, the first stop string (in list order) present in the text wins."""
    text = ""
    for chunk in chunks:
        text += chunk
        for s in stops:
            i = text.find(s)
            if i != -1:
                return (text[: i + len(s)] if include else text[:i]), s
    return text, None


@settings(max_examples=300, deadline=None)
@given(
    chunks=st.lists(st.text(alphabet="abc", min_size=0, max_size=4), max_size=12),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=3), min_size=1, max_size=3),
    include=st.booleans(),
)
def test_stop_matcher_against_reference(chunks: list[str], stops: list[str], include: bool) -> None:
    m = StopStringMatcher(stops, include)
    text, emitted, hit = "", "", None
    for chunk in chunks:
        text += chunk
        found = m.check(text, len(chunk))
        if found is not None:
            hit, cut = found
            text = text[:cut]
            emitted += text[len(emitted):]
            break
        end = max(len(text) - m.holdback, len(emitted))
        emitted += text[len(emitted):end]
    else:
        emitted += text[len(emitted):]
    ref_text, ref_hit = _reference_stop(chunks, stops, include)
    assert (text, hit) == (ref_text, ref_hit)
    assert emitted == ref_text  # nothing shown was ever taken back


def test_stop_matcher_rejects_empty() -> None:
    with pytest.raises(ValueError):
        StopStringMatcher(["a", ""])


# ---- output processor --------------------------------------------------------------------------------
@dataclass
class Out:
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list | None = None


@dataclass
class Lp:
    token_id: int
    logprob: float
    rank: int = 1
    top: list = field(default_factory=list)


def _run(proc: OutputProcessor, outs: list[Out]) -> tuple[str, list]:
    text, deltas = "", []
    for o in outs:
        d = proc.process(o)
        text += d.text
        deltas.append(d)
        if d.finished:
            break
    return text, deltas


def test_output_stop_string_cuts_text_and_tokens(tok: Tokenizer) -> None:
    ids = tok.encode(" one two three four five", add_special_tokens=False)
    proc = OutputProcessor(tok, [1], stop=["three"])
    outs = [Out([t]) for t in ids[:-1]] + [Out([ids[-1]], True, "length")]
    text, deltas = _run(proc, outs)
    assert text == " one two " and proc.text == text
    assert deltas[-1].stop_string_hit and deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == "three"
    assert tok.decode(proc.token_ids).startswith(" one two three")
    assert len(proc.token_ids) < len(ids)


def test_output_stop_string_in_a_multi_token_delta(tok: Tokenizer) -> None:
    ids = tok.encode(" one two three four five", add_special_tokens=False)
    proc = OutputProcessor(tok, [1], stop=["two"], include_stop_str_in_output=True)
    d = proc.process(Out(ids, False, None, None, [Lp(t, -1.0) for t in ids]))
    assert d.text == " one two" and d.stop_string_hit
    assert len(d.token_ids) == len(d.logprobs) < len(ids)


def test_output_eos_text_excluded_but_id_kept(tok: Tokenizer) -> None:
    eos = tok.eos_token_id
    ids = tok.encode(" hi", add_special_tokens=False)
    proc = OutputProcessor(tok, [1], skip_special_tokens=False)
    text, _ = _run(proc, [Out(ids), Out([eos], True, "stop", None)])
    assert text == " hi" and proc.token_ids == [*ids, eos]
    proc = OutputProcessor(tok, [1], skip_special_tokens=False, include_stop_str_in_output=True)
    text, _ = _run(proc, [Out(ids), Out([eos], True, "stop", None)])
    assert text == " hi<|im_end|>"


def test_output_min_tokens_delays_stop_strings(tok: Tokenizer) -> None:
    ids = tok.encode(" stop stop stop", add_special_tokens=False)
    proc = OutputProcessor(tok, [1], stop=["stop"], min_tokens=len(ids))
    text, _ = _run(proc, [Out([t]) for t in ids])
    assert proc.finish_reason == "stop" and len(proc.token_ids) == len(ids)
    assert text == " stop stop "


# ---- logprobs ----------------------------------------------------------------------------------------
def test_logprob_shapes(tok: Tokenizer) -> None:
    fmt = LogprobFormatter(tok.token_text)
    a, b = tok.encode(" hello world", add_special_tokens=False)[:2]
    lps = [Lp(a, -0.5, 1, [(a, -0.5), (b, -1.0)]), Lp(b, float("-inf"), 3, [(a, -0.1), (7, float("nan"))])]
    comp = fmt.completion([a, b], lps, 1, 4)
    assert comp["tokens"] == [tok.decode([a]), tok.decode([b])]
    assert comp["token_logprobs"] == [-0.5, -9999.0]
    assert comp["text_offset"] == [4, 4 + len(comp["tokens"][0])]
    assert comp["top_logprobs"][0] == {tok.decode([a]): -0.5}
    assert comp["top_logprobs"][1] == {tok.decode([b]): -9999.0, tok.decode([a]): -0.1}
    chat = fmt.chat(lps, 2)["content"]
    assert chat[0]["token"] == tok.decode([a]) and chat[0]["bytes"] == list(tok.decode([a]).encode())
    assert [e["logprob"] for e in chat[1]["top_logprobs"]] == [-0.1, -9999.0]
    assert LogprobFormatter(tok.token_text, True).completion([a], [lps[0]], 0)["tokens"] == [f"token_id:{a}"]
