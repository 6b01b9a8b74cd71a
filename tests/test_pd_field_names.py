"""vLLM's `kv_transfer_params` field names (and ours beside them) are spelled only in `pdserve/api/` (the wire
contract, `pdserve/api/pd.py`) and `pdserve/kv_transfer/` (which speaks the params to its peers): everywhere
else reads and builds them through `pdserve.api.pd`, so a renamed or added field changes in one place.

Checked over the source with `ast` (string constants, f-string parts included), not by grepping: a docstring or
comment may name a field; code may not. `prompt_token_ids` is also an OpenAI/vLLM request and response field,
so it is not in the list (inside kv_transfer_params it is `pdserve.api.pd.PROMPT_TOKEN_IDS`).

`kv_history` (the proxy's per-turn history decision inside an answer's kv_transfer_params) is also the name of a
configuration option (`--no-kv-history`, `pdserve up`'s `kv_history`), so it counts only where it is used as a
mapping key: a dict display's key, a subscript, or the first argument of `.get`/`.pop`/`.setdefault`."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "pdserve"
ALLOWED = ("api", "kv_transfer")

FIELD_NAMES = frozenset({
    # vLLM's (NixlConnector, toy proxy, bidirectional_kv_xfer, push)
    "do_remote_decode", "do_remote_prefill", "remote_engine_id", "remote_block_ids", "remote_host", "remote_port",
    "remote_request_id", "remote_num_tokens", "remote_blocks_expiry_time", "tp_size", "dcp_size", "pp_size",
    "transfer_mode", "remote_registration_generation", "remote_prefill_cached_tokens",
    # ours
    "remote_lease_token", "remote_block_hashes", "remote_block_bytes", "lease_expires_at", "push_key",
    "params_later", "first_token_id", "first_token_logprob", "kv_digest_algo", "min_read_tokens",
    # vLLM's KV digest prototype (nixl/digest.py)
    "remote_block_digests",
})
# Field names that are also other things' names: spelled as a mapping key only in api/ and kv_transfer/.
KEY_FIELD_NAMES = frozenset({"kv_history"})
_KEY_METHODS = ("get", "pop", "setdefault")


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (a module's, class's or function's first statement)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _mapping_keys(tree: ast.AST) -> set[int]:
    """ids of the nodes used as a mapping key: dict display keys, subscripts, `.get/.pop/.setdefault(key)`."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            out.update(id(k) for k in node.keys if k is not None)
        elif isinstance(node, ast.Subscript):
            out.add(id(node.slice))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _KEY_METHODS
              and node.args):
            out.add(id(node.args[0]))
    return out


def field_name_literals(source: str) -> list[tuple[int, str]]:
    """(line, name) of every string constant in `source` that is a kv_transfer_params field name."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    keys = _mapping_keys(tree)
    return sorted((node.lineno, node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
                  and (node.value in FIELD_NAMES or (node.value in KEY_FIELD_NAMES and id(node) in keys)))


def test_the_check_finds_a_spelled_field_name() -> None:
    assert field_name_literals('params.get("remote_block_ids")\nx = {"do_remote_decode": True}\n') == [
        (1, "remote_block_ids"), (2, "do_remote_decode")]
    assert field_name_literals('"""remote_block_ids in a docstring"""\n# "remote_host"\ny = "remote hosts"\n') == []


def test_the_check_finds_a_key_field_name_used_as_a_key_only() -> None:
    keyed = 'a = {"kv_history": 1}\nb = p["kv_history"]\nc = p.get("kv_history")\n'
    assert field_name_literals(keyed) == [(1, "kv_history"), (2, "kv_history"), (3, "kv_history")]
    assert field_name_literals('parser.add_argument("--no-kv-history", dest="kv_history")\nk = ("kv_history",)\n') == []


def test_field_names_are_spelled_only_in_api_and_kv_transfer() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in ALLOWED:
            continue
        found += [f"pdserve/{rel}:{line}: {name!r}" for line, name in field_name_literals(path.read_text())]
    assert not found, "use pdserve.api.pd instead of spelling kv_transfer_params fields:\n" + "\n".join(found)
