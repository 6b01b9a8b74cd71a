"""The Scheduler and BlockManager on their own (no model, no engine): a consumer request's remote-KV life
under preemption pressure. `step` below does the engine's bookkeeping after a model step."""

from __future__ import annotations

import pytest

from pdserve.api.pd import KVTransferParams
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.pd.kv_handoff import HandoffStateError, KVHandoff, KVState
from pdserve.engine.request import Request, Status
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.types.sampling_params import SamplingParams

BS = 4
REMOTE = KVTransferParams.read({"do_remote_prefill": True, "remote_block_ids": [[1, 2, 3]], "remote_engine_id": "p",
                                "remote_request_id": "r", "remote_host": "127.0.0.1", "remote_port": 1})
PREFILL_LEG = KVTransferParams.read({"do_remote_decode": True})


def make(num_blocks: int, prefix_caching: bool = True, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS, prefix_caching), max_num_seqs, max_num_batched_tokens=64)


def request(rid: str, prompt: list[int], remote: bool = False, max_tokens: int = 100) -> Request:
    kv = KVHandoff.from_params(REMOTE if remote else None, can_load=True, can_send=True)
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), frozenset(), 4096, kv)


def step(sched: Scheduler) -> SchedulerOutput:
    """One schedule() plus what the engine does after the model ran: every request that reached its
    frontier gets one more token (its id is irrelevant here)."""
    out = sched.schedule()
    for req, n in out.scheduled:
        req.num_computed_tokens += n
        sched.blocks.cache_full_blocks(req)
        if req.num_computed_tokens == req.num_tokens:
            req.output_token_ids.append(7)
    return out


def finish(sched: Scheduler, req: Request) -> None:
    sched.remove(req)
    req.status = Status.FINISHED
    sched.blocks.release(req)


def test_handoff_states_move_only_forward():
    kv = KVHandoff.from_params(REMOTE, can_load=True, can_send=True)
    assert kv.needs_load and not kv.send
    kv.begin_load()
    assert kv.loading and not kv.needs_load
    with pytest.raises(HandoffStateError):
        kv.begin_load()  # one load per request, ever
    kv.end_load(ok=True)
    assert kv.state is KVState.LOADED and not kv.needs_load
    with pytest.raises(HandoffStateError):
        kv.end_load(ok=True)
    with pytest.raises(HandoffStateError):
        kv.request_abort()  # only a loading request defers its abort
    # a role this instance cannot play is ignored: plain local prefill / plain finish
    assert KVHandoff.from_params(REMOTE, can_load=False, can_send=True).state is KVState.NONE
    assert not KVHandoff.from_params(PREFILL_LEG, can_load=True, can_send=False).send
    assert KVHandoff.from_params(PREFILL_LEG, can_load=True, can_send=True).send


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preempted_loaded_request_recomputes_locally_never_loads_again(prefix_caching):
    sched = make(num_blocks=10, prefix_caching=prefix_caching)
    local = request("local", list(range(100, 112)))  # 3 blocks
    remote = request("remote", list(range(200, 210)), remote=True)  # 3 blocks (10 tokens)
    sched.add(local)
    sched.add(remote)
    out = step(sched)
    assert out.start_loads == [remote] and remote.kv.loading and remote.status is Status.WAITING_FOR_REMOTE_KVS
    assert [r for r, _ in out.scheduled] == [local]
    sched.end_load(remote, ok=True)  # the NIXL read landed
    assert remote.kv.state is KVState.LOADED and remote.num_computed_tokens == 9
    assert sched.running == [local, remote]

    preempted_at = None
    for i in range(40):  # both decode; the pool (10 blocks) runs out within a few blocks of growth
        out = step(sched)
        assert not out.start_loads
        if out.preempted:
            assert out.preempted == [remote]  # the most recently admitted is the victim
            preempted_at = i
            break
    assert preempted_at is not None
    assert remote.status is Status.WAITING and remote.block_ids == [] and remote.num_computed_tokens == 0
    assert remote.kv.state is KVState.LOADED  # the lease is consumed: never a second read
    assert sched.num_preemptions == 1 and remote.metrics.num_preemptions == 1
    generated = len(remote.output_token_ids)

    finish(sched, local)  # room again: the preempted request comes back through the local path
    num_tokens = remote.num_tokens
    out = step(sched)
    assert not out.start_loads
    (req, n), = out.scheduled
    assert req is remote and remote.status is Status.RUNNING
    if prefix_caching:
        # its own prompt blocks (registered when the load ended) are still cached: a prefix hit
        assert n <= num_tokens - 2 * BS
    else:
        assert n == num_tokens
    assert len(remote.output_token_ids) == generated + 1  # recomputed up to its frontier, then sampled
    for _ in range(3):
        step(sched)
    finish(sched, remote)
    assert not sched.has_work() and not sched.loading
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks


def test_loading_request_is_never_a_preemption_victim():
    sched = make(num_blocks=6)
    local = request("local", list(range(100, 108)))  # 2 blocks, grows
    remote = request("remote", list(range(200, 212)), remote=True)  # 3 blocks, loading throughout
    sched.add(local)
    sched.add(remote)
    step(sched)
    assert remote.kv.loading
    blocks = list(remote.block_ids)
    refs = [sched.blocks.ref_cnt[b] for b in blocks]
    preempted = []
    for _ in range(20):  # the local request grows past the 1 block left and must yield, not the load
        out = step(sched)
        preempted += out.preempted
        assert not out.start_loads
        assert remote.block_ids == blocks and [sched.blocks.ref_cnt[b] for b in blocks] == refs
        assert remote.status is Status.WAITING_FOR_REMOTE_KVS and remote.kv.loading
    assert preempted and all(r is local for r in preempted)
    assert sched.num_preemptions == len(preempted)
    assert remote not in sched.waiting and sched.loading == {"remote": remote}

    sched.end_load(remote, ok=True)
    out = step(sched)
    assert (remote, 1) in out.scheduled  # decodes its last prompt token at once
    finish(sched, remote)
    for _ in range(3):
        step(sched)
    finish(sched, local)
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks


def test_abort_while_loading_frees_blocks_only_when_the_load_ends():
    sched = make(num_blocks=8)
    remote = request("remote", list(range(200, 214)), remote=True)
    sched.add(remote)
    step(sched)
    assert remote.kv.loading
    free_while_loading = sched.blocks.num_free_blocks
    remote.kv.request_abort()  # what the engine does on abort: the read may still be writing
    for _ in range(3):
        out = step(sched)
        assert not out.scheduled and not out.start_loads
        assert sched.blocks.num_free_blocks == free_while_loading
    sched.end_load(remote, ok=False, resume=False)  # the read ended (either way): the engine finishes it
    assert remote.kv.state is KVState.FAILED and remote not in sched.running
    finish(sched, remote)
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks
    assert not sched.has_work() and not sched.loading


def test_failed_load_recomputes_from_the_local_prefix_hit():
    sched = make(num_blocks=12)
    first = request("first", list(range(300, 313)))
    sched.add(first)
    for _ in range(2):
        step(sched)
    finish(sched, first)  # its 3 full prompt blocks stay cached
    remote = request("remote", list(range(300, 313)) + [9, 9, 9], remote=True)
    sched.add(remote)
    out = step(sched)
    assert out.start_loads == [remote] and remote.num_computed_tokens == 3 * BS  # reads only the rest
    sched.end_load(remote, ok=False)  # recompute policy: resume locally
    assert remote.kv.state is KVState.FAILED and remote.num_computed_tokens == 3 * BS
    out = step(sched)
    assert out.scheduled == [(remote, remote.num_prompt_tokens - 3 * BS)]
    finish(sched, remote)
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks


def test_a_step_without_decode_rows_gives_one_long_prompt_a_longer_chunk():
    """prefill_only_chunk_tokens: with nothing decoding, the first long prompt takes up to that many tokens and
    holds the step alone; a short prompt is scheduled within the budget as before; once a request decodes,
    every chunk is the budget's again."""
    sched = Scheduler(BlockManager(512, BS, True), 8, max_num_batched_tokens=64, prefill_only_chunk_tokens=256)
    long1 = request("long1", list(range(1, 601)), max_tokens=3)
    short = request("short", list(range(700, 720)), max_tokens=50)
    sched.add(long1)
    sched.add(short)
    assert [(r.request_id, n) for r, n in step(sched).scheduled] == [("long1", 256)]  # alone in its step
    assert [(r.request_id, n) for r, n in step(sched).scheduled] == [("long1", 256)]
    # 88 left: more than the budget (64) -> the long chunk again, which finishes the prompt
    assert [(r.request_id, n) for r, n in step(sched).scheduled] == [("long1", 88)]
    # long1 now decodes: the budget's rules (its decode row + short's 20 tokens)
    assert [(r.request_id, n) for r, n in step(sched).scheduled] == [("long1", 1), ("short", 20)]
    long2 = request("long2", list(range(1000, 1300)), max_tokens=3)
    sched.add(long2)
    assert [(r.request_id, n) for r, n in step(sched).scheduled] == [("long1", 1), ("short", 1), ("long2", 62)]
    off = Scheduler(BlockManager(512, BS, True), 8, max_num_batched_tokens=64, prefill_only_chunk_tokens=0)
    off.add(request("x", list(range(1, 601))))
    assert [n for _, n in step(off).scheduled] == [64]


def test_handoff_after_finish_and_awaiting_params_states():
    """The rest of `Request.kv`'s one state machine: a leg waiting for its params (indexed by the mailbox
    under its key), and KV kept after a request (HELD, HISTORY) until the lease ends."""
    from pdserve.engine.pd.params_mailbox import ParamsMailbox

    leg = request("leg", list(range(10)), remote=True)
    mailbox = ParamsMailbox()
    mailbox.wait("k", leg)
    assert leg.kv.state is KVState.AWAITING_PARAMS and leg.kv.params_key == "k" and len(mailbox) == 1
    with pytest.raises(HandoffStateError):
        leg.kv.begin_load()  # not scheduled before its params came
    with pytest.raises(ValueError):
        mailbox.wait("k", request("other", list(range(10)), remote=True))  # one leg per key
    mailbox.forget(leg)  # aborted while waiting
    assert leg.kv.state is KVState.NONE and len(mailbox) == 0 and mailbox.deliver("k", REMOTE) is None  # now kept for a leg still to come
    assert mailbox.take_early("k") == REMOTE

    kv = KVHandoff.from_params(PREFILL_LEG, can_load=True, can_send=True)
    kv.hold()
    assert kv.state is KVState.HELD
    with pytest.raises(HandoffStateError):
        kv.keep_as_history()
    kv.release()
    assert kv.state is KVState.RELEASED
    with pytest.raises(HandoffStateError):
        kv.release()  # freed once
    loaded = KVHandoff.from_params(REMOTE, can_load=True, can_send=True)
    with pytest.raises(HandoffStateError):
        loaded.keep_as_history()  # a load not ended keeps nothing
    loaded.begin_load()
    loaded.end_load(ok=True)
    loaded.keep_as_history()
    assert loaded.state is KVState.HISTORY
