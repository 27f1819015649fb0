"""Grammars on the default model's tokenizer (xgrammar): a valid document walks through, the mask excludes what
the schema forbids, a complete document ends with a stop token, invalid schemas are ``GrammarError``."""
import json

import pytest
import torch

from mimw.engine.grammar import GrammarCompiler, GrammarError
from mimw.engine.sampling import SamplingParams, TokenContext, sample_batch


@pytest.fixture(scope="module")
def tok():
    from mimw.models.default_model import default_gguf_path
    from mimw.models.tokenizer import Tokenizer
    return Tokenizer.from_gguf(default_gguf_path())


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok.hf, 49152, tok.eos_token_ids)


def allowed_ids(matcher):
    words = matcher.allowed()
    ids = torch.arange(49152)
    return set(torch.nonzero((words[ids >> 5] >> (ids & 31)) & 1).flatten().tolist())


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
          "required": ["ok", "n"], "additionalProperties": False}


def test_a_valid_document_walks_through_and_ends_with_eos(compiler, tok):
    m = compiler.json_schema(SCHEMA).matcher()
    for t in tok.encode('{"ok": true, "n": 42}', add_special_tokens=False):
        assert t in allowed_ids(m)
        assert m.accept(t) and not m.finished
    assert allowed_ids(m) == set(tok.eos_token_ids)  # the document is complete: only a stop token may follow
    assert m.accept(tok.eos_token_ids[0]) and m.finished


def test_the_mask_forbids_what_the_schema_forbids(compiler, tok):
    m = compiler.json_schema(SCHEMA).matcher()
    first = allowed_ids(m)
    assert tok.encode("{", add_special_tokens=False)[0] in first
    assert tok.encode("[", add_special_tokens=False)[0] not in first and tok.eos_token_ids[0] not in first
    assert not m.accept(tok.encode("hello", add_special_tokens=False)[0])


def test_greedy_sampling_under_the_mask_yields_valid_json(compiler, tok):
    m = compiler.json_object().matcher()
    p = SamplingParams(temperature=0)
    out = []
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):  # random logits: the grammar alone keeps every token valid
        t = sample_batch(torch.randn(1, 49152, generator=gen), [p], [None], [TokenContext(allowed=m.allowed())])[0]
        assert m.accept(t)
        if m.finished:
            break
        out.append(t)
    if m.finished:  # and a finished document parses
        assert isinstance(json.loads(tok.decode(out)), dict)
    else:
        assert tok.decode(out).startswith("{")


@pytest.mark.parametrize("schema", [{"type": "foo"}, {"properties": 5}, {"$ref": "#/nowhere"}, "not a schema",
                                    {"type": "string", "pattern": "(["}])
def test_invalid_schemas_are_grammar_errors(compiler, schema):
    with pytest.raises(GrammarError, match="schema"):
        compiler.json_schema(schema)


def test_deep_schemas_are_refused_before_compiling(compiler):
    s = {"type": "string"}
    for _ in range(900):  # deeper than Python's JSON encoder recursion
        s = {"type": "object", "properties": {"a": s}}
    with pytest.raises(GrammarError, match="levels deep"):
        compiler.json_schema(s)
