"""The real server (uvicorn on 127.0.0.1, a free port) serving the embedded default model, shared by the server
tests; plus ``serve_app`` to put another app (other limits, an API key) on its own port."""
from __future__ import annotations

import argparse
import contextlib
import socket
import threading
import time

import pytest
import uvicorn

from mimw.server.main import add_arguments, build

SERVER_ARGS = ["--kv-pages", "384", "--page-size", "16", "--max-batch", "32", "--max-queue", "64",
               "--device", "cpu", "--dtype", "float32"]


@contextlib.contextmanager
def serve_app(app):
    """Run ``app`` with uvicorn in a thread; yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert t.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        t.join(10)
        sock.close()


@pytest.fixture(scope="session")
def built():
    p = argparse.ArgumentParser()
    add_arguments(p)
    b = build(p.parse_args(SERVER_ARGS))
    yield b
    b.loop.stop()


@pytest.fixture(scope="session")
def base_url(built):
    with serve_app(built.app) as url:
        yield url


@pytest.fixture(scope="session")
def model_name(built):
    return built.model_name
