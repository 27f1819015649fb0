import pytest

from mimw.models.default_model import default_gguf_path
from mimw.models.errors import CheckpointError
from mimw.engine.detokenize import TextStream
from mimw.models.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(default_gguf_path(), eos_token_ids=(2,))


def test_gguf_tokenizer_basics(tok):
    assert tok.vocab_size == 49152 and tok.eos_token_ids == (2,) and tok.bos_token_id == 1
    ids = tok.encode("The capital of France is")
    assert ids == [504, 3575, 282, 4649, 314]  # SmolLM2's published tokenizer gives these ids
    assert tok.decode(ids) == "The capital of France is"
    assert tok.encode("héllo 世界", add_special_tokens=False) == tok.encode("héllo 世界")  # no BOS added


def test_chat_template(tok):
    assert tok.has_chat_template
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>user\nhi<|im_end|>\n"
                                                                      "<|im_start|>assistant\n")
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> / <|im_end|> are single special tokens
    no_prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert ids[:len(no_prompt)] == no_prompt and len(no_prompt) < len(ids)


def test_hf_dir_tokenizer_matches_gguf_one(tok, tmp_path):
    tok.hf.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 7]}')
    d = Tokenizer.from_hf_dir(tmp_path)
    assert d.eos_token_ids == (2, 7)
    text = "Hello, world! ¿Qué tal? 日本語 🙂"
    assert d.encode(text) == tok.encode(text)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    assert d.apply_chat_template(msgs) == tok.apply_chat_template(msgs)


def test_tokenizer_errors(tmp_path):
    with pytest.raises(CheckpointError, match="cannot build a tokenizer"):
        Tokenizer.from_hf_dir(tmp_path)


@pytest.mark.parametrize("text", ["plain ascii words", "naïve café — 日本語のテキスト 🙂🚀 done", "  spaces\n\ttabs"])
def test_text_stream_never_splits_characters(tok, text):
    ids = tok.encode(text)
    prompt = tok.encode("Prompt:")
    ts = TextStream(tok, prompt)
    deltas = [ts.push(i)[0] for i in ids] + [ts.finish()]
    assert "".join(deltas) == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
    if any(ord(c) > 0x7FF for c in text):  # byte-level BPE splits these characters across tokens
        assert "" in deltas[:-1]


def test_tokenizers_build_without_network(tmp_path, monkeypatch):
    import socket

    def no_network(*args, **kwargs):
        raise OSError("network access attempted while building a tokenizer")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    t = Tokenizer.from_gguf(default_gguf_path())
    t.hf.save_pretrained(tmp_path)
    assert Tokenizer.from_hf_dir(tmp_path).encode("offline") == t.encode("offline")
