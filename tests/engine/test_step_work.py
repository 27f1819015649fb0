"""The engine's host work per decode step, counted (Python function calls, not time: a count is the same on any
machine): it does not grow with the context length, and the host tier does not look at the pages it could back
up in a step that moved none. The engine runs as the trace benchmark's does (prefix cache, session retention,
host tier, the pool full of parked pages that the decode steps evict) over a backend that costs nothing
(``mimw.bench.engine_host.FreeBackend``)."""
import sys

import pytest

from mimw.bench.engine_host import make_engine
from mimw.engine.sampling import SamplingParams
from mimw.models.spec import get_preset

PS = 4
SPEC = get_preset("tiny-llama").with_(max_position_embeddings=4096)


def decoding(context: int, batch: int, setup: str = "session+host"):
    """An engine whose pool holds the requests' prompts and parked pages besides, ``batch`` session requests of
    ``context`` tokens decoding in it (prefills done, 4 decode steps run)."""
    parked = 40
    eng = make_engine(SPEC, setup, batch * context // PS + parked, PS, max_batch=8, max_step_tokens=64)
    eng.add_request("fill", [3] + [7] * (parked * PS), SamplingParams(temperature=0.0, max_tokens=1))
    while eng.has_work():
        eng.step()
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    reqs = [eng.add_request(f"r{b}", [b + 3, 5] + [9] * (context - 2), params, session_id=f"s{b}")
            for b in range(batch)]
    while any(r.num_output_tokens == 0 for r in reqs):
        eng.step()
    for _ in range(4):
        eng.step()
    assert eng.allocator.num_free < PS * batch  # the decode steps' pages come from evicting parked ones
    return eng


def calls(eng, steps: int) -> int:
    """Python and builtin function calls made by ``steps`` engine steps."""
    n = 0

    def count(frame, event, arg):
        nonlocal n
        n += event in ("call", "c_call")

    sys.setprofile(count)
    try:
        for _ in range(steps):
            eng.step()
    finally:
        sys.setprofile(None)
    return n


@pytest.mark.parametrize("setup", ["lru", "session+host"])
def test_a_decode_step_does_no_more_work_at_a_longer_context(setup):
    # 16 steps: four page boundaries each (new pages, evictions, offloads, pages registered) at both lengths
    short, long = (calls(decoding(c, 3, setup), 16) for c in (64, 1600))
    assert long <= 1.02 * short + 16, (short, long)


def test_the_host_tier_looks_at_its_backup_window_only_in_steps_that_moved_the_device_order():
    eng = decoding(256, 1)
    looks = []
    ahead = eng.prefix.next_evicted
    eng.prefix.next_evicted = lambda n: looks.append(n) or ahead(n)
    versions = set()
    for _ in range(16):
        eng.step()
        versions.add(eng.prefix.order_version)
    # one request decoding takes a page every 4 steps (evicting a parked one): 4 moves of the order in 16 steps, and
    # after each at most two looks, one that copies what the move brought into the window, one that finds it all
    # on the host (a step's own copies change what the host holds)
    moves = len(versions) - 1
    assert moves <= 4 and 0 < len(looks) <= 2 * moves + 2 < 16
