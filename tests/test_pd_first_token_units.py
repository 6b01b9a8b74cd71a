"""The first-token part of the P/D wire contract (pdserve/api/pd.py): what a producer adds to its params and
what a decode instance accepts."""

from __future__ import annotations

import time

import pytest

from pdserve.api import pd

PARAMS = pd.HeldKVParams(request_id="r1", block_ids=(3, 4), num_tokens=20, num_cached_tokens=0, engine_id="e",
                         host="127.0.0.1", port=5600, generation=1, expires_at=time.time() + 30,
                         lease_token="t" * 32).to_json()


def test_round_trip_with_and_without_logprobs():
    plain = pd.FirstToken(17)
    assert pd.parse_remote_prefill_params({**PARAMS, **pd.first_token_fields(plain)}).first_token == plain
    full = pd.FirstToken(17, -0.25, 1, ((17, -0.25), (4, -1.5)))
    fields = pd.first_token_fields(full)
    assert fields == {"first_token_id": 17, "first_token_logprob": {"logprob": -0.25, "rank": 1,
                                                                   "top": [[17, -0.25], [4, -1.5]]}}
    assert pd.parse_first_token({**PARAMS, **fields}) == full


def test_a_producer_without_first_token_parses_as_none():
    assert pd.parse_remote_prefill_params(PARAMS).first_token is None


@pytest.mark.parametrize("extra", [
    {"first_token_id": True}, {"first_token_id": 1.0}, {"first_token_id": -3},
    {"first_token_logprob": {"logprob": -1.0}},  # no token
    {"first_token_id": 2, "first_token_logprob": []},
    {"first_token_id": 2, "first_token_logprob": {"logprob": None}},
    {"first_token_id": 2, "first_token_logprob": {"logprob": -1.0, "rank": 0}},
    {"first_token_id": 2, "first_token_logprob": {"logprob": -1.0, "top": [[2, "x"]]}},
    {"first_token_id": 2, "first_token_logprob": {"logprob": -1.0, "top": [[-2, -1.0]]}},
])
def test_malformed_first_token_is_rejected(extra):
    with pytest.raises(pd.InvalidKVTransferParams):
        pd.parse_remote_prefill_params({**PARAMS, **extra})
