"""``mimw serve`` start-up and operations: flags checked before the model loads (one line, exit code 2), the port
bound first, the API key from the environment, and no query string in the access log."""
import logging
import socket
import threading
import time

import httpx
import pytest
import torch
import uvicorn

from mimw.models import checkpoint
from mimw.server import main as serve
from mimw.server.access_log import QueryRedactor, redact_access_log


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if the model starts loading: every check here must come before it."""
    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the flags were checked")
    monkeypatch.setattr(checkpoint, "load_model", refuse)


def one_error_line(capsys, needle):
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("mimw serve: error:") and needle in lines[-1], err
    assert "Traceback" not in err


@pytest.mark.parametrize("port", ["0", "65536", "-1", "http"])
def test_port_out_of_range_is_a_usage_error(port, capsys):
    with pytest.raises(SystemExit) as e:
        serve.main(["--port", port])
    assert e.value.code == 2 and "--port" in capsys.readouterr().err


def test_port_in_use_fails_before_the_model_loads(no_model_load, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert serve.main(["--port", str(port), "--model", "tiny-llama", "--device", "cpu"]) == 2
    one_error_line(capsys, f"127.0.0.1:{port} is already in use")


def test_unresolvable_host_fails_before_the_model_loads(no_model_load, capsys):
    assert serve.main(["--host", "no-such-host.invalid", "--model", "tiny-llama"]) == 2
    one_error_line(capsys, "--host no-such-host.invalid")


@pytest.mark.parametrize("argv, cuda, needle", [
    (["--backend", "megakernel", "--device", "cpu"], True, "not with --device cpu"),
    (["--backend", "megakernel"], False, "needs a Hopper GPU"),
    (["--device", "cuda"], False, "no CUDA device"),
    (["--device", "cuda:3"], True, "has 1 CUDA device"),
    (["--device", "tpu"], False, "expected auto, cpu, cuda or cuda:N"),
    (["--device", "cuda:x"], False, "expected auto, cpu, cuda or cuda:N"),
    (["--api-key", " "], False, "must not be empty"),
])
def test_device_backend_and_key_are_checked_before_the_model_loads(monkeypatch, no_model_load, capsys, argv,
                                                                   cuda, needle):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1 if cuda else 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100")
    assert serve.main(["--port", "1", *argv]) == 2  # port 1 is never bound: the checks come first
    one_error_line(capsys, needle)


def test_megakernel_on_a_non_hopper_gpu_names_the_gpu(monkeypatch, no_model_load, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100")
    assert serve.main(["--backend", "megakernel", "--port", "1"]) == 2
    one_error_line(capsys, "NVIDIA A100 is sm_80")


def test_api_key_from_the_environment():
    p = serve.argparse.ArgumentParser()
    serve.add_arguments(p)
    env = {serve.API_KEY_ENV: "s3cret"}
    assert serve.with_env_api_key(p.parse_args([]), env).api_key == "s3cret"
    assert serve.with_env_api_key(p.parse_args(["--api-key", "flag"]), env).api_key == "flag"
    assert serve.with_env_api_key(p.parse_args([]), {}).api_key is None
    assert "s3cret" not in p.format_help()


def test_query_strings_never_reach_the_access_log(built):
    """uvicorn as `mimw serve` sets it up: the access log at info level, with the redactor installed."""
    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(self.format(record))

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(built.app, log_level="info", timeout_graceful_shutdown=2))
    redact_access_log()
    access = logging.getLogger("uvicorn.access")
    keep = Keep()
    keep.setFormatter(logging.getLogger("uvicorn.access").handlers[0].formatter)
    access.addHandler(keep)
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(url + "/health?api_key=s3cret&token=abc").status_code == 200
        assert httpx.get(url + "/v1/models?key=s3cret").status_code == 200
    finally:
        server.should_exit = True
        t.join(10)
        access.removeHandler(keep)
        sock.close()
    assert len(lines) == 2 and all("s3cret" not in line and "abc" not in line for line in lines), lines
    assert "/health?<redacted>" in lines[0] and "/v1/models?<redacted>" in lines[1]


def test_redactor_leaves_other_records_alone():
    f = QueryRedactor()
    plain = logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                              ("1.2.3.4:5", "GET", "/health", "1.1", 200), None)
    other = logging.LogRecord("x", logging.INFO, "", 0, "%s", ("a?b",), None)
    assert f.filter(plain) and plain.args[2] == "/health"
    assert f.filter(other) and other.args == ("a?b",)


@pytest.mark.parametrize("argv, env, needle", [
    (["--tensor-parallel", "2"], {}, "torchrun --nproc-per-node 2"),
    (["--tensor-parallel", "2"], {"WORLD_SIZE": "4"}, "WORLD_SIZE is 4"),
    (["--tensor-parallel", "2", "--host-kv-gb", "1"], {"WORLD_SIZE": "2"}, "--host-kv-gb with --tensor-parallel"),
])
def test_tensor_parallel_flags_are_checked_before_the_model_loads(monkeypatch, no_model_load, capsys, argv, env,
                                                                  needle):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert serve.main(["--port", "1", "--device", "cpu", *argv]) == 2
    one_error_line(capsys, needle)


def test_tensor_parallel_megakernel_serving_is_refused_by_name(monkeypatch):
    p = serve.argparse.ArgumentParser()
    serve.add_arguments(p)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    with pytest.raises(ValueError, match="--tensor-parallel with --backend megakernel"):
        serve.check_args(p.parse_args(["--tensor-parallel", "2", "--backend", "megakernel"]))
