"""The server ``mimw bench serve`` measures: one already running on this machine (``--base-url``), or one it
starts itself on 127.0.0.1 - in a subprocess (``python -m mimw.server.main``, the default: the client's work does
not share the server's GIL) or in this process (uvicorn on a thread; for tests and quick looks).

Loopback only: the benchmark floods its target, so a URL whose host is not this machine is refused
(``check_loopback``).
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Sequence
from urllib.parse import urlsplit

import httpx

LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")


def check_loopback(url: str) -> str:
    """``url`` without a trailing slash, if its host is a loopback address; ``ValueError`` otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--base-url {url!r}: expected http://HOST:PORT")
    host = parts.hostname
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host.lower() in LOOPBACK_NAMES
    if not loopback:
        raise ValueError(f"--base-url {url}: {host} is not this machine; mimw bench serve only targets servers on a "
                         "loopback address (127.0.0.0/8, ::1, localhost)")
    return url.rstrip("/").removesuffix("/v1")


def wait_healthy(url: str, timeout_s: float, alive=lambda: True) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url + "/health", timeout=5, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if not alive():
            raise RuntimeError("the server exited during start-up")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server at {url} was not healthy after {timeout_s:.0f} s")
        time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SubprocessServer:
    """``mimw serve`` in a child process on 127.0.0.1; its output goes to ``log_path``."""

    def __init__(self, server_args: Sequence[str], log_path: Path, timeout_s: float):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "mimw.server.main", *server_args, "--host", "127.0.0.1",
               "--port", str(self.port)]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "w")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_healthy(self.url, timeout_s, alive=lambda: self.proc.poll() is None)
        except RuntimeError as e:
            self.stop()
            tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
            raise RuntimeError(f"{e}; the end of {log_path}: " + " / ".join(tail)) from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class InProcessServer:
    """The server built in this process (``mimw.server.main.build``) and served by uvicorn on a thread."""

    def __init__(self, server_args: Sequence[str], timeout_s: float):
        import uvicorn

        from ..server.main import add_arguments, bind, build

        p = argparse.ArgumentParser(prog="mimw serve")
        add_arguments(p)
        self.built = build(p.parse_args(list(server_args)))
        self.sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.built.app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        try:
            wait_healthy(self.url, timeout_s, alive=self.thread.is_alive)
        except RuntimeError:
            self.stop()
            raise

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()
        self.built.loop.stop()
