"""`pdserve plan`: the KV arithmetic against the seed article's numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.preflight.plan import KVShape, format_plan, make_plan, parse_bandwidth, resolve_shape


def test_seed_llama_70b_320_kib_per_token_and_64_ms() -> None:
    shape = resolve_shape("meta-llama/Llama-3.1-70B-Instruct")
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype) == (80, 8, 128, "bfloat16")
    assert shape.bytes_per_token == 320 * 1024
    plan = make_plan(shape, 10_000, ["400Gb/s"])
    assert plan.prompt_bytes == 3_276_800_000  # "about 3 GB"
    # exact: 3.2768e9 B x 8 / 400e9 bit/s
    assert plan.links[0].wire_time_s == pytest.approx(0.065536)
    text = format_plan(plan)
    assert "320 KiB" in text and "65.5 ms" in text
    # the seed's own rounding (3.2 GB x 8 / 400 Gb/s) is shown and gives its 64 ms
    assert "3.2 GB" in text and "64 ms" in text
    assert "1 GB = 10^9 B" in text and "1 GiB = 2^30 B" in text


def test_explicit_shape_matches_table() -> None:
    explicit = resolve_shape(None, layers=80, kv_heads=8, head_dim=128, dtype="bf16")
    assert explicit.bytes_per_token == 327_680
    assert resolve_shape(None, layers=80, kv_heads=8, head_dim=128, dtype="fp8").bytes_per_token == 163_840
    with pytest.raises(ValueError, match="--kv-heads"):
        resolve_shape(None, layers=80, head_dim=128)


@pytest.mark.parametrize(
    ("text", "bytes_per_s"),
    [
        ("400Gb/s", 50e9),
        ("400Gbps", 50e9),
        ("400 Gbit/s", 50e9),
        ("50GB/s", 50e9),
        ("1GiB/s", 2**30),
        ("100 MB/s", 1e8),
        ("1.6Tb/s", 200e9),
        ("tcp-fallback", 0.5e9),
    ],
)
def test_parse_bandwidth(text: str, bytes_per_s: float) -> None:
    assert parse_bandwidth(text) == pytest.approx(bytes_per_s)


@pytest.mark.parametrize("text", ["400", "fast", "400Qb/s", "-5GB/s", "0GB/s"])
def test_parse_bandwidth_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_bandwidth(text)


def test_config_json_and_folder(tmp_path: Path) -> None:
    cfg = {
        "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "hidden_size": 1024, "head_dim": 128, "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for source in (tmp_path, tmp_path / "config.json"):
        shape = resolve_shape(str(source))
        assert shape.bytes_per_token == 28 * 2 * 8 * 128 * 2
    # head_dim absent: hidden / heads; kv heads absent: = heads; dtype override
    del cfg["head_dim"], cfg["num_key_value_heads"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape = resolve_shape(str(tmp_path), dtype="float32")
    assert (shape.num_kv_heads, shape.head_dim, shape.dtype) == (16, 64, "float32")
    assert shape.bytes_per_token == 28 * 2 * 16 * 64 * 4


def test_blocks_round_up() -> None:
    plan = make_plan(KVShape("x", 2, 2, 16, "float32"), 17, ["5GB/s"], block_size=16)
    assert plan.num_blocks == 2 and plan.bytes_per_block == 16 * 512
    assert plan.links[0].wire_time_s == pytest.approx(17 * 512 / 5e9)


def test_cli_json_and_errors() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pdserve", "plan", "llama-3.1-70b", "--prompt-len", "10000",
         "--bandwidth", "400Gb/s", "--bandwidth", "0.5GB/s", "--json"],
        capture_output=True, text=True, check=True,
    )
    data = json.loads(out.stdout)
    assert data["bytes_per_token"] == 327_680
    assert [round(link["wire_time_s"], 4) for link in data["links"]] == [0.0655, 6.5536]
    bad = subprocess.run([sys.executable, "-m", "pdserve", "plan", "no-such-model", "--prompt-len", "10"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "not a known name" in bad.stderr
    assert "torch" not in subprocess.run(
        [sys.executable, "-c", "import sys, pdserve.preflight.plan; print(' '.join(sys.modules))"],
        capture_output=True, text=True, check=True,
    ).stdout.split()


# -- the P:D ratio (rule 3 of the seed's vendor article) ------------------------------------------------


def test_ratio_seed_examples() -> None:
    """The rule's arithmetic on the seed's two workloads, with per-instance throughputs that make its
    ratios come out (32k/400 -> 3:2 needs prefill 53x a decode instance's tokens/s; 4k/8k -> 1:3 needs 1.5x):
    the ratio is a function of measured rates, not a constant."""
    from pdserve.preflight.ratio import recommend

    rag = recommend(32_000, 400, prefill_tps=40_000, decode_tps=750)
    assert (rag.num_prefill, rag.num_decode) == (3, 2) and rag.bottleneck == "balanced"
    assert rag.balanced_ratio == pytest.approx(1.5) and rag.max_rate == pytest.approx(3.75)
    cot = recommend(4_000, 8_000, prefill_tps=4_000, decode_tps=2_666.67)
    assert (cot.num_prefill, cot.num_decode) == (1, 3) and cot.efficiency > 0.99
    big = recommend(32_000, 400, prefill_tps=40_000, decode_tps=750, instances=8)
    assert big.topology == "5p3d"  # min(5/0.8, 3/0.533) = 5.625 req/s beats 4p4d (5.0) and 6p2d (3.75)
    assert big.max_rate == pytest.approx(5.625)


def test_ratio_errors_and_cli(tmp_path: Path) -> None:
    from pdserve.preflight.ratio import best_split

    with pytest.raises(ValueError, match="--instances"):
        best_split(100, 10, 1.0, 1.0, 1)
    with pytest.raises(ValueError, match="--decode-tps"):
        best_split(100, 10, 1.0, 0.0, 4)
    out = subprocess.run(
        [sys.executable, "-m", "pdserve", "plan", "--isl", "32000", "--osl", "400", "--prefill-tps", "40000",
         "--decode-tps", "750", "--json"], capture_output=True, text=True, check=True)
    data = json.loads(out.stdout)
    assert data["ratio"]["topology"] == "3p2d" and "bytes_per_token" not in data  # no model: no KV part
    text = subprocess.run(
        [sys.executable, "-m", "pdserve", "plan", "llama-3.1-8b", "--isl", "4000", "--osl", "8000",
         "--prefill-tps", "4000", "--decode-tps", "2700"], capture_output=True, text=True, check=True).stdout
    assert "4,000 tokens ->" in text and "recommended:      1p3d" in text  # KV of an --isl prompt, then the split
    bad = subprocess.run([sys.executable, "-m", "pdserve", "plan", "--isl", "10"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--osl --prefill-tps --decode-tps" in bad.stderr
    # what `pdserve up --ray --from-plan` reads
    from pdserve.launch.ray_cli import topology_from_plan

    (tmp_path / "plan.json").write_text(out.stdout)
    assert topology_from_plan(str(tmp_path / "plan.json")) == "3p2d"


def test_tensor_parallel_reads_per_decode_rank() -> None:
    shape = resolve_shape("llama-3.1-70b")  # 8 KV heads, 320 KiB per token
    plan = make_plan(shape, 10_000, ["400Gb/s"], 16, prefill_tp=4, decode_tp=8)
    tp = plan.tensor_parallel
    assert [r.sources for r in tp.ranks][:3] == [[(0, 0, 1)], [(0, 1, 1)], [(1, 2, 1)]]
    assert tp.total_bytes == plan.prompt_bytes  # every head once
    assert tp.max_rank_bytes == plan.prompt_bytes // 8 and not tp.whole_blocks
    assert (tp.pieces_per_block, tp.piece_bytes) == (80 * 2 * 16, 128 * 2)
    text = format_plan(plan)
    assert "decode rank 7 reads head 7 from prefill rank 3" in text and "8.19 ms" in text
    same = make_plan(shape, 10_000, ["400Gb/s"], 16, prefill_tp=2, decode_tp=2).tensor_parallel
    assert same.whole_blocks and [r.sources for r in same.ranks] == [[(0, 0, 4)], [(1, 4, 4)]]
    # more decode ranks than KV heads: the replicated heads are moved once per rank storing them
    wide = make_plan(shape, 1000, ["400Gb/s"], 16, prefill_tp=1, decode_tp=16).tensor_parallel
    assert wide.total_bytes == 2 * make_plan(shape, 1000, ["400Gb/s"], 16).prompt_bytes
    with pytest.raises(ValueError, match="--decode-tp 3 and 8 KV heads"):
        make_plan(shape, 100, ["400Gb/s"], 16, decode_tp=3)
    out = subprocess.run([sys.executable, "-m", "pdserve", "plan", "llama-3.1-8b", "--prompt-len", "4096",
                          "--prefill-tp", "2", "--decode-tp", "1", "--json"], capture_output=True, text=True, check=True)
    data = json.loads(out.stdout)["tensor_parallel"]
    assert data["prefill_tp"] == 2 and data["ranks"][0]["sources"] == [[0, 0, 4], [1, 4, 4]]
