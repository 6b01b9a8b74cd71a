"""Helpers for the render-tier and tokens-only tests (no tests here).

* `make_scripted_model`: a tiny Qwen3 with SmolLM2's tokenizer plus `<think>`, `</think>`, `<tool_call>`,
  `</tool_call>` as added (non-special) tokens, a ChatML chat template with Hermes tools, and weights
  rigged so that greedy decoding after a newline writes a fixed script: reasoning, content, one tool
  call, EOS. Its layers are silenced (zero output projections), which makes the network a bigram table:
  each script token's embedding is its own direction and the LM head maps it to the next token. Every
  other token keeps random weights orthogonal to those directions, so other prompts still produce
  ordinary random text.
* `Proc`: a `pdserve` subprocess on 127.0.0.1, ready when `/health` is 200, stopped by its PID.
* `kv_config`: a tokens-only engine's NIXL `--kv-transfer-config` (producer or consumer).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
from server_utils import PdserveProcess, free_port

THINK_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
# Pieces of the script, tokenised one by one so that no token repeats (a bigram table needs that).
SCRIPT_PIECES = ["<think>", "Let me plan", "</think>", "Sure!", "<tool_call>", '{"name":"get_weather","arguments":',
                 "{", ' "days', '"', ":", " 3", "}}", "</tool_call>"]
SCRIPT_TEXT = "".join(SCRIPT_PIECES)
TRIGGER = "\n"  # the script starts after a prompt that ends with a newline (ChatML's "assistant\n")
EOS_ID = 2  # <|im_end|>

CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call>"
    " XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content or '' }}"
    "{% for tc in message.tool_calls or [] %}\n<tool_call>\n"
    "{\"name\": \"{{ tc.function.name }}\", \"arguments\": {{ tc.function.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% elif message.role != 'system' %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)


def make_tokenizer_dir(out: Path) -> Path:
    """SmolLM2's tokenizer + the four tags as added tokens + the tools template."""
    from tokenizers import AddedToken, Tokenizer

    from pdserve.model.default_model import resolve_model

    src = Path(resolve_model("smollm2-135m"))
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    tok.save(str(out / "tokenizer.json"))
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    shutil.copy(src / "generation_config.json", out / "generation_config.json")
    return out


def script_ids(tokenizer_json: Path) -> tuple[int, list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    ids = [i for piece in SCRIPT_PIECES for i in tok.encode(piece, add_special_tokens=False).ids]
    trigger = tok.encode(TRIGGER, add_special_tokens=False).ids
    assert len(trigger) == 1, trigger
    assert len(set(ids)) == len(ids) and trigger[0] not in ids, "script tokens must be distinct"
    assert tok.decode(ids, skip_special_tokens=False) == SCRIPT_TEXT
    return trigger[0], ids


def make_scripted_model(out: Path, max_position_embeddings: int = 2048) -> Path:
    import torch
    from safetensors.torch import load_file, save_file
    from tiny_models import make_tiny_model

    make_tokenizer_dir(out)
    trigger, ids = script_ids(out / "tokenizer.json")
    vocab = json.loads((out / "tokenizer.json").read_text())
    vocab_size = max(max(vocab["model"]["vocab"].values()), *(t["id"] for t in vocab["added_tokens"])) + 1
    make_tiny_model(out, "qwen3", vocab_size=vocab_size, max_position_embeddings=max_position_embeddings)
    weights = load_file(str(out / "model.safetensors"))
    hidden = weights["model.embed_tokens.weight"].shape[1]
    chain = [trigger, *ids, EOS_ID]
    assert len(chain) - 1 <= hidden
    with torch.no_grad():
        for name, w in weights.items():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                w.zero_()  # silence the layers: the residual stream is the token's embedding
        embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
        embed[:, : len(chain)] = 0.0  # other tokens never point along a script direction
        for k, (cur, nxt) in enumerate(zip(chain, chain[1:], strict=False)):
            embed[cur] = 0.0
            embed[cur, k] = 1.0
            head[nxt] = 0.0
            head[nxt, k] = 10.0
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


class Proc(PdserveProcess):
    """`python -m pdserve <args> --host 127.0.0.1 --port P` with its output in a log file."""

    poll_s = 0.2

    def __init__(self, log_path: Path, *args: str):
        port = free_port()
        super().__init__(log_path, port, [*args, "--host", "127.0.0.1", "--port", str(port),
                                          "--disable-uvicorn-access-log"])


def kv_config(role: str) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "kv_load_failure_policy": "fail",
                       "kv_connector_extra_config": {"transfer_timeout_s": 10.0, "handshake_timeout_s": 10.0}})


def start_all(*procs: Proc) -> None:
    """Waits for all (they start in parallel); on failure stops every one."""
    try:
        for p in procs:
            p.wait_ready()
    except BaseException:
        for p in procs:
            p.stop()
        raise


def sse_events(response: httpx.Response) -> list[dict]:
    """The JSON events of an SSE response body; asserts it ends with [DONE]."""
    events: list[dict] = []
    done = False
    for block in response.text.split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        if data == "[DONE]":
            done = True
            continue
        assert not done, "data after [DONE]"
        events.append(json.loads(data))
    assert done, "stream did not end with [DONE]"
    return events
