"""/metrics as dashboards read it: a model_name label on every mimw series, KV usage as a fraction, the request
phase histograms, and token counters that count tokens as they are generated (aborted requests included)."""
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from test_serving import wait_idle

VLLM_NAMES = ["mimw_num_requests_running", "mimw_num_requests_waiting", "mimw_kv_cache_usage_perc",
              "mimw_prompt_tokens", "mimw_generation_tokens", "mimw_request_success",
              "mimw_time_to_first_token_seconds", "mimw_inter_token_latency_seconds",
              "mimw_request_time_per_output_token_seconds", "mimw_e2e_request_latency_seconds",
              "mimw_request_queue_time_seconds", "mimw_request_prefill_time_seconds",
              "mimw_request_decode_time_seconds", "mimw_request_inference_time_seconds",
              "mimw_request_prompt_tokens", "mimw_request_generation_tokens", "mimw_num_preemptions",
              "mimw_prefix_cache_queries", "mimw_prefix_cache_hits", "mimw_request_params_max_tokens"]


def scrape(base_url):
    """{(sample name, frozenset of labels): value} of every mimw series."""
    out = {}
    for fam in text_string_to_metric_families(httpx.get(base_url + "/metrics").text):
        for s in fam.samples:
            if s.name.startswith("mimw_"):
                out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples, name, **labels):
    hits = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0]


def test_every_series_has_the_model_label_and_vllm_equivalents_exist(base_url, model_name):
    httpx.post(base_url + "/v1/completions", json={"model": model_name, "prompt": "Hi", "max_tokens": 2},
               timeout=60)
    samples = scrape(base_url)
    assert samples
    for (name, labels), _ in samples.items():
        assert ("model_name", model_name) in labels, name
    names = {n for n, _ in samples}
    for base in VLLM_NAMES:
        assert any(n == base or n.startswith(base + "_") for n in names), base
    assert 0 <= value(samples, "mimw_kv_cache_usage_perc") <= 1


def test_histograms_and_token_counters_follow_a_request(base_url, model_name):
    wait_idle(base_url)
    before = scrape(base_url)
    r = httpx.post(base_url + "/v1/completions", json={"model": model_name, "prompt": "Once upon a time",
                                                       "max_tokens": 5, "temperature": 0, "ignore_eos": True},
                   timeout=60).json()
    wait_idle(base_url)
    after = scrape(base_url)

    def delta(name, **labels):
        return value(after, name, **labels) - (value(before, name, **labels) if any(
            n == name and set(labels.items()) <= ls for n, ls in before) else 0)

    assert delta("mimw_generation_tokens_total") == 5
    assert delta("mimw_prompt_tokens_total") == r["usage"]["prompt_tokens"]
    assert delta("mimw_request_success_total", finished_reason="length") == 1
    for h in ("mimw_request_queue_time_seconds", "mimw_request_prefill_time_seconds",
              "mimw_request_decode_time_seconds", "mimw_request_inference_time_seconds",
              "mimw_e2e_request_latency_seconds", "mimw_time_to_first_token_seconds",
              "mimw_request_time_per_output_token_seconds", "mimw_request_generation_tokens"):
        assert delta(h + "_count") == 1, h
    assert delta("mimw_inter_token_latency_seconds_count") == 4
    assert delta("mimw_request_generation_tokens_sum") == 5
    e2e = delta("mimw_e2e_request_latency_seconds_sum")
    parts = delta("mimw_request_queue_time_seconds_sum") + delta("mimw_request_inference_time_seconds_sum")
    assert parts == pytest.approx(e2e, abs=0.05)  # queue + inference is the request's whole life


def test_an_aborted_streams_tokens_are_counted(base_url, model_name):
    wait_idle(base_url)
    before = value(scrape(base_url), "mimw_generation_tokens_total")
    body = {"model": model_name, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    seen = 0
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            seen += line.startswith("data:")
            if seen == 4:
                break
    wait_idle(base_url, timeout=30)
    time.sleep(0.1)
    got = value(scrape(base_url), "mimw_generation_tokens_total") - before
    assert got >= 4  # every sampled token counts, also those the client never read
    assert value(scrape(base_url), "mimw_request_success_total", finished_reason="abort") >= 1
