"""The real server (uvicorn on 127.0.0.1, a free port) serving the embedded default model, shared by the server
tests (``server_helpers.serve_app`` puts another app - other limits, an API key - on its own port)."""
from __future__ import annotations

import argparse

import pytest
from server_helpers import serve_app

from mimw.server.main import add_arguments, build

SERVER_ARGS = ["--kv-pages", "384", "--page-size", "16", "--max-batch", "32", "--max-queue", "64",
               "--device", "cpu", "--dtype", "float32"]


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
