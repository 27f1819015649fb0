"""``mimw serve`` construction: flags -> engine + app, clear errors for bad flags, the tokenizer fallback."""
import argparse

import httpx
import pytest
from server_helpers import serve_app

from mimw.server.main import add_arguments, build, main


def parse(*argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_bad_model_is_a_clear_error_not_a_traceback(capsys):
    assert main(["--model", "/no/such/model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mimw serve: error:") and "Traceback" not in err


@pytest.mark.parametrize("flag", ["--max-batch", "--kv-pages", "--page-size", "--max-queue"])
def test_non_positive_sizes_are_rejected_by_the_parser(flag):
    with pytest.raises(SystemExit):
        parse(flag, "0")


def test_preset_without_tokenizer_serves_bytes_and_has_no_chat(capsys):
    b = build(parse("--model", "tiny-llama", "--kv-pages", "32", "--page-size", "8", "--max-batch", "4",
                    "--device", "cpu"))
    try:
        assert b.model_name == "tiny-llama" and b.loop.engine.max_model_len == 256
        with serve_app(b.app) as url:
            r = httpx.post(url + "/v1/completions", json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 3,
                                                          "temperature": 0, "ignore_eos": True}, timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
            r = httpx.post(url + "/v1/chat/completions",
                           json={"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
    finally:
        b.loop.stop()
