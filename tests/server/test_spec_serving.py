"""``mimw serve --speculative``: the flags build a speculating engine, completions are unchanged, /metrics counts."""
import argparse

import httpx
import pytest
from server_helpers import serve_app

from mimw.server.main import add_arguments, build, main


def parse(*argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


BASE = ("--model", "tiny-llama", "--kv-pages", "64", "--page-size", "8", "--max-batch", "4", "--device", "cpu")


def completion(url, prompt):
    r = httpx.post(url + "/v1/completions", json={"model": "tiny-llama", "prompt": prompt, "max_tokens": 24,
                                                  "temperature": 0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.parametrize("flags", [("--speculative", "ngram"), ("--speculative", "suffix", "--spec-tokens", "3"),
                                   ("--speculative", "draft", "--draft-model", "tiny-llama")])
def test_speculating_server_answers_as_the_plain_one_and_counts(flags):
    prompt = "abcabcabcabcabcabc"
    plain = build(parse(*BASE))
    try:
        with serve_app(plain.app) as url:
            want = completion(url, prompt)
    finally:
        plain.loop.stop()
    b = build(parse(*BASE, *flags))
    try:
        assert "speculative " + flags[1] in b.summary
        with serve_app(b.app) as url:
            assert completion(url, prompt) == want
            metrics = httpx.get(url + "/metrics").text
        assert "mimw_spec_decode_num_accepted_tokens_total{" in metrics
        assert 'mimw_spec_decode_accepted_length_bucket{le="0",model_name="tiny-llama"}' in metrics
        drafted = float(metrics.split("\nmimw_spec_decode_num_draft_tokens_total{")[1].split("}")[1].split()[0])
        if flags[1] == "draft":
            # a draft model as large as the target costs a target step per drafted token: no acceptance could pay
            # for it, so the policy neither drafts nor probes (tests/engine/spec cover the draft model's drafts)
            assert drafted == 0
        else:
            assert drafted > 0
    finally:
        b.loop.stop()


@pytest.mark.parametrize("argv, match", [
    (("--spec-tokens", "4"), "need --speculative"),
    (("--speculative", "draft"), "--draft-model"),
    (("--speculative", "ngram", "--draft-model", "tiny-llama"), "only used with --speculative draft"),
    (("--speculative", "ngram", "--spec-tokens", "0"), "spec tokens"),
    (("--speculative", "draft", "--draft-model", "smollm2-135m"), "vocabulary"),
])
def test_bad_speculative_flags_exit_2(capsys, argv, match):
    assert main([*BASE, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mimw serve: error:") and match in err and "Traceback" not in err
