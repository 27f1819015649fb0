"""`mimw serve --tensor-parallel 2` under torchrun on the CPU (two gloo ranks, the reference backend): it serves,
and its greedy completions are the one-process server's over the same weights (two ranks sum each partial pair the
same way every run, so the comparison is exact and repeatable); stopping rank 0 stops rank 1, which exits cleanly."""
import argparse
import os
import signal
import socket
import re
import subprocess
import sys
import threading
import time

import httpx
import pytest
from server_helpers import serve_app

from mimw.server.main import add_arguments, build

pytestmark = pytest.mark.slow

ARGS = ["--model", "tiny-llama", "--device", "cpu", "--kv-pages", "64", "--page-size", "8", "--max-batch", "4"]
PROMPTS = ["the ranks", "tensor parallel serving on two processes"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _completions(url: str) -> list[str]:
    out = []
    for p in PROMPTS:
        r = httpx.post(url + "/v1/completions", json={"model": "tiny-llama", "prompt": p, "max_tokens": 10,
                                                      "temperature": 0, "logprobs": 1}, timeout=60)
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["logprobs"]["tokens"])
    return out


def test_two_ranks_serve_the_one_process_servers_completions():
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(_free_port()), "-m", "mimw.server.main", "--tensor-parallel", "2", "--port", str(port), *ARGS]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 180
        while True:
            assert proc.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "the tensor-parallel server did not come up"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        got = _completions(url)
        rank0 = int(re.search(r"Started server process \[(\d+)\]", "".join(lines)).group(1))
        os.kill(rank0, signal.SIGINT)  # Ctrl-C: rank 0 stops serving and stops rank 1, which exits by itself
        proc.wait(60)  # (torchrun reports rank 0's end by the signal as a failure: its exit code says nothing here)
        reader.join(10)
        log = "".join(lines)
        assert "tensor parallel over 2 ranks" in log and re.search(r"rank 1: ran \d+ steps of rank 0", log), log
        assert "local_rank: 1" not in log, log  # rank 1 is in no failure report
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    p = argparse.ArgumentParser()
    add_arguments(p)
    b = build(p.parse_args(ARGS))
    try:
        with serve_app(b.app) as one:
            want = _completions(one)
    finally:
        b.loop.stop()
    assert got == want and all(len(t) == 10 for t in want)
