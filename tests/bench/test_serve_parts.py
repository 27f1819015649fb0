"""The parts of ``mimw bench serve`` on their own: datasets, arrivals and concurrency, the numbers, the reports,
the loopback rule."""
import asyncio
import json
import math
import random
import statistics

import pytest

from mimw.bench.serve import parse_rates
from mimw.bench.serve_client import RequestResult
from mimw.bench.serve_dataset import BenchRequest, RandomDataset, ShareGPTDataset
from mimw.bench.serve_load import LoadPattern, run_load
from mimw.bench.serve_metrics import percentile, summarize
from mimw.bench.serve_report import markdown, write_chart, write_json
from mimw.bench.serve_target import check_loopback
from mimw.server.main import ByteTokenizer


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://127.4.5.6:1/", "http://[::1]:8000/v1",
                                 "http://localhost:9"])
def test_loopback_urls_are_accepted(url):
    assert check_loopback(url).startswith("http://") and not check_loopback(url).endswith(("/", "/v1"))


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "http://example.com", "http://0.0.0.0:8000",
                                 "http://[2001:db8::1]:80", "ftp://127.0.0.1", "127.0.0.1:8000"])
def test_other_hosts_are_refused(url):
    with pytest.raises(ValueError, match="base-url"):
        check_loopback(url)


def test_rates():
    assert parse_rates("1,2.5,inf") == [1.0, 2.5, math.inf]
    for bad in ("0", "-1", "fast", ""):
        with pytest.raises(ValueError, match="request-rate"):
            parse_rates(bad)


def test_random_dataset_lengths_and_shared_prefix():
    ds = RandomDataset(vocab_size=100, input_len=20, output_len=10, range_ratio=0.5, prefix_len=6)
    reqs = ds.requests(200, random.Random(0))
    assert all(6 + 10 <= r.prompt_len <= 6 + 30 and 5 <= r.output_len <= 15 for r in reqs)
    assert all(r.prompt[:6] == reqs[0].prompt[:6] and len(r.prompt) == r.prompt_len for r in reqs)
    assert all(0 <= t < 100 for r in reqs for t in r.prompt)
    assert len({r.prompt_len for r in reqs}) > 10  # spread
    assert ds.requests(5, random.Random(1)) == ds.requests(5, random.Random(1))


def _sharegpt(tmp_path, convs):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs))
    return path


def test_sharegpt_first_turns_with_reply_lengths(tmp_path):
    convs = [{"conversations": [{"from": "human", "value": f"question number {i}"},
                                {"from": "gpt", "value": "an answer " * (i + 1)}]} for i in range(6)]
    convs += [{"conversations": [{"from": "human", "value": "only one turn"}]},
              {"conversations": [{"from": "gpt", "value": "starts with the model"}, {"from": "human", "value": "x"}]},
              {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "a reply that is long"}]},
              {"something": "else"}]
    ds = ShareGPTDataset(_sharegpt(tmp_path, convs), ByteTokenizer(), max_len=200)
    reqs = ds.requests(6, random.Random(0))
    assert sorted(r.output_len for r in reqs) == [10 * (i + 1) for i in range(6)]  # bytes as tokens
    assert all(r.prompt.startswith("question number") and r.prompt_len == len(r.prompt) for r in reqs)
    with pytest.raises(ValueError, match="only 6 usable"):
        ds.requests(7, random.Random(0))
    fixed = ShareGPTDataset(ds.path, ByteTokenizer(), output_len=7).requests(3, random.Random(0))
    assert [r.output_len for r in fixed] == [7, 7, 7]


def test_sharegpt_bad_files(tmp_path):
    for content, match in (("not json", "not a readable JSON"), ('{"a": 1}', "JSON list"), ("[]", "no conversation")):
        p = tmp_path / "bad.json"
        p.write_text(content)
        with pytest.raises(ValueError, match=match):
            ShareGPTDataset(p, ByteTokenizer()).requests(1, random.Random(0))


def test_poisson_arrivals_and_burstiness():
    reqs = [BenchRequest((1,), 1, 1)] * 4000
    for burstiness, cv in ((1.0, 1.0), (4.0, 0.5), (0.25, 2.0)):
        t = LoadPattern(rate=10.0, burstiness=burstiness).arrival_times(reqs, random.Random(0))
        gaps = [b - a for a, b in zip(t, t[1:])]
        assert t[0] == 0 and abs(statistics.mean(gaps) - 0.1) < 0.01
        assert abs(statistics.pstdev(gaps) / statistics.mean(gaps) - cv) < 0.12 * cv
    assert LoadPattern().arrival_times(reqs[:3], random.Random(0)) == [0.0, 0.0, 0.0]
    own = [BenchRequest((1,), 1, 1, arrival_s=s) for s in (0.0, 0.5, 2.0)]
    assert LoadPattern(rate=100.0).arrival_times(own, random.Random(0)) == [0.0, 0.5, 2.0]
    for bad in (dict(rate=0), dict(burstiness=0), dict(max_concurrency=0), dict(max_duration_s=0)):
        with pytest.raises(ValueError):
            LoadPattern(**bad)


def test_concurrency_cap_and_replayed_times():
    inflight, peak, starts = [0], [0], []

    async def send(req, result):
        import time

        result.start = time.perf_counter()
        starts.append(result.start)
        inflight[0] += 1
        peak[0] = max(peak[0], inflight[0])
        await asyncio.sleep(0.05)
        inflight[0] -= 1
        result.chunk_times = [result.start + 0.01]
        result.output_tokens, result.ok = 1, True
        result.end = time.perf_counter()

    reqs = [BenchRequest((1,), 1, 1)] * 12
    results, duration = asyncio.run(run_load(reqs, LoadPattern(max_concurrency=3), send, random.Random(0)))
    assert peak[0] == 3 and all(r.ok for r in results) and 0.15 < duration < 2.0
    starts.clear()
    timed = [BenchRequest((1,), 1, 1, arrival_s=s) for s in (0.0, 0.2, 0.4)]
    asyncio.run(run_load(timed, LoadPattern(), send, random.Random(0)))
    assert [round(b - starts[0], 1) for b in starts] == [0.0, 0.2, 0.4]


def test_max_duration_cancels_and_stops_sending():
    async def send(req, result):
        import time

        result.start = time.perf_counter()
        await asyncio.sleep(10)

    reqs = [BenchRequest((1,), 1, 1)] * 4
    import time

    t = time.perf_counter()
    results, _ = asyncio.run(run_load(reqs, LoadPattern(max_concurrency=2, max_duration_s=0.3), send,
                                      random.Random(0)))
    assert time.perf_counter() - t < 2
    assert not any(r.ok for r in results) and all("max-duration" in r.error for r in results)


def _result(start, chunks, end, tokens, prompt=5):
    r = RequestResult(prompt, tokens, start=start, chunk_times=chunks, end=end, ok=True, output_tokens=tokens)
    r.prompt_tokens = prompt
    return r


def test_summary_numbers():
    a = _result(0.0, [0.1, 0.2, 0.4], 0.4, 3)  # ttft 100 ms, tpot 150 ms, itl 100/200, e2e 400
    b = _result(0.0, [0.3, 0.4], 0.5, 3)  # ttft 300, tpot 100, itl 100, e2e 500
    bad = RequestResult(5, 3, error="HTTP 429: busy")
    s = summarize([a, b, bad], duration_s=2.0)
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, {"HTTP 429": 1})
    assert s["output_tokens"] == 6 and s["input_tokens"] == 10
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 3.0 and s["total_token_throughput"] == 8.0
    assert s["ttft_ms"]["mean"] == pytest.approx(200) and s["ttft_ms"]["p50"] == pytest.approx(200)
    assert s["tpot_ms"]["mean"] == pytest.approx(125) and s["e2e_ms"]["max"] == pytest.approx(500)
    assert s["itl_ms"]["p50"] == pytest.approx(100) and s["itl_ms"]["max"] == pytest.approx(200)
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    empty = summarize([bad], 1.0)
    assert empty["ttft_ms"]["p99"] is None and empty["output_throughput"] == 0


def test_reports(tmp_path):
    a = _result(0.0, [0.1, 0.2, 0.4], 0.4, 3)
    runs = [{"label": f"rate {r}", "request_rate": r, "burstiness": 1.0, "max_concurrency": None,
             "summary": summarize([a], 1.0), "requests": [a.to_json()]} for r in (2.0, math.inf)]
    doc = {"model": "m", "dataset": "random", "config": {"endpoint": "/v1/completions"}, "runs": runs}
    md = markdown(doc)
    assert "| 2 | ∞ | 1 / 1 | 1.00 | 3.0 | 100.0 / 100.0 / 100.0 |" in md and "| inf |" in md
    write_json(tmp_path / "r.json", doc)
    assert json.loads((tmp_path / "r.json").read_text())["runs"][1]["request_rate"] is None
    write_chart(doc, tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
