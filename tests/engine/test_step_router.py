"""StepRouter: the megakernel backend's choice between per-sequence replays and one prefill-path call (CPU)."""
import pytest

from mimw.engine.backends.step_router import BATCHED, KERNEL, REPLAY, StepRouter, bucket, step_paths
from mimw.models.reference import Segment


def test_bucket_is_the_power_of_two_at_or_above():
    assert [bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 33, 64)] == [1, 2, 4, 4, 8, 8, 16, 64, 64]
    with pytest.raises(ValueError):
        bucket(0)


def _warm(r: StepRouter, replay_ms: float, batched: dict[int, float]) -> None:
    for _ in range(3):  # the first time of each (path, bucket) is warm-up; two more make an estimate
        r.observe(REPLAY, 1, replay_ms)
        for b, ms in batched.items():
            r.observe(BATCHED, b, ms)


def test_one_token_always_replays():
    r = StepRouter()
    assert r.choose(1) == REPLAY
    _warm(r, 10.0, {2: 0.1})
    assert r.choose(1) == REPLAY


def test_unmeasured_paths_are_tried_prefill_first_and_warm_up_is_dropped():
    r = StepRouter()
    assert r.choose(4) == BATCHED
    r.observe(BATCHED, 4, 5000.0)  # compilation: dropped
    r.observe(BATCHED, 3, 5.0)  # bucket 4: one time is no estimate yet
    assert r.choose(4) == BATCHED and r.batched_ms == {}
    r.observe(BATCHED, 4, 6.0)
    assert r.batched_ms == {4: 5.0}
    assert r.choose(4) == REPLAY  # no replay time yet
    r.observe(REPLAY, 4, 400.0)  # graph capture: dropped
    r.observe(REPLAY, 4, 4.0)
    assert r.replay_ms is None and r.choose(4) == REPLAY
    r.observe(REPLAY, 2, 3.0)
    assert r.replay_ms == 1.0


def test_the_cheaper_estimate_wins_per_batch_size():
    r = StepRouter()
    _warm(r, 1.0, {2: 5.0, 4: 5.0, 8: 5.2, 64: 8.0})
    assert r.choose(2) == REPLAY  # 2 x 1.0 < 5.0
    assert r.choose(4) == REPLAY  # 4.0 < 5.0
    assert r.choose(5) == REPLAY  # bucket 8: 5 x 1.0 < 5.2
    assert r.choose(6) == BATCHED  # 6.0 > 5.2
    assert r.choose(64) == BATCHED


def test_estimates_follow_new_times():
    r = StepRouter(window=4)
    _warm(r, 1.0, {8: 10.0})
    assert r.choose(8) == REPLAY  # 8 < 10
    for i in range(4):
        assert r.replay_ms == 1.0  # the least of the window: one slower time does not move it
        r.observe(REPLAY, 8, 16.0)  # replays got slower: 2 ms a token
    assert r.replay_ms == 2.0  # once the window holds only new times
    assert r.choose(8) == BATCHED


def test_one_slow_time_does_not_stick_to_the_path_not_taken():
    """The pass's first measured step came in slow (the host stalled the queue): the kernel looked cheaper, but one
    fast time of the pass (a refresh) is enough to win the bucket back."""
    from mimw.engine.backends.step_router import KERNEL

    r = StepRouter(refresh=4)
    paths = (KERNEL, BATCHED)
    for ms in (900.0, 2.5, 2.5):
        r.observe(KERNEL, 32, ms)
    for ms in (700.0, 2.8, 2.76):
        r.observe(BATCHED, 32, ms)
    assert [r.choose(32, paths, replays=False) for _ in range(3)] == [KERNEL] * 3
    assert r.choose(32, paths, replays=False) == BATCHED  # the refresh
    r.observe(BATCHED, 32, 1.86)
    assert r.step_ms == {KERNEL: {32: 2.5}, BATCHED: {32: 1.86}}
    assert [r.choose(32, paths, replays=False) for _ in range(3)] == [BATCHED] * 3


def test_the_path_not_taken_runs_every_refresh_steps():
    r = StepRouter(refresh=4)
    _warm(r, 1.0, {8: 100.0})
    picks = [r.choose(8) for _ in range(8)]
    assert picks.count(BATCHED) == 2 and picks[3] == BATCHED and picks[7] == BATCHED


def test_bad_observations_are_refused():
    r = StepRouter()
    with pytest.raises(ValueError):
        r.observe(REPLAY, 1, 0.0)
    with pytest.raises(ValueError):
        r.observe("sideways", 2, 1.0)


def test_three_paths_unmeasured_first_then_the_cheapest():
    from mimw.engine.backends.step_router import KERNEL

    r = StepRouter(refresh=8)
    paths = (KERNEL, BATCHED)
    assert r.choose(6, paths) == KERNEL
    r.observe(KERNEL, 6, 9000.0)  # its compile: dropped
    r.observe(KERNEL, 6, 1.5)
    assert r.choose(6, paths) == KERNEL
    r.observe(KERNEL, 5, 8000.0)  # another batch size compiles its own kernel: dropped too
    r.observe(KERNEL, 6, 1.6)
    assert r.step_ms[KERNEL] == {8: 1.5}
    assert r.choose(6, paths) == BATCHED
    for ms in (50.0, 5.0, 5.0):
        r.observe(BATCHED, 6, ms)
    assert r.choose(6, paths) == REPLAY
    for ms in (99.0, 6.0, 6.0):
        r.observe(REPLAY, 6, ms)  # 1 ms a token
    picks = [r.choose(6, paths) for _ in range(5)]  # decisions 5..9 of bucket 8
    assert picks == [KERNEL, KERNEL, KERNEL, BATCHED, KERNEL]  # 1.5 < 5.0 < 6.0; the 8th runs the second best
    assert r.choose(12) == BATCHED  # past the kernel's batch sizes the backend offers only the pass


def test_a_verify_step_never_replays_and_takes_the_cheaper_whole_step_path():
    from mimw.engine.backends.step_router import KERNEL

    r = StepRouter(refresh=4)
    paths = (KERNEL, BATCHED)
    assert r.choose(5, paths, replays=False) == KERNEL  # unmeasured: tried in the order given
    for _ in range(3):
        r.observe(KERNEL, 5, 1.5)
    assert r.choose(5, paths, replays=False) == BATCHED
    for _ in range(3):
        r.observe(BATCHED, 5, 4.0)
    _warm(r, 0.01, {})  # replays would be far cheaper: a verify step still never takes them
    picks = [r.choose(6, paths, replays=False) for _ in range(8)]
    assert REPLAY not in picks and picks.count(KERNEL) == 6 and picks.count(BATCHED) == 2  # every 4th: refresh
    # one whole-step path and no replays: the refresh has no second-best to try
    only = StepRouter(refresh=1)
    for _ in range(3):
        only.observe(BATCHED, 32, 3.0)
    assert [only.choose(32, (BATCHED,), replays=False) for _ in range(3)] == [BATCHED] * 3


def test_the_estimates_read_as_json_by_bucket():
    r = StepRouter()
    assert r.estimates() == {"replay_ms": None, "step_ms": {}}
    _warm(r, 1.0, {8: 5.2, 2: 5.0})
    assert r.estimates() == {"replay_ms": 1.0, "step_ms": {BATCHED: {"2": 5.0, "8": 5.2}}}


def test_with_no_whole_batch_path_a_decode_step_replays_even_at_refresh():
    """An MoE model past its multi-token step's tokens offers no whole-batch path (its pass is the eager reference
    decoder): every decode step replays, the refresh included."""
    r = StepRouter(refresh=4)
    assert [r.choose(16, (), replays=True) for _ in range(3)] == [REPLAY] * 3
    for _ in range(3):
        r.observe(REPLAY, 16, 16.0)
    assert [r.choose(16, (), replays=True) for _ in range(8)] == [REPLAY] * 8


def test_step_paths_give_decode_and_verify_steps_to_the_router_and_prefill_chunks_to_the_pass():
    t = (0, 1, 2)
    decode = [Segment(t, 10 + i, 1) for i in range(4)]
    assert step_paths(decode, 32, moe=False) == (KERNEL, BATCHED)
    assert step_paths(decode[:1], 32, moe=False) == (KERNEL, BATCHED)  # one token: the router replays it
    assert step_paths(decode * 10, 32, moe=False) == (BATCHED,)  # 40 decode tokens: past the kernel's 32
    assert step_paths(decode * 10, 32, moe=True) == ()  # an MoE model: replays only
    assert step_paths(decode, 8, moe=True) == (KERNEL,)
    verify = [Segment(t, 10, 5, 5), Segment(t, 20, 1, 1)]
    assert step_paths(verify, 32, moe=False) == (KERNEL, BATCHED)
    assert step_paths(verify, 4, moe=False) is None  # 6 tokens past the kernel's 4
    assert step_paths(verify, 32, moe=True) is None
    chunk = [Segment(t, 0, 21, 1), Segment(t, 30, 1, 1)]  # a prefill chunk beside a decode token
    assert step_paths(chunk, 32, moe=False) is None
    assert step_paths([Segment(t, 0, 6, 6)], 32, moe=False) == (KERNEL, BATCHED)  # prompt logprobs: every row
