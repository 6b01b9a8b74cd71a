"""Tokenizer loading for the benchmark client, without torch.

`transformers.AutoTokenizer` imports torch, so the client loads fast tokenizers through
`PreTrainedTokenizerFast` (a folder with `tokenizer.json`, a `tokenizer.json` file, or a hub id whose
repository has one), which gives vLLM's exact semantics (`vocab_size`, `all_special_ids`,
`num_special_tokens_to_add`, `encode`, `decode`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


class TokenizerError(RuntimeError):
    pass


def load_tokenizer(name_or_path: str) -> Any:
    """A `transformers.PreTrainedTokenizerFast` for a local folder/file or a hub id."""
    from transformers import PreTrainedTokenizerFast

    try:
        if os.path.isfile(name_or_path):
            return PreTrainedTokenizerFast(tokenizer_file=name_or_path)
        if os.path.isdir(name_or_path) and not os.path.isfile(os.path.join(name_or_path, "tokenizer.json")):
            raise TokenizerError(
                f"{name_or_path} has no tokenizer.json (the benchmark client needs a fast tokenizer)"
            )
        return PreTrainedTokenizerFast.from_pretrained(name_or_path)
    except TokenizerError:
        raise
    except Exception as err:  # hub/network/format errors all mean "no tokenizer from here"
        raise TokenizerError(f"cannot load a tokenizer from {name_or_path!r}: {err}") from err


def token_counter(tokenizer: Any) -> Callable[[str], int]:
    """Counts tokens of generated text the way vLLM does when the server sent no usage."""

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    return count
