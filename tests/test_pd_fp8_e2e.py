"""FP8 KV cache across P/D: real `pdserve serve` producers and consumers over real NIXL DRAM transfers.

fp8 on both sides is token-identical to a collocated fp8 instance and moves about half the bytes of a
bfloat16 pool; a producer and a consumer that disagree on the KV dtype fail the request with a 409 naming
the field (never garbage tokens), and `pdserve preflight` shows a FAIL row.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_utils import ServerProcess, all_ready, metric_value, wait_idle
from test_pd_e2e import decode_leg, kv_config, long_prompt, prefill_leg, text_of

pytest.importorskip("nixl_cu12", reason="NIXL is not installed (pip install --no-deps nixl-cu12==1.5.1)")

HEAD_DIM = 64  # the wire ratio of fp8 rows (head_dim + 2 scale bytes) to bf16 rows (2 * head_dim)
COMMON = ("--max-model-len", "512", "--num-gpu-blocks-override", "96", "--block-size", "16")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from tiny_models import make_tiny_model

    from pdserve.model.default_model import resolve_model

    out = tmp_path_factory.mktemp("fp8-model") / "tiny-smol-hd64"
    out.mkdir()
    make_tiny_model(out, "llama", vocab_size=49152, max_position_embeddings=512, hidden_size=128,
                    intermediate_size=256, num_attention_heads=2, num_key_value_heads=1)
    src = Path(resolve_model("smollm2-135m"))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / name, out / name)
    return out


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory) -> Iterator[dict[str, ServerProcess]]:
    logs = tmp_path_factory.mktemp("fp8-logs")

    def start(name: str, kv: str, *args: str) -> ServerProcess:
        # fp8 instances compute in float32 (exact P/D vs collocated); the reference pool is bfloat16
        dtype = "float32" if kv == "fp8" else "bfloat16"
        return ServerProcess(model_dir, logs / f"{name}.log", *COMMON, "--dtype", dtype, "--kv-cache-dtype", kv,
                             *args)

    producer = ("--kv-transfer-config", kv_config("kv_producer"), "--side-channel-port", "0")
    consumer = ("--kv-transfer-config", kv_config("kv_consumer", "fail"))
    servers = {
        "collocated": start("collocated", "fp8"),
        "prefill": start("prefill", "fp8", *producer),
        "decode": start("decode", "fp8", *consumer),
        "prefill_bf16": start("prefill_bf16", "auto", *producer),
        "decode_bf16": start("decode_bf16", "auto", *consumer),
    }
    with all_ready(servers):
        yield servers


CASES = [
    ("completions", {"prompt": long_prompt(120, 2), "max_tokens": 16}, False),
    ("completions", {"prompt": "Hi", "max_tokens": 8}, True),
    ("chat/completions", {"messages": [{"role": "user", "content": long_prompt(30, 3)}], "max_tokens": 10}, False),
]


@pytest.mark.parametrize("route,body,stream", CASES)
def test_fp8_disaggregated_matches_collocated_fp8(cluster, route, body, stream):
    body = {"model": "tiny", "temperature": 0, **body, "stream": stream}
    ref = httpx.post(f"{cluster['collocated'].url}/v1/{route}", json=body, timeout=120)
    rid = f"fp8-{route.replace('/', '-')}-{stream}"
    params = prefill_leg(cluster["prefill"], route, body, rid)
    out = decode_leg(cluster["decode"], route, body, params, rid)
    assert out.status_code == 200, out.text
    assert text_of(route, out, stream) == text_of(route, ref, stream)
    wait_idle(cluster["decode"].url)
    wait_idle(cluster["prefill"].url)


def _pd_bytes(prefill: ServerProcess, decode: ServerProcess, body: dict, rid: str) -> tuple[float, str]:
    before = httpx.get(f"{decode.url}/metrics").text
    params = prefill_leg(prefill, "completions", body, rid)
    out = decode_leg(decode, "completions", body, params, rid)
    assert out.status_code == 200, out.text
    after = httpx.get(f"{decode.url}/metrics").text
    name = "vllm:nixl_bytes_transferred_sum"
    return metric_value(after, name) - metric_value(before, name), out.json()["choices"][0]["text"]


def test_fp8_halves_the_bytes_on_the_wire(cluster):
    body = {"model": "tiny", "prompt": long_prompt(200, 9), "max_tokens": 4, "temperature": 0}
    bf16, _ = _pd_bytes(cluster["prefill_bf16"], cluster["decode_bf16"], body, "bytes-bf16")
    fp8, _ = _pd_bytes(cluster["prefill"], cluster["decode"], body, "bytes-fp8")
    assert bf16 > 0
    # same number of blocks; each block's rows are head_dim + 2 bytes instead of 2 * head_dim
    assert fp8 / bf16 == pytest.approx((HEAD_DIM + 2) / (2 * HEAD_DIM), rel=1e-9)
    assert fp8 / bf16 < 0.52
    for name in ("decode", "prefill", "decode_bf16", "prefill_bf16"):
        wait_idle(cluster[name].url)


@pytest.mark.parametrize("producer,consumer", [("prefill", "decode_bf16"), ("prefill_bf16", "decode")])
def test_kv_dtype_mismatch_is_a_409_naming_the_field(cluster, producer, consumer):
    body = {"model": "tiny", "prompt": long_prompt(40, 4), "max_tokens": 6, "temperature": 0}
    rid = f"mismatch-{producer}-{consumer}"
    params = prefill_leg(cluster[producer], "completions", body, rid)
    out = decode_leg(cluster[consumer], "completions", body, params, rid)
    assert out.status_code == 409, out.text
    err = out.json()["error"]
    assert err["code"] == 409 and "kv_cache_dtype" in err["message"] and "fp8_e4m3" in err["message"], err
    wait_idle(cluster[consumer].url)
    wait_idle(cluster[producer].url)  # the refused handshake freed the producer's lease (abort)


def test_preflight_fails_a_kv_dtype_mismatch(cluster):
    out = subprocess.run([sys.executable, "-m", "pdserve", "preflight", "--prefill", cluster["prefill"].url,
                          "--decode", cluster["decode_bf16"].url], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    row = next(ln for ln in out.stdout.splitlines() if "versions/configs" in ln)
    assert row.split()[0] == "FAIL" and "kv_cache_dtype differs" in row, out.stdout
