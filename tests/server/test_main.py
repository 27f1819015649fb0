"""``mimw serve`` construction: flags -> engine + app, clear errors for bad flags, the tokenizer fallback."""
import argparse
import json

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


def test_fp8_kv_pool_holds_about_twice_the_tokens_in_the_same_memory():
    import torch

    from mimw.kv.fp8 import FP8
    from mimw.kv.pages import KVLayout
    from mimw.models.spec import PRESETS
    from mimw.server.main import _default_pages

    spec = PRESETS["llama-3.2-1b"]
    pages = {dt: _default_pages(KVLayout.for_spec(spec, 16, 1, dt), torch.device("cpu"), 10 ** 6, 10 ** 6)
             for dt in (torch.bfloat16, FP8)}  # the 1 GiB CPU budget binds
    hd = spec.head_dim  # a row costs hd bytes + a 2-byte scale instead of 2 * hd bytes
    assert pages[FP8] / pages[torch.bfloat16] == pytest.approx(2 * hd / (hd + 2), rel=1e-3)


def test_fp8_kv_start_up_report():
    b = build(parse("--model", "tiny-llama", "--kv-pages", "32", "--page-size", "8", "--device", "cpu",
                    "--kv-dtype", "fp8"))
    try:
        cache = b.loop.engine.cache
        assert cache.layout.quantized and cache.k_scale is not None
        assert "32 pages x 8 tokens = 256 tokens" in b.summary and "fp8 e4m3" in b.summary
    finally:
        b.loop.stop()


def test_fp8_kv_on_the_megakernel_backend_passes_the_flag_checks(capsys):
    """--kv-dtype fp8 is a flag of every backend: on a machine without a Hopper GPU the megakernel backend is
    refused for the GPU (one line, exit 2), not for the KV element type."""
    assert main(["--model", "tiny-llama", "--backend", "megakernel", "--kv-dtype", "fp8", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "Hopper" in err and "fp8" not in err.lower() and "Traceback" not in err


def test_no_overlap_flag_and_the_same_stream_either_way():
    texts = {}
    for flags in ((), ("--no-overlap",)):
        b = build(parse("--model", "tiny-llama", "--kv-pages", "32", "--page-size", "8", "--max-batch", "4",
                        "--device", "cpu", *flags))
        try:
            assert b.loop.engine.config.overlap is not bool(flags)
            with serve_app(b.app) as url:
                body = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 12, "temperature": 0.8, "seed": 5,
                        "ignore_eos": True, "stream": True}
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                    lines = [x for x in r.iter_lines() if x.startswith("data: ")]
                assert lines[-1] == "data: [DONE]"
                chunks = [json.loads(x[6:]) for x in lines[:-1]]
                texts[flags] = [c["choices"][0]["text"] for c in chunks if c["choices"]]
                assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        finally:
            b.loop.stop()
    assert "".join(texts[()]) == "".join(texts[("--no-overlap",)]) and "".join(texts[()])
