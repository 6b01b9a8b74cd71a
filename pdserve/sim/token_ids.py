"""A tokenizer whose text is its token ids, so that `pdserve bench`'s own dataset code (bench/datasets.py) draws
the simulator's workloads: the same seeded draws of lengths, prefixes and suffixes as a real run, and token ids
whose shared prefixes the engine's prefix cache finds as it would in the real run (ids are spelled out, so a
decode/encode round trip is exact and no prompt misses its target length)."""

from __future__ import annotations


class IdTokenizer:
    """The slice of the Hugging Face tokenizer interface bench/datasets.py uses."""

    all_special_ids: list[int] = []

    def __init__(self, vocab_size: int = 32000) -> None:
        self.vocab_size = vocab_size

    def num_special_tokens_to_add(self) -> int:
        return 0

    def decode(self, ids: list[int], **_: object) -> str:
        return " ".join(map(str, ids))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [int(t) for t in text.split()]
