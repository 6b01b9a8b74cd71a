"""The offline API as a vLLM user calls it: prompt forms, skip_tokenizer_init, chat, n, use_tqdm, TypeErrors.

The quickstart snippets from vLLM's docs run with only the import (and the model, which must be local)
changed.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from engine_utils import hf_greedy, mixed_prompts
from tiny_models import VOCAB

from pdserve import LLM, SamplingParams
from pdserve.inputs import TokensPrompt

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def bare_llm(tiny_llama):
    """A model folder without any tokenizer file (what a dummy-weights folder looks like)."""
    assert not (Path(tiny_llama) / "tokenizer.json").exists()
    return LLM(str(tiny_llama), skip_tokenizer_init=True, num_gpu_blocks_override=128, device="cpu")


@pytest.fixture(scope="module")
def smol_llm(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer and chat template."""
    from server_utils import make_model_dir

    folder = make_model_dir(tmp_path_factory.mktemp("smol"))
    return LLM(str(folder), max_model_len=512, num_gpu_blocks_override=64, device="cpu")


def test_token_prompts_without_a_tokenizer(bare_llm, tiny_llama):
    prompts = mixed_prompts(VOCAB, lengths=(5, 9, 17))
    ref = hf_greedy(tiny_llama, prompts, 6)
    # every accepted form of a token-id prompt gives the same, transformers-exact, tokens
    forms = [
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        [{"prompt_token_ids": tuple(p)} for p in prompts],
        prompts,
    ]
    for form in forms:
        res = bare_llm.generate(form, GREEDY, use_tqdm=False)
        assert [r.outputs[0].token_ids for r in res] == ref
        assert all(r.outputs[0].text == "" and r.prompt is None for r in res)
    one = bare_llm.generate(prompts[0], GREEDY, use_tqdm=False)  # a flat list of ints is one prompt
    assert len(one) == 1 and one[0].outputs[0].token_ids == ref[0]
    single = bare_llm.generate({"prompt_token_ids": prompts[1]}, GREEDY, use_tqdm=False)
    assert single[0].outputs[0].token_ids == ref[1] and single[0].prompt_token_ids == prompts[1]


def test_without_a_tokenizer_text_is_refused(bare_llm):
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        bare_llm.generate("hello", GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="stop"):
        bare_llm.generate([[5, 6]], SamplingParams(stop=["x"]), use_tqdm=False)
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        bare_llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)
    assert not bare_llm.engine.has_unfinished()


def test_missing_tokenizer_error_says_what_to_do(tiny_llama):
    from pdserve.text.tokenizer import TokenizerLoadError

    llm = LLM(str(tiny_llama), num_gpu_blocks_override=32, device="cpu")
    with pytest.raises(TokenizerLoadError, match="skip_tokenizer_init=True"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)


@pytest.mark.parametrize("bad, match", [
    ({"prompt_tokens": [1, 2]}, "without 'prompt'"),
    ([[1, 2], "x", 3], r"prompts\[2\]"),
    ([[1, "2"]], "token ids"),
    ([[1, -2]], "non-negative"),
    (12, "got int"),
    ([{"prompt": 5}], "must be a string"),
    ([b"bytes"], "got bytes"),
])
def test_wrong_prompt_types_are_type_errors(bare_llm, bad, match):
    with pytest.raises(TypeError, match=match):
        bare_llm.generate(bad, GREEDY, use_tqdm=False)


def test_wrong_sampling_params(bare_llm):
    with pytest.raises(TypeError, match="SamplingParams"):
        bare_llm.generate([[5, 6]], {"temperature": 0}, use_tqdm=False)
    with pytest.raises(ValueError, match="lengths"):
        bare_llm.generate([[5, 6], [7, 8]], [GREEDY], use_tqdm=False)


def test_out_of_vocab_prompt_leaves_nothing_running(bare_llm):
    with pytest.raises(ValueError, match="out of vocabulary"):
        bare_llm.generate([[5, 6], [VOCAB + 3]], GREEDY, use_tqdm=False)
    assert not bare_llm.engine.has_unfinished()


def test_n_outputs_seeded_and_reproducible(bare_llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    a = bare_llm.generate([[5, 6, 7], [9, 10]], params, use_tqdm=False)
    b = bare_llm.generate([[5, 6, 7], [9, 10]], params, use_tqdm=False)
    assert [len(r.outputs) for r in a] == [3, 3]
    assert [o.index for o in a[0].outputs] == [0, 1, 2]
    assert [[o.token_ids for o in r.outputs] for r in a] == [[o.token_ids for o in r.outputs] for r in b]
    assert len({tuple(o.token_ids) for o in a[0].outputs}) > 1  # distinct seeds per choice
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)


def test_progress_bar(bare_llm):
    from tqdm import tqdm

    sink = io.StringIO()

    def bar(**kw):
        return tqdm(file=sink, **kw)

    bare_llm.generate([[5, 6], [7, 8, 9]], GREEDY, use_tqdm=bar)
    text = sink.getvalue()
    assert "Processed prompts" in text and "2/2" in text and "output:" in text


def test_chat_single_and_many_conversations(smol_llm):
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    other = [{"role": "user", "content": "Count to three"}]
    tok = smol_llm.get_tokenizer()
    one = smol_llm.chat(conv, GREEDY, use_tqdm=False)
    ref = smol_llm.generate({"prompt_token_ids": tok.encode_chat(conv)}, GREEDY, use_tqdm=False)
    assert one[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert one[0].prompt_token_ids == tok.encode_chat(conv)
    many = smol_llm.chat([conv, other], GREEDY, use_tqdm=False)
    assert len(many) == 2 and many[0].outputs[0].token_ids == one[0].outputs[0].token_ids
    no_gen = smol_llm.chat(conv, GREEDY, use_tqdm=False, add_generation_prompt=False)
    assert no_gen[0].prompt_token_ids == tok.encode_chat(conv, add_generation_prompt=False)
    custom = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    res = smol_llm.chat(other, GREEDY, use_tqdm=False, chat_template=custom)
    assert res[0].prompt_token_ids == tok.encode("<<Count to three>>", add_special_tokens=False)


def test_text_prompt_dict_equals_string(smol_llm):
    a = smol_llm.generate("The sky is", GREEDY, use_tqdm=False)
    b = smol_llm.generate([{"prompt": "The sky is"}], GREEDY, use_tqdm=False)
    assert a[0].outputs[0].text == b[0].outputs[0].text and a[0].prompt == b[0].prompt == "The sky is"


QUICKSTART = textwrap.dedent('''
    from pdserve import LLM, SamplingParams

    prompts = [
        "Hello, my name is",
        "The president of the United States is",
        "The capital of France is",
        "The future of AI is",
    ]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)

    llm = LLM(model=MODEL)

    outputs = llm.generate(prompts, sampling_params)

    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")

    messages = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
    ]
    outputs = llm.chat(messages, sampling_params)
    for output in outputs:
        print(f"Chat: {output.outputs[0].text!r}")
''')


def test_vllm_quickstart_runs_as_is(smol_llm, tmp_path):
    """vLLM's offline quickstart (generate, then chat) with `from vllm` -> `from pdserve` and a local model."""
    script = tmp_path / "quickstart.py"
    script.write_text(f"MODEL = {str(smol_llm.engine.model_dir)!r}\n" + QUICKSTART)
    env_path = str(Path(__file__).resolve().parents[1])
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": env_path}, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("Generated text:") == 4 and "Chat: " in proc.stdout
    assert "Processed prompts" in proc.stderr  # the progress bar, as vLLM shows it



def test_structured_outputs_offline(smol_llm):
    """vLLM's offline form: SamplingParams(structured_outputs=StructuredOutputsParams(...))."""
    import json
    import re

    import jsonschema

    from pdserve import StructuredOutputsParams
    from pdserve.testing.json_schemas import SCHEMAS

    name, schema, _ = SCHEMAS[17]
    params = SamplingParams(max_tokens=300, temperature=0, structured_outputs=StructuredOutputsParams(
        json=schema, disable_any_whitespace=True))
    out = smol_llm.generate(["Order:", "Another order:"], params, use_tqdm=False)
    for r in out:
        jsonschema.validate(json.loads(r.outputs[0].text), schema)
        assert r.outputs[0].finish_reason == "stop" and r.outputs[0].token_ids[-1] == 2  # ends with EOS
    # min_tokens bans EOS, the complete grammar allows only EOS: the grammar wins, nothing breaks
    pick = SamplingParams(max_tokens=20, temperature=0, min_tokens=10,
                          structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    res = smol_llm.generate("Yes or no?", pick, use_tqdm=False)[0].outputs[0]
    assert res.text in ("yes", "no") and res.finish_reason == "stop"
    regex = SamplingParams(n=3, seed=1, max_tokens=30, structured_outputs={"regex": r"[0-9]{3}-[a-z]{2,4}"})
    for o in smol_llm.generate("Code:", regex, use_tqdm=False)[0].outputs:
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", o.text), o.text
    with pytest.raises(ValueError, match="Grammar error|Invalid"):
        smol_llm.generate("x", SamplingParams(structured_outputs={"regex": "(unclosed"}), use_tqdm=False)
    assert not smol_llm.engine.has_unfinished()
