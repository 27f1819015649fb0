"""``mimw bench serve`` end to end on the CPU against the real server (tiny random-weight model; the default
SmolLM2 for the chat endpoint): the reports, the bounds, the launchers, and a dataset plugged in from outside."""
import json
import random
from dataclasses import dataclass

import pytest

from mimw.bench import main as bench_main
from mimw.bench import serve_dataset
from mimw.bench.serve_dataset import BenchRequest
from mimw.bench.serve_target import InProcessServer

TINY = ["--model", "tiny-llama", "--device", "cpu", "--max-batch", "8", "--kv-pages", "64", "--page-size", "8"]


@pytest.fixture(scope="module")
def tiny_server():
    s = InProcessServer(TINY, timeout_s=120)
    yield s
    s.stop()


def bench(tmp_path, *argv):
    rc = bench_main.main(["serve", "--out", str(tmp_path), "--disable-tqdm", *argv])
    docs = sorted(tmp_path.glob("*-serve-*.json"))
    return rc, (json.loads(docs[-1].read_text()) if docs else None)


def test_random_dataset_against_a_running_server(tmp_path, tiny_server, capsys):
    rc, doc = bench(tmp_path, "--base-url", tiny_server.url, "--model", "tiny-llama", "--num-prompts", "8",
                    "--random-input-len", "24", "--random-output-len", "10", "--max-concurrency", "4",
                    "--request-rate", "50,inf", "--random-prefix-len", "16")
    assert rc == 0
    assert [r["request_rate"] for r in doc["runs"]] == [50.0, None] and doc["model"] == "tiny-llama"
    for run in doc["runs"]:
        s = run["summary"]
        assert (s["completed"], s["failed"], s["output_tokens"], s["input_tokens"]) == (8, 0, 80, 8 * 40)
        assert all(r["prompt_tokens"] == 40 and r["output_tokens"] == 10 for r in run["requests"])
        assert 0 < s["ttft_ms"]["p50"] <= s["e2e_ms"]["p50"] and s["tpot_ms"]["mean"] > 0
        assert s["request_throughput"] > 0 and s["output_throughput"] == pytest.approx(80 / s["duration_s"])
        assert max(r["start_s"] for r in run["requests"]) > 0  # the arrivals are spread (or queued)
    assert doc["runs"][1]["summary"]["cached_tokens"] >= 8 * 16  # the shared prefix, cached by the first rate
    out = capsys.readouterr().out
    assert "| 50 | 4 | 8 / 8 |" in out and "| inf | 4 | 8 / 8 |" in out
    assert len(list(tmp_path.glob("*.md"))) == 1 and len(list(tmp_path.glob("*.png"))) == 1


def test_non_loopback_targets_are_refused(tmp_path, capsys):
    rc, doc = bench(tmp_path, "--base-url", "http://192.0.2.1:8000", "--model", "tiny-llama")
    assert rc == 2 and doc is None
    err = capsys.readouterr().err
    assert "192.0.2.1 is not this machine" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, match", [
    (["--num-prompts", "0"], "--num-prompts"), (["--num-prompts", "100001"], "--num-prompts"),
    (["--request-rate", "0"], "--request-rate"), (["--max-concurrency", "0"], "--max-concurrency"),
    (["--dataset-name", "nope"], "--dataset-name"), (["--dataset-name", "sharegpt"], "--dataset-path"),
    (["--model", "/no/such/model"], "does not exist"),
])
def test_bad_options_are_one_line_errors(tmp_path, capsys, argv, match):
    rc, _ = bench(tmp_path, "--base-url", "http://127.0.0.1:9", *(["--model", "tiny-llama"] if "--model" not in argv
                                                                  else []), *argv)
    err = capsys.readouterr().err
    assert rc == 2 and match in err.strip().splitlines()[-1] and "Traceback" not in err


def test_max_duration_bounds_a_run(tmp_path, tiny_server):
    rc, doc = bench(tmp_path, "--base-url", tiny_server.url, "--model", "tiny-llama", "--num-prompts", "6",
                    "--random-input-len", "8", "--random-output-len", "400", "--max-concurrency", "1",
                    "--max-duration", "1")
    s = doc["runs"][0]["summary"]
    assert rc == 0 and s["completed"] < 6 and s["failed"] == 6 - s["completed"]
    assert set(s["errors"]) <= {"cancelled", "not sent"}


@dataclass(frozen=True)
class _Replay:
    """A dataset from outside (as a trace reader would be): its own arrival times."""

    name: str = "replay"

    def requests(self, num, rng):
        return [BenchRequest(tuple(range(1, 9)), 8, 4, arrival_s=0.3 * i) for i in range(num)]


def test_a_dataset_plugs_in_and_keeps_its_arrival_times(tmp_path, tiny_server, monkeypatch):
    monkeypatch.setitem(serve_dataset.DATASETS, "replay", lambda args, tok, vocab: _Replay())
    rc, doc = bench(tmp_path, "--base-url", tiny_server.url, "--model", "tiny-llama", "--dataset-name", "replay",
                    "--num-prompts", "4")
    assert rc == 0 and doc["dataset"] == "replay" and doc["runs"][0]["summary"]["completed"] == 4
    starts = [r["start_s"] for r in doc["runs"][0]["requests"]]
    assert [round(s, 1) for s in starts] == [0.0, 0.3, 0.6, 0.9]


@pytest.mark.slow
def test_launches_its_own_server_in_a_subprocess(tmp_path):
    rc, doc = bench(tmp_path, "--model", "tiny-llama", "--server-args", "--device cpu --kv-pages 64",
                    "--num-prompts", "4", "--random-input-len", "8", "--random-output-len", "4")
    assert rc == 0 and doc["runs"][0]["summary"]["completed"] == 4
    assert doc["target"].startswith("http://127.0.0.1:")
    log = next(tmp_path.glob("*.server.log")).read_text()
    assert "OpenAI-compatible API" in log


@pytest.mark.slow
def test_chat_endpoint_with_sharegpt_on_the_default_model(tmp_path):
    convs = [{"conversations": [{"from": "human", "value": f"Tell me a fact about the number {i}."},
                                {"from": "gpt", "value": "It is a number that people use every day."}]}
             for i in range(3)]
    (tmp_path / "sg.json").write_text(json.dumps(convs))
    rc, doc = bench(tmp_path, "--launch", "in-process", "--server-args", "--device cpu --kv-pages 64",
                    "--endpoint", "/v1/chat/completions", "--dataset-name", "sharegpt",
                    "--dataset-path", str(tmp_path / "sg.json"), "--sharegpt-output-len", "6", "--num-prompts", "3")
    assert rc == 0
    s = doc["runs"][0]["summary"]
    assert (s["completed"], s["output_tokens"]) == (3, 18) and s["ttft_ms"]["p50"] > 0
    assert all(r["prompt_tokens"] > r["prompt_len"] for r in doc["runs"][0]["requests"])  # the chat template's
