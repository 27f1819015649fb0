"""``mimw bench spec --warm N``: the warm-up pool (other topics than the measured chat set) and the warm-up itself,
which answers the pool with plain greedy decoding and hands each answer to the drafters as a finished request (the
suffix drafter's global history then continues a warm answer another request starts to repeat)."""
import pytest

from mimw.bench.main import main as bench_main
from mimw.bench.spec import warm_up
from mimw.bench.spec_prompts import CHAT, warm_prompts


def test_the_warm_pool_is_distinct_prompts_none_of_the_measured_set_and_bounded():
    pool = warm_prompts(272)
    texts = [p.messages[0]["content"] for p in pool]
    assert len(set(texts)) == 272 and not set(texts) & set(CHAT)
    assert [p.name for p in warm_prompts(3)] == ["warm0", "warm1", "warm2"] and warm_prompts(0) == []
    with pytest.raises(ValueError, match="--warm"):
        warm_prompts(273)


def test_a_warm_range_error_is_one_line_before_any_model_loads(capsys):
    assert bench_main(["spec", "--warm", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--warm must be in [0, 272]" in err and "Traceback" not in err


@pytest.mark.slow
def test_the_warm_up_hands_plain_answers_to_the_suffix_drafter():
    from mimw.engine.backends.reference import ReferenceBackend
    from mimw.engine.sampling import SamplingParams
    from mimw.engine.spec.config import SpecConfig
    from mimw.engine.spec.drafter import DraftInput
    from mimw.engine.spec.speculator import Speculator, make_drafter
    from mimw.models.checkpoint import load_model

    model = load_model(None, progress=False)
    tok, backend = model.tokenizer, ReferenceBackend(model.weights)
    cfg = SpecConfig("suffix", num_tokens=6)
    sp = Speculator(make_drafter(cfg), cfg)
    prompts = [tok.apply_chat_template(list(p.messages)) for p in warm_prompts(3)]
    answers = warm_up(backend, tok, [sp], prompts, 24)
    assert len(answers) == 3 and all(len(a) >= 12 for a in answers)
    # another request whose output starts as a warm answer did: the drafter continues it from the global history
    other = tok.apply_chat_template([{"role": "user", "content": "Say something."}])
    out = answers[1]
    x = DraftInput("new", other + out[:10], len(other), SamplingParams(temperature=0, max_tokens=64))
    draft = sp.drafter.propose_one(x, 6)
    assert draft and draft == out[10:10 + len(draft)]
