"""CPU tests of the GPU path's host-side pieces (no CUDA, no triton needed)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pdserve.engine.request import Request
from pdserve.engine.runner.host_batch import BlockTableCache, HostBatch
from pdserve.engine.runner.step_runner import graph_sizes_for, greedy_on_device, pick_graph_size
from pdserve.model.config import load_model_config
from pdserve.model.packaged_configs import available, config_path, dummy_model_dir
from pdserve.types.sampling_params import SamplingParams


def test_graph_sizes_cover_max_num_seqs():
    assert graph_sizes_for(256)[-1] == 256
    assert graph_sizes_for(5) == [1, 2, 4, 5]
    assert graph_sizes_for(1) == [1]
    sizes = graph_sizes_for(100)
    assert sizes[-1] == 100 and sizes == sorted(set(sizes))
    assert graph_sizes_for(1000)[-1] == 256  # larger batches run eagerly
    assert pick_graph_size([1, 2, 4, 8], 3) == 4
    assert pick_graph_size([1, 2, 4, 8], 8) == 8
    assert pick_graph_size([1, 2, 4, 8], 9) is None


def _req(rid: str, prompt: list[int], computed: int, blocks: list[int], out: list[int] | None = None,
         **params) -> Request:
    r = Request(rid, prompt, SamplingParams(**params), frozenset({2}), 4096)
    r.output_token_ids = list(out or [])
    r.num_computed_tokens = computed
    r.block_ids = blocks
    return r


def test_greedy_on_device_only_when_cpu_sampler_would_argmax():
    assert greedy_on_device([_req("a", [1], 0, [0], temperature=0.0)])
    assert not greedy_on_device([_req("a", [1], 0, [0], temperature=0.7)])
    assert not greedy_on_device([_req("a", [1], 0, [0], temperature=0.0, logprobs=2)])
    # min_tokens not yet reached: the sampler masks EOS first
    assert not greedy_on_device([_req("a", [1], 0, [0], temperature=0.0, min_tokens=3, max_tokens=8)])
    assert greedy_on_device([_req("a", [1], 0, [0], [5, 6, 7], temperature=0.0, min_tokens=3, max_tokens=8)])
    # the graph's argmax sees none of these: the sampler must apply them
    for adjust in ({"repetition_penalty": 1.2}, {"presence_penalty": 0.5}, {"frequency_penalty": -0.5},
                   {"logit_bias": {3: 5.0}}, {"allowed_token_ids": [3, 4]}):
        assert not greedy_on_device([_req("a", [1], 0, [0], temperature=0.0),
                                     _req("b", [1], 0, [0], temperature=0.0, **adjust)]), adjust
    assert greedy_on_device([_req("a", [1], 0, [0], temperature=0.0, repetition_penalty=1.0, logit_bias={})])


def test_host_batch_layout_matches_the_flattened_batch():
    bs = 4
    prompt_a = list(range(10, 20))  # 10 tokens, chunk [4, 10) this step (prefix/chunk context of 4)
    a = _req("a", prompt_a, 4, [7, 3, 9])
    b = _req("b", [1, 2, 3], 2, [5], [42])  # decode row: computed 2 of 4 tokens? -> 2 new tokens
    c = _req("c", [8, 9, 10, 11, 12], 5, [2, 6], [77])  # one decode token at position 5
    batch = [(a, 6), (b, 2), (c, 1)]
    buf = np.full(256, -99, dtype=np.int64)
    hb = HostBatch(batch, bs, buf)
    assert hb.size <= HostBatch.max_size(9, 3, 3)
    seg = {name: hb.view(buf, name) for name in HostBatch.SEGMENTS}
    assert all(lo % 2 == 0 for lo, _ in hb.offsets.values())  # 16-byte aligned: no new Triton variants
    assert seg["ids"].tolist() == prompt_a[4:10] + [3, 42] + [77]
    assert seg["positions"].tolist() == [4, 5, 6, 7, 8, 9, 2, 3, 5]
    want_slots = [3 * 4 + 0, 3 * 4 + 1, 3 * 4 + 2, 3 * 4 + 3, 9 * 4 + 0, 9 * 4 + 1, 5 * 4 + 2, 5 * 4 + 3, 6 * 4 + 1]
    assert seg["slots"].tolist() == want_slots
    assert seg["query_start_loc"].tolist() == [0, 6, 8, 9]
    assert seg["seq_lens"].tolist() == [10, 4, 6]
    # every request reaches its frontier here: sampled rows are each sequence's last row
    assert hb.num_rows == 3 and [r.request_id for r in hb.sampling] == ["a", "b", "c"]
    assert seg["sample_rows"].tolist() == [5, 7, 8]
    tables = seg["block_tables"].reshape(3, hb.width)
    assert hb.width == 3
    assert tables[0].tolist() == [7, 3, 9] and tables[1, 0] == 5 and tables[2, :2].tolist() == [2, 6]


def test_host_batch_fits_its_bound_with_a_row_per_token():
    """Prompt logprobs ask for a row per prompt token: more logit rows than sequences, within max_size_of (the
    CPU path allocates exactly that; the bound once counted one row per sequence)."""
    a = _req("a", list(range(3, 40)), 0, list(range(10)), prompt_logprobs=1)
    b = _req("b", [1, 2, 3], 3, [5], [42])  # a decode row, sampling
    batch = [(a, 37), (b, 1)]
    size = HostBatch.max_size_of(batch, 4)
    buf = np.full(size, -99, dtype=np.int64)
    hb = HostBatch(batch, 4, buf)
    assert hb.num_rows == 36 + 2 and hb.size <= size
    assert hb.view(buf, "sample_rows").tolist() == [*range(36), 36, 37]
    # rows given (a draft model's step): those rows, no prompt logprobs, nothing sampled
    hb = HostBatch(batch, 4, buf, rows=[36])
    assert hb.rows == [36] and hb.view(buf, "sample_rows").tolist() == [36]
    assert hb.sampling == [] and hb.prompt_spans == [] and hb.sampling_logits(None) is None


def test_host_batch_mid_chunk_samples_nothing():
    a = _req("a", list(range(3, 40)), 0, list(range(10)))
    hb = HostBatch([(a, 16)], 4, np.zeros(200, dtype=np.int64))
    assert hb.num_rows == 0 and hb.sampling == []


@pytest.mark.parametrize("name", ["Llama-3.1-8B", "Qwen2.5-7B"])
def test_packaged_configs_parse_in_their_real_shapes(name, tmp_path):
    assert name in available()
    cfg = load_model_config(dummy_model_dir(name, tmp_path))
    raw = json.loads(config_path(name).read_text())
    assert cfg.vocab_size == raw["vocab_size"] and cfg.num_layers == raw["num_hidden_layers"]
    if name == "Llama-3.1-8B":
        assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
            4096, 14336, 32, 8, 128)
        assert cfg.vocab_size == 128256 and cfg.rope_scaling["rope_type"] == "llama3" and not cfg.qkv_bias
    else:
        assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
            3584, 18944, 28, 4, 128)
        assert cfg.vocab_size == 152064 and cfg.qkv_bias and cfg.rope_scaling is None


def test_model_dir_resolves_packaged_names_only_for_dummy_weights(tmp_path):
    from pdserve.model.default_model import ModelNotFoundError
    from pdserve.model.model_dir import resolve_model_dir

    folder = resolve_model_dir("Llama-3.1-8B", "dummy")
    assert json.loads((folder / "config.json").read_text()) == json.loads(config_path("Llama-3.1-8B").read_text())
    assert resolve_model_dir(str(tmp_path), "dummy") == tmp_path
    with pytest.raises(ModelNotFoundError):  # real weights: a packaged config's name is no model folder
        resolve_model_dir("Llama-3.1-8B")


def test_unknown_packaged_config_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="available"):
        config_path("nope")


def test_block_table_cache_follows_appends_and_replacements():
    cache = BlockTableCache()
    r = _req("a", [1, 2, 3], 0, [4, 5])
    assert cache.get(r).tolist() == [4, 5]
    r.block_ids.extend(range(6, 40))  # the block manager appends as the request grows
    assert cache.get(r).tolist() == [4, 5, *range(6, 40)]
    r.block_ids = [9]  # release + reallocate (preemption) installs a new list
    assert cache.get(r).tolist() == [9]
    r.block_ids.clear()  # an in-place rewrite, not done today, is caught by the guard
    r.block_ids.extend([7, 8])
    assert cache.get(r).tolist() == [7, 8]
    for _ in range(512):
        cache.end_step()
    assert cache._entries == {}  # not seen for a while: forgotten


def _bare_step_runner(max_num_seqs: int = 4, max_model_len: int = 64):
    """A GpuStepRunner without a model: only the host-side bookkeeping is exercised."""
    import torch

    from pdserve.engine.runner.step_runner import GpuStepRunner

    return GpuStepRunner(None, torch.zeros(1), None, None, block_size=4,  # type: ignore[arg-type]
                         max_num_seqs=max_num_seqs, max_model_len=max_model_len, simulate_graphs=True)


def _rows_table(g) -> list[list[int]]:
    return g._g_rows.tolist()


def test_persistent_table_rows_send_only_new_blocks_and_recycle_rows():
    from pdserve.engine.request import Status

    g = _bare_step_runner()
    width = g.max_blocks_per_seq  # 16
    a = _req("a", [1] * 5, 4, [3, 9])
    b = _req("b", [1] * 2, 1, [7])
    rows, updates = g._table_rows([(a, 1), (b, 1)])
    ra, rb = rows
    assert ra != rb and 0 not in rows  # row 0 is the padding rows' all-zero row
    assert sorted(zip(updates[::2], updates[1::2], strict=True)) == sorted(
        [(ra * width, 3), (ra * width + 1, 9), (rb * width, 7)])
    # nothing new: nothing sent
    assert g._table_rows([(a, 1), (b, 1)]) == ([ra, rb], [])
    a.block_ids.append(11)  # a crossed into a new block
    assert g._table_rows([(b, 1), (a, 1)]) == ([rb, ra], [ra * width + 2, 11])
    # preemption replaces the list: the row is rewritten in full
    a.block_ids = [5]
    assert g._table_rows([(a, 1)]) == ([ra], [ra * width, 5])
    # a new request reusing a finished one's id gets the row rewritten, and is not freed with the old one
    b.status = Status.FINISHED
    b2 = _req("b", [2] * 3, 2, [8])
    assert g._table_rows([(b2, 1)]) == ([rb], [rb * width, 8])
    # rows run out: finished requests' rows are recycled
    g._free_rows = []
    c = _req("c", [1], 0, [4])
    b2.status = Status.FINISHED
    (rc,), _ = g._table_rows([(c, 1)])
    assert rc == rb
    # none free and none stale: the step must run eagerly
    g._free_rows = []
    assert g._table_rows([(_req("d", [1], 0, [6]), 1)]) is None


def test_graph_step_samples_only_rows_that_reach_their_frontier():
    import torch

    g = _bare_step_runner()
    seen = {}

    def fake_forward(size):
        seen["hdr"] = g._g_dev.clone()
        return torch.arange(size * 5, dtype=torch.float32).view(size, 5), torch.arange(size) + 100

    g._graph_forward = fake_forward
    dec = _req("dec", [1, 2, 3], 3, [4], [9])  # decode: position 3 is the last token
    # a recompute after preemption scheduled one token (position 2) of its 5: no sample this step
    mid = _req("mid", [5, 6, 7, 8], 2, [6, 7], [10])
    logits, tokens, keep = g._run_graph([(dec, 1), (mid, 1)], 4)
    assert keep == [0]
    assert tokens.tolist() == [100, 101] and logits.shape == (2, 5)
    b = g._gb
    hdr = seen["hdr"].tolist()
    assert hdr[0:4] == [9, 7, 0, 0]  # tokens: dec's last output, mid's prompt[2]; padding rows 0
    assert hdr[b : b + 4] == [3, 2, 0, 0]  # positions
    assert hdr[2 * b : 2 * b + 4] == [4 * 4 + 3, 6 * 4 + 2, -1, -1]  # slots; padding rows store nothing
    assert hdr[3 * b : 3 * b + 4] == [4, 3, 0, 0]  # seq lens; padding rows read no keys
    assert hdr[4 * b + 2 : 4 * b + 4] == [0, 0]  # padding rows use the all-zero table row
