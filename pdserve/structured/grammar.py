"""Grammars for structured outputs, on llguidance (why llguidance: ARCHITECTURE.md, "Structured outputs").

`GrammarCompiler` turns a `StructuredOutputsParams` into a per-request `Grammar` (an llguidance matcher
over the model's tokenizer). A bad schema, regex or grammar is a `ParamError` carrying llguidance's own
message (the server answers 400). `Grammar.fill(pointer)` writes the next-token bitmask (bit i of word
i // 32 set = token i allowed; vLLM's layout) and `accept(token)` advances it.

Compiled grammars are cached by their spec: a cache hit is a cheap `deep_copy` of a fresh matcher.
No torch here (the sampler owns the tensors).

Objects are strict by default, as vLLM's default backend is (`backend: "auto"` picks xgrammar, whose JSON
schemas are compiled in strict mode): an object schema that lists `properties` (or `patternProperties`)
and does not say `additionalProperties` accepts no other key, so a reply (a forced tool call) closes
instead of wandering into keys nobody listed. `additionalProperties: true` or a schema keeps it open.
`--structured-outputs-config '{"backend": "guidance"}'` asks for vLLM's guidance backend by name and gets
its behaviour: objects open (JSON Schema's default) unless `disable_additional_properties` is set (server
wide, or per request in `structured_outputs`).
"""

from __future__ import annotations

import copy
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from pdserve.types.sampling_params import ParamError
from pdserve.types.structured_params import StructuredOutputsParams, structural_tags

CACHE_SIZE = 256
# the keywords whose values hold subschemas (vLLM's backend_guidance.py walks the same ones)
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
_SUBSCHEMAS = ("additionalProperties", "unevaluatedProperties", "propertyNames", "contains", "additionalItems",
               "unevaluatedItems", "not", "if", "then", "else", "contentSchema", "items", "prefixItems", "allOf",
               "anyOf", "oneOf")


def strict_objects(options: dict[str, Any] | None) -> bool:
    """Whether objects are closed by default for a server's `--structured-outputs-config`: always, unless the
    config names vLLM's `guidance` backend without `disable_additional_properties` (see the module's doc)."""
    opts = options or {}
    return opts.get("backend", "auto") != "guidance" or bool(opts.get("disable_additional_properties", False))


def close_objects(schema: Any) -> Any:
    """Every object schema that lists properties (or pattern properties) and does not say otherwise gets
    `additionalProperties: false` (what vLLM's guidance backend does for `disable_additional_properties`,
    and what xgrammar's strict mode means). Returns a copy."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: close_objects(v) for k, v in out[key].items()}
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), (dict, list)):
            out[key] = close_objects(out[key])
    if "additionalProperties" not in out and (isinstance(out.get("properties"), dict)
                                              or isinstance(out.get("patternProperties"), dict)):
        out["additionalProperties"] = False
    return out


class Grammar:
    """One request's matcher. Not thread-safe; the engine thread owns it."""

    __slots__ = ("matcher", "mask_bytes")

    def __init__(self, matcher: Any, mask_bytes: int):
        self.matcher = matcher
        self.mask_bytes = mask_bytes

    def fill(self, pointer: int) -> None:
        """Writes this step's allowed-token bitmask (`mask_bytes` bytes) at `pointer`. A stopped or failed
        matcher allows only EOS."""
        self.matcher.unsafe_compute_mask_ptr(pointer, self.mask_bytes)

    def accept(self, token_id: int) -> bool:
        return self.matcher.is_stopped() or bool(self.matcher.consume_token(token_id))

    @property
    def stopped(self) -> bool:
        """Nothing but EOS may follow: the output is complete."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() or None


class GrammarCompiler:
    """Compiles specs against one tokenizer. `hf_tokenizer` is a fast Hugging Face tokenizer; `vocab_size`
    the model's logits width; `eos_token_ids` what ends a generation. `disable_additional_properties`: objects
    closed unless their schema says otherwise (the default; `strict_objects` reads a server's config)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int], *,
                 disable_any_whitespace: bool = False, disable_additional_properties: bool = True):
        import llguidance
        import llguidance.hf

        self._llg = llguidance
        eos = sorted(set(eos_token_ids)) or None
        self.vocab_size = max(vocab_size, len(hf_tokenizer))
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, self.vocab_size, eos_token=eos)
        self.words = (self.vocab_size + 31) // 32  # int32 words per bitmask row
        self.disable_any_whitespace = disable_any_whitespace
        self.disable_additional_properties = disable_additional_properties
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()  # servers may compile off the engine thread

    def grammar_text(self, spec: StructuredOutputsParams) -> str:
        """The llguidance grammar of a spec; ParamError for a spec that is not even well-formed."""
        llg = self._llg
        no_ws = self.disable_any_whitespace or spec.disable_any_whitespace
        options: dict[str, Any] = {"whitespace_flexible": not no_ws}
        if spec.whitespace_pattern is not None and not no_ws:
            options["whitespace_pattern"] = spec.whitespace_pattern
        try:
            if spec.json is not None or spec.json_object:
                schema = spec.json if spec.json is not None else {"type": "object"}
                if isinstance(schema, str):
                    schema = json.loads(schema)
                if not isinstance(schema, dict):
                    raise ValueError("a JSON schema must be an object")
                if self.disable_additional_properties or spec.disable_additional_properties:
                    schema = close_objects(schema)
                return llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)
            if spec.structural_tag is not None:
                # free text until a trigger, then begin + JSON of the schema + end (llguidance's StructTag,
                # as vLLM's guidance backend builds it)
                closed = self.disable_additional_properties or spec.disable_additional_properties
                tags = [llg.StructTag(trigger=t, begin=b, end=e, grammar={
                    **(close_objects(schema) if closed else schema), "x-guidance": options})
                    for t, b, schema, e in structural_tags(spec.structural_tag)]
                return llg.StructTag.to_grammar(tags)
            if spec.regex is not None:
                return llg.grammar_from("regex", spec.regex)
            if spec.choice is not None:
                return llg.grammar_from("choice", spec.choice)
            return llg.grammar_from("grammar", spec.grammar)
        except (ValueError, TypeError, KeyError) as e:
            raise ParamError(f"Invalid {spec.kind} for structured outputs: {e}", "structured_outputs") from e

    def compile(self, spec: StructuredOutputsParams) -> Grammar:
        key = spec.key()
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
        if template is None:
            template = self._llg.LLMatcher(self.tokenizer, self.grammar_text(spec), log_level=0)
            if template.is_error():
                raise ParamError(f"Grammar error in structured outputs ({spec.kind}): {template.get_error()}",
                                 "structured_outputs")
            with self._lock:
                self._cache[key] = template
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        return Grammar(template.deep_copy(), self.words * 4)


_EXECUTOR: Any = None
PARALLEL_MIN_ROWS = 8  # below this, a thread pool's hand-off costs more than it saves


def fill_bitmasks(grammars: list[Grammar | None], pointer: int, row_bytes: int) -> None:
    """Writes row i's bitmask at `pointer + i * row_bytes` for every row with a grammar (other rows are left
    as they are). Many rows go to llguidance's thread pool, which fills them in parallel without the GIL."""
    rows = [(g.matcher, i) for i, g in enumerate(grammars) if g is not None]
    if len(rows) < PARALLEL_MIN_ROWS or os.cpu_count() in (None, 1, 2):
        for matcher, i in rows:
            matcher.unsafe_compute_mask_ptr(pointer + i * row_bytes, row_bytes)
        return
    global _EXECUTOR
    if _EXECUTOR is None:
        import llguidance

        _EXECUTOR = llguidance.LLExecutor(min(8, os.cpu_count() or 1))
    _EXECUTOR.unsafe_compute_mask_ptr(rows, pointer, row_bytes, len(grammars))


def load_compiler(tokenizer_path: str, vocab_size: int, eos_token_ids: Iterable[int],
                  options: dict[str, Any] | None = None) -> GrammarCompiler:
    """A compiler over the tokenizer in `tokenizer_path` (ParamError when there is none: structured outputs
    need the vocabulary's bytes)."""
    from pdserve.text.tokenizer import TokenizerLoadError, load_tokenizer

    opts = copy.copy(options or {})
    try:
        tok = load_tokenizer(tokenizer_path)
    except TokenizerLoadError as e:
        raise ParamError(f"structured outputs need the model's tokenizer: {e}", "structured_outputs") from e
    # EOS is what a complete grammar allows: the ids that end a generation in the engine
    return GrammarCompiler(tok.hf, vocab_size, set(eos_token_ids) or set(tok.eos_token_ids),
                           disable_any_whitespace=bool(opts.get("disable_any_whitespace", False)),
                           disable_additional_properties=strict_objects(opts))
