"""What the engine reports besides tokens, on a tiny random model: logprobs of sampled and prompt tokens (the raw
log-softmax of the oracle's logits, through chunked prefill, preemption and a warm prefix cache), grammars that
constrain the output, penalties with the request's own history, timings and token counters."""
import pytest
import torch

from mimw.engine.engine import RequestError
from mimw.engine.sampling import SamplingParams
from mimw.kv.pages import KVLayout, PagedKVCache
from mimw.models.reference import ReferenceDecoder, Segment

from engine_helpers import greedy_alone, run_all

PROMPT = [1, 5, 9, 33, 70, 12, 200, 4, 8, 100, 101, 17, 3, 44, 45, 46, 47]


def oracle_logprobs(weights, tokens):
    """log_softmax of the logits at every position of ``tokens`` (one contiguous forward)."""
    cache = PagedKVCache(KVLayout.for_spec(weights.spec, 16, 64, weights.dtype))
    logits = ReferenceDecoder(weights).forward(torch.tensor(tokens), [Segment(tuple(range(64)), 0, len(tokens))],
                                               cache)
    return torch.log_softmax(logits.float(), -1)


def params(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


@pytest.mark.parametrize("cfg", [
    dict(num_pages=64, page_size=4),
    dict(num_pages=64, page_size=4, max_batch=2, max_step_tokens=5),  # the prompt arrives in chunks of <= 5
    dict(num_pages=64, page_size=4, max_batch=2, max_step_tokens=2),  # chunks of one token beside a decoder
    dict(num_pages=8, page_size=4, max_batch=4, max_step_tokens=64),  # page pressure: preemption
])
def test_logprobs_and_prompt_logprobs_are_the_raw_log_softmax(make_engine, tiny_weights, cfg):
    eng = make_engine(**cfg)
    # a warm prefix cache holds the prompt's pages: prompt logprobs must still compute every prompt row
    eng.add_request("warm", PROMPT, params(2))
    run_all(eng)
    for i in range(3):
        eng.add_request(f"r{i}", PROMPT, params(6, logprobs=3, prompt_logprobs=2))
    events = run_all(eng)
    out = greedy_alone(tiny_weights, PROMPT, 6)
    ref = oracle_logprobs(tiny_weights, PROMPT + out)
    for i in range(3):
        ev = events[f"r{i}"]
        assert [t for e in ev for t in e.token_ids] == out
        pl = ev[0].prompt_logprobs
        assert pl is not None and pl[0] is None and len(pl) == len(PROMPT)
        assert all(e.prompt_logprobs is None for e in ev[1:])
        for q in range(1, len(PROMPT)):
            assert pl[q].token_id == PROMPT[q]
            assert pl[q].logprob == pytest.approx(float(ref[q - 1, PROMPT[q]]), abs=1e-4)
            top = torch.topk(ref[q - 1], 2)
            assert [t for t, _ in pl[q].top] == top.indices.tolist()
        lps = [lp for e in ev for lp in e.logprobs]
        assert [lp.token_id for lp in lps] == out
        for j, lp in enumerate(lps):
            row = ref[len(PROMPT) - 1 + j]
            assert lp.logprob == pytest.approx(float(row.max()), abs=1e-4)  # greedy: the top token
            assert len(lp.top) == 3 and lp.top[0][0] == out[j]
            assert [v for _, v in lp.top] == pytest.approx(torch.topk(row, 3).values.tolist(), abs=1e-4)
    assert eng.stats().pages_in_use == 0


def test_max_tokens_zero_scores_the_prompt_only(make_engine, tiny_weights):
    eng = make_engine(num_pages=32, page_size=4, max_batch=2, max_step_tokens=8)
    eng.add_request("s", PROMPT, SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=0))
    (ev,) = run_all(eng)["s"]
    assert ev.finished and ev.finish_reason == "length" and ev.token_ids == () and ev.completion_tokens == 0
    ref = oracle_logprobs(tiny_weights, PROMPT)
    assert [lp.logprob for lp in ev.prompt_logprobs[1:]] == pytest.approx(
        [float(ref[q - 1, PROMPT[q]]) for q in range(1, len(PROMPT))], abs=1e-4)
    assert eng.stats().pages_in_use == 0 and eng.stats().generation_tokens == 0


def test_no_logprobs_unless_asked(make_engine):
    eng = make_engine(num_pages=32, page_size=4)
    eng.add_request("a", PROMPT, params(3))
    ev = run_all(eng)["a"]
    assert all(e.logprobs == () and e.prompt_logprobs is None for e in ev)


class ScriptGrammar:
    """A stand-in grammar: allows exactly ``script`` and then only ``stop`` (a complete document)."""

    def __init__(self, script, stop, vocab=256):
        self.script, self.stop, self.vocab_size = list(script), stop, vocab

    def matcher(self):
        g = self

        class M:
            pos, finished = 0, False

            def allowed(self):
                t = g.script[self.pos] if self.pos < len(g.script) else g.stop
                words = torch.zeros((g.vocab_size + 31) // 32, dtype=torch.int32)
                words[t // 32] = torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)
                return words

            def accept(self, t):
                want = g.script[self.pos] if self.pos < len(g.script) else g.stop
                if t != want:
                    return False
                self.pos += 1
                self.finished = self.pos > len(g.script)
                return True
        return M()


def test_a_grammar_constrains_greedy_and_sampled_output_and_ends_it(make_engine):
    eng = make_engine(num_pages=32, page_size=4)
    script = [100, 200, 65, 66]
    eng.add_request("g", PROMPT, SamplingParams(temperature=0, max_tokens=20, grammar=ScriptGrammar(script, 2)))
    eng.add_request("s", PROMPT, SamplingParams(temperature=1.5, seed=3, max_tokens=20,
                                                grammar=ScriptGrammar(script, 2)))
    eng.add_request("i", PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                grammar=ScriptGrammar(script, 2)))
    eng.add_request("short", PROMPT, SamplingParams(temperature=0, max_tokens=2, grammar=ScriptGrammar(script, 2)))
    ev = run_all(eng)
    for rid in ("g", "s", "i"):
        assert [t for e in ev[rid] for t in e.token_ids] == script + [2]
        assert ev[rid][-1].finish_reason == "stop"
    assert [t for e in ev["short"] for t in e.token_ids] == script[:2]
    assert ev["short"][-1].finish_reason == "length"  # cut mid-document, as OpenAI reports it


def penalized_greedy(weights, prompt, n, freq=0.0, pres=0.0, rep=1.0):
    """The oracle with the penalty formulas written out: full forward per token, penalise, argmax."""
    toks, out = list(prompt), []
    for _ in range(n):
        x = ReferenceDecoder(weights).forward(torch.tensor(toks), [Segment(tuple(range(64)), 0, len(toks))],
                                              PagedKVCache(KVLayout.for_spec(weights.spec, 16, 64, weights.dtype)))[-1]
        for t in set(toks):
            x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
        for t in set(out):
            x[t] -= freq * out.count(t) + pres
        out.append(int(torch.argmax(x)))
        toks.append(out[-1])
    return out


def test_penalties_use_the_requests_own_history(make_engine, tiny_weights):
    eng = make_engine(num_pages=64, page_size=4)
    # negative penalties reward repetition, which this random model's plain output does not show
    eng.add_request("p", [7, 7, 7], params(8, frequency_penalty=-1.5, presence_penalty=-0.5))
    eng.add_request("r", [7, 7, 7], params(8, repetition_penalty=0.3))
    eng.add_request("plain", [7, 7, 7], params(8))
    ev = run_all(eng)
    toks = {k: [t for e in v for t in e.token_ids] for k, v in ev.items()}
    assert toks["plain"] == greedy_alone(tiny_weights, [7, 7, 7], 8)
    assert toks["p"] == penalized_greedy(tiny_weights, [7, 7, 7], 8, freq=-1.5, pres=-0.5)
    assert toks["r"] == penalized_greedy(tiny_weights, [7, 7, 7], 8, rep=0.3)
    assert toks["p"] != toks["plain"] and toks["r"] != toks["plain"]


def test_logit_bias_out_of_vocabulary_is_a_request_error(make_engine):
    eng = make_engine(num_pages=32, page_size=4)
    with pytest.raises(RequestError) as e:
        eng.add_request("a", PROMPT, params(3, logit_bias={256: 1.0}))
    assert e.value.param == "logit_bias"


def test_times_and_token_counters(make_engine):
    eng = make_engine(num_pages=32, page_size=4)
    eng.add_request("a", PROMPT, params(5))
    eng.add_request("b", PROMPT[:5], params(50))
    for _ in range(3):
        eng.step()
    assert eng.abort("b")
    ev = run_all(eng)["a"]
    t = ev[-1].times
    assert t is not None and t.arrival <= t.scheduled <= t.first_token <= t.finished
    assert all(e.times is None for e in ev[:-1])
    s = eng.stats()
    assert s.generation_tokens == 5 + 3  # the aborted request's tokens count too
    assert s.prompt_tokens == len(PROMPT) + 5
