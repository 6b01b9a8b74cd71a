"""Workload generation of `pdserve bench` with small tokenizers built in the test (no downloads)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from pdserve.bench.datasets import load_jsonl, sample_random, sample_shared_prefix
from pdserve.bench.tokenizer import TokenizerError, load_tokenizer


def _save_fast(tok: Any, path: Path, **special: str) -> Path:
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=tok, **special).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """WordLevel over 2000 words, BOS added by the post-processor (1 special token per sequence)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i + 3 for i in range(2000)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    path = _save_fast(
        tok, tmp_path_factory.mktemp("wordtok"), unk_token="[UNK]", bos_token="<s>", eos_token="</s>"
    )
    return load_tokenizer(str(path))


@pytest.fixture(scope="module")
def bpe_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Byte-level BPE trained on a small corpus: decode/encode round trips can merge tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [f"the quick brown fox {i} jumps over the lazy dog number {i * 7}" for i in range(300)]
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    path = _save_fast(tok, tmp_path_factory.mktemp("bpetok"), eos_token="<|endoftext|>")
    return load_tokenizer(str(path / "tokenizer.json"))


def test_random_lengths_exact_when_retokenised(word_tokenizer: Any) -> None:
    reqs = sample_random(word_tokenizer, 30, input_len=40, output_len=16, seed=1)
    assert len(reqs) == 30
    for r in reqs:
        assert r.prompt_len == 39  # 40 requested - 1 special token the server adds
        assert len(word_tokenizer.encode(r.prompt, add_special_tokens=False)) == 39
        assert len(word_tokenizer(r.prompt).input_ids) == 40
        assert r.expected_output_len == 16
        assert "<s>" not in r.prompt and "[UNK]" not in r.prompt


def test_random_range_ratio_bounds(word_tokenizer: Any) -> None:
    reqs = sample_random(word_tokenizer, 300, input_len=41, output_len=20, range_ratio=0.5, seed=2)
    in_lens = [r.prompt_len for r in reqs]
    out_lens = [r.expected_output_len for r in reqs]
    assert min(in_lens) >= math.floor(40 * 0.5) and max(in_lens) <= math.ceil(40 * 1.5)
    assert min(out_lens) >= 10 and max(out_lens) <= 30
    assert len(set(in_lens)) > 10 and len(set(out_lens)) > 10  # actually spread over the range
    for r in reqs[:50]:
        assert len(word_tokenizer.encode(r.prompt, add_special_tokens=False)) == r.prompt_len


def test_random_prompts_fresh_seeded_and_shared_prefix(word_tokenizer: Any) -> None:
    a = sample_random(word_tokenizer, 10, input_len=33, output_len=4, seed=5)
    assert a == sample_random(word_tokenizer, 10, input_len=33, output_len=4, seed=5)
    starts = {tuple(r.prompt.split()[:8]) for r in a}
    assert len(starts) == 10  # a random vocabulary offset per request: no shared prefixes
    b = sample_random(word_tokenizer, 10, input_len=33, output_len=4, seed=6)
    assert not {r.prompt for r in a} & {r.prompt for r in b}  # another seed, other prompts
    with_prefix = sample_random(word_tokenizer, 10, input_len=33, output_len=4, prefix_len=6, seed=5)
    assert len({tuple(r.prompt.split()[:6]) for r in with_prefix}) == 1
    assert all(r.prompt_len == 6 + 32 for r in with_prefix)


def test_random_with_merging_bpe_tokenizer(bpe_tokenizer: Any) -> None:
    reqs = sample_random(bpe_tokenizer, 40, input_len=64, output_len=8, seed=3)
    exact = 0
    for r in reqs:
        ids = bpe_tokenizer.encode(r.prompt, add_special_tokens=False)
        assert len(ids) == r.prompt_len  # the reported length is always the true re-tokenised length
        exact += r.prompt_len == 64
    assert exact == len(reqs)  # trimming converges once byte-piece tokens are left out


def test_random_rejects_bad_ratio(word_tokenizer: Any) -> None:
    with pytest.raises(ValueError):
        sample_random(word_tokenizer, 2, input_len=10, output_len=2, range_ratio=1.0)


def test_shared_prefix_workload(word_tokenizer: Any) -> None:
    reqs = sample_shared_prefix(
        word_tokenizer, 10, prefix_len=12, suffix_len=5, num_prefixes=3, output_len=7, seed=0
    )
    assert len(reqs) == 10
    prefixes: dict[tuple[str, ...], int] = {}
    for r in reqs:
        words = r.prompt.split()
        assert r.prompt_len == 17 == len(words)
        assert r.expected_output_len == 7
        prefixes[tuple(words[:12])] = prefixes.get(tuple(words[:12]), 0) + 1
    assert sorted(prefixes.values()) == [3, 3, 4]
    suffixes = {tuple(r.prompt.split()[12:]) for r in reqs}
    assert len(suffixes) == 10
    with pytest.raises(ValueError):
        sample_shared_prefix(word_tokenizer, 2, 4, 4, num_prefixes=3, output_len=1)


def test_jsonl_prompts_and_conversations(tmp_path: Path, word_tokenizer: Any) -> None:
    path = tmp_path / "prompts.jsonl"
    rows = [
        {"prompt": "w1 w2 w3", "output_len": 5},
        {"messages": [{"role": "system", "content": "w4"}, {"role": "user", "content": "w5 w6"}]},
        {"prompt": "w7"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    reqs = load_jsonl(str(path), 7, default_output_len=9, tokenizer=word_tokenizer)
    assert [r.expected_output_len for r in reqs] == [5, 9, 9, 5, 9, 9, 5]  # cycled
    assert [r.prompt_len for r in reqs[:3]] == [3, 3, 1]
    assert reqs[1].chat_messages == rows[1]["messages"]
    assert reqs[0].chat_messages is None
    no_tok = load_jsonl(str(path), 2, default_output_len=9)
    assert [r.prompt_len for r in no_tok] == [0, 0]  # the server's usage fills it in


@pytest.mark.parametrize(
    "line",
    [
        '{"prompt": 3}',
        '{"messages": []}',
        '{"prompt": "x", "output_len": 0}',
        "not json",
        "[1, 2]",
        '{"messages": [{"content": "no role"}]}',
    ],
)
def test_jsonl_rejects_bad_lines(tmp_path: Path, line: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_jsonl(str(path), 1, default_output_len=4)


def test_tokenizer_loader_errors(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError):
        load_tokenizer(str(tmp_path))  # a folder without tokenizer.json
