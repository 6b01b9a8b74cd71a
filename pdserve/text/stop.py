"""Stop strings with vLLM's semantics.

* The output text is cut before the stop string (after it with include_stop_str_in_output).
* Only text that could still be the start of a stop string is held back while streaming: the last
  `max(len(stop)) - 1` characters (none when the stop string is included in the output).
* Stop strings are checked in the order given; the first one found wins.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False):
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop strings must be non-empty strings")
        self.stop: tuple[str, ...] = tuple(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.holdback = max((len(s) for s in self.stop), default=1) - 1 if not include_stop_str_in_output else 0

    def __bool__(self) -> bool:
        return bool(self.stop)

    def check(self, text: str, new_char_count: int) -> tuple[str, int] | None:
        """Looks for a stop string that ends in the last `new_char_count` characters of `text`.

        Returns (stop string, cut) where `cut` is the length the text must be truncated to, or None.
        """
        if not new_char_count or not self.stop:
            return None
        n = len(text)
        for s in self.stop:
            start = max(0, n - new_char_count - len(s) + 1)
            index = text.find(s, start)
            if index == -1:
                continue
            if self.include_stop_str_in_output:
                index = min(index + len(s), n)
            return s, index
        return None
