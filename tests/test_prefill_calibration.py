"""An instance measures its prefill cost (pdserve/engine/prefill_calibration.py) by stepping real prompts through
its engine: a model fitted to the lengths the engine admits, and the engine afterwards as a client finds it (no
request left, the counters a client sees at zero, the same greedy tokens as an engine that measured nothing).
Run on the CPU engine here (a server measures only on a GPU); no time is asserted."""

from __future__ import annotations

from engine_utils import make_engine, run_engine

from pdserve.engine.prefill_calibration import FLOOR_TOKENS, calibration_lengths, measure_prefill_cost
from pdserve.types.prefill_cost import PrefillCost
from pdserve.types.sampling_params import SamplingParams


def test_lengths_stay_within_what_the_engine_admits():
    assert calibration_lengths(8192, 80_000) == [FLOOR_TOKENS, 256, 1024, 2048]
    assert calibration_lengths(512, 80_000) == [FLOOR_TOKENS, 256, 511]
    assert calibration_lengths(8192, 600) == [FLOOR_TOKENS, 256, 600]
    assert len(calibration_lengths(100, 80_000)) == 2  # too few lengths to fit: measure_prefill_cost gives None


def test_measured_on_a_real_engine_which_is_left_as_it_was(tiny_llama):
    engine = make_engine(tiny_llama, num_gpu_blocks_override=160)
    cost = measure_prefill_cost(engine, "cpu")
    assert isinstance(cost, PrefillCost) and cost.device == "cpu"
    top = min(engine.max_model_len - 1, (160 // 2 - 1) * 16)
    assert [n for n, _ in cost.points] == calibration_lengths(engine.max_model_len, (160 // 2 - 1) * 16)
    assert cost.points[-1][0] == top and all(s > 0 for _, s in cost.points)
    assert cost.floor_s > 0 and cost.per_token_s > 0
    assert PrefillCost.from_info(cost.as_info()) == cost  # what /pdserve/info advertises reads back the same
    # nothing left behind that a client would see
    assert not engine.has_unfinished() and engine.num_finished == 0
    assert engine.blocks.prefix_queries == engine.blocks.prefix_hits == 0
    vocab = engine.model_cfg.vocab_size
    prompts = [[(7 * i + 3) % vocab for i in range(40)], [(11 * i + 5) % vocab for i in range(23)]]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert run_engine(engine, prompts, params) == run_engine(make_engine(tiny_llama), prompts, params)
