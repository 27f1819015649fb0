"""The engine end to end on a tiny random model: paging, batching, chunking and preemption never change greedy
output (compared with the ReferenceDecoder run alone on contiguous pages), and every page comes back."""
import pytest

from mimw.engine.engine import RequestError
from mimw.engine.sampling import SamplingParams

from engine_helpers import greedy_alone, run_all


def greedy(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


PROMPTS = [[1, 5, 9, 33, 70, 12, 200, 4, 8, 100, 101, 17, 3], [7, 7, 7], list(range(40, 75)), [250, 3, 99, 42]]


def tokens(events):
    return [t for e in events for t in e.token_ids]


def test_single_request_matches_the_oracle(make_engine, tiny_weights):
    eng = make_engine(num_pages=16, page_size=4)
    eng.add_request("a", PROMPTS[0], greedy(12))
    ev = run_all(eng)["a"]
    assert tokens(ev) == greedy_alone(tiny_weights, PROMPTS[0], 12)
    assert ev[-1].finished and ev[-1].finish_reason == "length" and ev[-1].completion_tokens == 12
    assert eng.stats().pages_in_use == 0


@pytest.mark.parametrize("cfg", [
    dict(num_pages=64, page_size=4, max_batch=8, max_step_tokens=512),  # everything in one batch
    dict(num_pages=64, page_size=4, max_batch=2, max_step_tokens=8),  # chunked prefill, few slots
    dict(num_pages=12, page_size=4, max_batch=4, max_step_tokens=64),  # page pressure: preemption
])
def test_batching_chunking_and_preemption_keep_greedy_output(make_engine, tiny_weights, cfg):
    eng = make_engine(**cfg)
    want = {f"r{i}": greedy_alone(tiny_weights, p, 10) for i, p in enumerate(PROMPTS)}
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, greedy(10))
    events = run_all(eng)
    assert {k: tokens(v) for k, v in events.items()} == want
    s = eng.stats()
    assert s.pages_in_use == 0 and s.running == 0 and s.waiting == 0
    if cfg["num_pages"] == 12:
        assert s.preemptions > 0


def test_requests_join_a_running_batch(make_engine, tiny_weights):
    eng = make_engine(num_pages=64, page_size=4)
    eng.add_request("a", PROMPTS[0], greedy(10))
    out = {}
    for i in range(3):
        for e in eng.step():
            out.setdefault(e.request_id, []).append(e)
    eng.add_request("b", PROMPTS[2], greedy(10))
    for k, v in run_all(eng).items():
        out.setdefault(k, []).extend(v)
    assert tokens(out["a"]) == greedy_alone(tiny_weights, PROMPTS[0], 10)
    assert tokens(out["b"]) == greedy_alone(tiny_weights, PROMPTS[2], 10)


def test_prefix_reuse_reports_cached_tokens_and_keeps_output(make_engine, tiny_weights):
    eng = make_engine(num_pages=64, page_size=4)
    shared = list(range(10, 40))
    eng.add_request("a", shared + [1, 2], greedy(4))
    run_all(eng)
    eng.add_request("b", shared + [5, 6, 7], greedy(6))
    ev = run_all(eng)["b"]
    assert ev[-1].cached_tokens == 28  # 7 full pages of the 30 shared tokens
    assert tokens(ev) == greedy_alone(tiny_weights, shared + [5, 6, 7], 6)
    s = eng.stats()
    assert s.prefix_hit_tokens == 28 and s.pages_in_use == 0 and s.pages_cached > 0


def test_stop_token_stop_string_and_eos(make_engine, tiny_weights):
    ref = greedy_alone(tiny_weights, PROMPTS[0], 10)
    eng = make_engine(num_pages=32, page_size=4)
    eng.add_request("tok", PROMPTS[0], greedy(10, stop_token_ids=(ref[3],)))
    ev = run_all(eng)["tok"]
    assert tokens(ev) == ref[:4] and ev[-1].finish_reason == "stop"
    # a stop string made of the bytes of generated tokens 2..3: the text stops right before it
    text = bytes(t for t in ref if t > 2).decode("utf-8", errors="replace")
    full = "".join(e.text for e in run_all(_with(eng, "all", PROMPTS[0], greedy(10)))["all"])
    assert full == text
    stop = full[3:5]
    ev = run_all(_with(eng, "str", PROMPTS[0], greedy(10, stop=(stop,))))["str"]
    out = "".join(e.text for e in ev)
    assert ev[-1].finish_reason == "stop" and out == full[:full.index(stop)]
    # EOS (id 2) ends a request unless ignore_eos
    eos_eng = make_engine(num_pages=32, page_size=4)
    eos_eng.eos_token_ids = frozenset({ref[0]})
    eos_eng.add_request("eos", PROMPTS[0], SamplingParams(temperature=0, max_tokens=10))
    ev = run_all(eos_eng)["eos"]
    assert tokens(ev) == ref[:1] and ev[-1].finish_reason == "stop" and ev[-1].text == ""


def _with(eng, rid, prompt, params):
    eng.add_request(rid, prompt, params)
    return eng


def test_abort_frees_pages_and_emits_a_final_event(make_engine):
    eng = make_engine(num_pages=32, page_size=4)
    seen = []
    eng.add_request("a", PROMPTS[2], greedy(50), on_output=seen.append)
    eng.step(), eng.step()
    assert eng.stats().pages_in_use > 0
    assert eng.abort("a") and not eng.abort("a")
    assert seen[-1].finished and seen[-1].finish_reason == "abort"
    assert eng.stats().pages_in_use == 0 and not eng.has_work()


def test_seeded_sampling_is_reproducible_across_batching(make_engine):
    p = SamplingParams(temperature=1.0, seed=123, max_tokens=8, ignore_eos=True)
    alone = make_engine(num_pages=64, page_size=4)
    alone.add_request("x", PROMPTS[1], p)
    want = tokens(run_all(alone)["x"])
    eng = make_engine(num_pages=64, page_size=4)
    for i, q in enumerate(PROMPTS):
        eng.add_request(f"r{i}", q, p)
    assert tokens(run_all(eng)["r1"]) == want


def test_length_validation(make_engine):
    eng = make_engine(num_pages=8, page_size=4)  # 32-token context
    assert eng.max_model_len == 32
    with pytest.raises(RequestError) as e:
        eng.add_request("a", [], greedy(1))
    assert e.value.param == "prompt"
    with pytest.raises(RequestError) as e:
        eng.add_request("a", list(range(3, 35)), greedy(1))
    assert e.value.param == "prompt" and e.value.code == "context_length_exceeded"
    with pytest.raises(RequestError) as e:
        eng.add_request("a", [5] * 30, greedy(3))
    assert e.value.param == "max_tokens"
    with pytest.raises(RequestError, match="token ids"):
        eng.add_request("a", [5, 999], greedy(1))
    assert eng.check_lengths(30, None) == 2


def test_context_limit_finishes_with_length(make_engine, tiny_weights):
    eng = make_engine(num_pages=8, page_size=4, max_model_len=20)
    eng.add_request("a", PROMPTS[0], greedy(7))  # 13 + 7 = 20 exactly
    ev = run_all(eng)["a"]
    assert ev[-1].finish_reason == "length" and ev[-1].completion_tokens == 7


def test_backend_failure_fails_requests_not_the_engine(make_engine):
    eng = make_engine(num_pages=32, page_size=4)
    real = eng.backend.forward

    def boom(*a):
        raise RuntimeError("device lost")

    eng.backend.forward = boom
    eng.add_request("a", PROMPTS[0], greedy(4))
    [ev] = eng.step()
    assert ev.finish_reason == "error" and "device lost" in ev.error and eng.stats().pages_in_use == 0
    eng.backend.forward = real
    eng.add_request("b", PROMPTS[0], greedy(4))
    assert run_all(eng)["b"][-1].finish_reason == "length"


@pytest.mark.parametrize("seed", range(6))
def test_random_configs_and_arrivals_keep_greedy_output(make_engine, tiny_weights, seed):
    import random
    rng = random.Random(seed)
    ps = rng.choice([2, 4, 8])
    eng = make_engine(num_pages=rng.randint(48 // ps + 1, 160 // ps), page_size=ps, max_batch=rng.randint(1, 5),
                      max_step_tokens=rng.randint(5, 40))
    shared = [rng.randint(3, 255) for _ in range(rng.randint(0, 20))]
    prompts = [shared + [rng.randint(3, 255) for _ in range(rng.randint(1, 20))] for _ in range(6)]
    n = 8
    want = [greedy_alone(tiny_weights, p, n) for p in prompts]
    got: dict[str, list] = {}
    pending = list(enumerate(prompts))
    while pending or eng.has_work():
        if pending and rng.random() < 0.5:  # arrivals between steps
            i, p = pending.pop(0)
            eng.add_request(f"r{i}", p, greedy(n))
        for e in eng.step():
            got.setdefault(e.request_id, []).append(e)
    assert [tokens(got[f"r{i}"]) for i in range(6)] == want
    assert eng.stats().pages_in_use == 0


def test_sampling_failure_fails_only_that_request(make_engine):
    eng = make_engine(num_pages=32, page_size=4)
    real = eng.backend.forward

    def nan_for_second_segment(tokens, segments, cache):
        out = real(tokens, segments, cache)
        if len(segments) > 1:
            out[1] = float("nan")
        return out

    eng.backend.forward = nan_for_second_segment
    eng.add_request("ok", PROMPTS[0], greedy(3))
    eng.add_request("bad", PROMPTS[1], SamplingParams(temperature=1.0, seed=0, max_tokens=3))
    events = run_all(eng)
    assert events["bad"][-1].finish_reason == "error" and "sampling failed" in events["bad"][-1].error
    assert events["ok"][-1].finish_reason == "length" and eng.stats().pages_in_use == 0
