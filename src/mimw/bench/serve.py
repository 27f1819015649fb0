"""``mimw bench serve``: the serving benchmark (as ``vllm bench serve``), against an OpenAI-compatible server on
this machine.

One command: pick the target (``--base-url``, or a server started here with ``--model`` and ``--server-args``),
build the requests from a dataset (``serve_dataset``), send them at each ``--request-rate`` (or a fixed
``--max-concurrency``) with a progress bar (``serve_load``, ``serve_client``), and report TTFT, TPOT, ITL, E2E
and throughputs per rate (``serve_metrics``) as JSON, markdown and a chart (``serve_report``) in ``--out``. The JSON
is rewritten after every rate, so a run cut short keeps what it measured. Bounded: at most ``MAX_PROMPTS``
requests per rate, each rate at most ``--max-duration`` seconds.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import shlex
import sys
import time
from pathlib import Path
from typing import Any

MAX_PROMPTS = 100_000
API_KEY_ENV = "MIMW_API_KEY"


def add_arguments(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("target")
    t.add_argument("--base-url", default=None, metavar="URL",
                   help="a running server on this machine, e.g. http://127.0.0.1:8000 (loopback only); without it, "
                        "the benchmark starts `mimw serve --model MODEL SERVER_ARGS` on 127.0.0.1")
    t.add_argument("--model", default=None, metavar="PATH|PRESET",
                   help="what the server serves (its tokenizer builds the prompts); default: the embedded "
                        "SmolLM2-135M-Instruct")
    t.add_argument("--server-args", default="", metavar="ARGS",
                   help="more `mimw serve` flags for the server it starts, e.g. \"--max-batch 64 --device cuda\"")
    t.add_argument("--launch", default="subprocess", choices=("subprocess", "in-process"),
                   help="run the started server in a child process (default) or in this one")
    t.add_argument("--launch-timeout", type=float, default=600.0, metavar="S",
                   help="seconds the started server may take to become healthy (default 600)")
    t.add_argument("--served-model-name", default=None, help="model id to request (default: the server's first)")
    t.add_argument("--api-key", default=None, help=f"the server's API key (default: ${API_KEY_ENV})")
    t.add_argument("--endpoint", default="/v1/completions", choices=("/v1/completions", "/v1/chat/completions"))
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset-name", default="random", help="random (default) or sharegpt")
    d.add_argument("--dataset-path", default=None, metavar="FILE", help="the ShareGPT-format JSON file")
    d.add_argument("--num-prompts", type=int, default=100, help=f"requests per rate (default 100, at most {MAX_PROMPTS})")
    d.add_argument("--random-input-len", type=int, default=256, help="prompt tokens (default 256)")
    d.add_argument("--random-output-len", type=int, default=128, help="output tokens (default 128)")
    d.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len x (1 - r), len x (1 + r)] (default 0: fixed)")
    d.add_argument("--random-prefix-len", type=int, default=0, help="a prefix of this many tokens shared by all")
    d.add_argument("--sharegpt-output-len", type=int, default=None, help="output tokens (default: the reply's)")
    d.add_argument("--sharegpt-max-len", type=int, default=2048, help="skip pairs longer than this in all")
    d.add_argument("--seed", type=int, default=0)
    ld = p.add_argument_group("load")
    ld.add_argument("--request-rate", default="inf", metavar="R[,R...]",
                    help="requests per second (Poisson arrivals); several rates run one after the other; inf "
                         "(default) sends all at once")
    ld.add_argument("--burstiness", type=float, default=1.0,
                    help="gamma shape of the arrival gaps: 1 Poisson, < 1 burstier, > 1 more regular")
    ld.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    ld.add_argument("--max-duration", type=float, default=600.0, metavar="S",
                    help="seconds per rate at most; later requests are not sent, running ones are cancelled")
    ld.add_argument("--request-timeout", type=float, default=300.0, metavar="S")
    o = p.add_argument_group("output")
    o.add_argument("--out", default="bench/results", metavar="DIR", help="results directory (default bench/results)")
    o.add_argument("--label", default=None, help="a name for the result files (default: model and dataset)")
    o.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--request-rate {text!r}: expected numbers or inf, comma-separated") from None
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"--request-rate {text!r}: every rate must be > 0 (inf: all at once)")
    return rates


def run(args: argparse.Namespace) -> int:
    from .serve_target import check_loopback

    try:
        if not 1 <= args.num_prompts <= MAX_PROMPTS:
            raise ValueError(f"--num-prompts must be in [1, {MAX_PROMPTS}], got {args.num_prompts}")
        rates = parse_rates(args.request_rate)
        base_url = check_loopback(args.base_url) if args.base_url else None
        if args.dataset_name not in _datasets():
            raise ValueError(f"--dataset-name {args.dataset_name!r}: expected one of {', '.join(_datasets())}")
        from .serve_load import LoadPattern

        patterns = [LoadPattern(r, args.burstiness, args.max_concurrency, args.max_duration) for r in rates]
        server_args = shlex.split(args.server_args)
    except ValueError as e:
        print(f"mimw bench serve: error: {e}", file=sys.stderr)
        return 2
    try:
        dataset, tok = _dataset(args)
    except ValueError as e:  # a bad dataset file or model (CheckpointError)
        print(f"mimw bench serve: error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = _file_base(args)
    target = None
    try:
        if base_url is None:
            target, base_url = _start_server(args, server_args, out / f"{base}.server.log")
        return _benchmark(args, base_url, dataset, tok, patterns, out, base)
    except (ValueError, RuntimeError) as e:
        print(f"mimw bench serve: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ValueError) else 1
    finally:
        if target is not None:
            target.stop()


def _datasets() -> dict:
    from .serve_dataset import DATASETS

    return DATASETS


def _dataset(args: argparse.Namespace) -> Any:
    from .serve_dataset import load_tokenizer

    print(f"[bench] tokenizer of {args.model or 'the embedded default model'} ...", file=sys.stderr, flush=True)
    tok, vocab = load_tokenizer(args.model)
    return _datasets()[args.dataset_name](args, tok, vocab), tok


def _file_base(args: argparse.Namespace) -> str:
    from .main import slug

    label = args.label or f"{Path(args.model).stem if args.model else 'smollm2-135m-instruct'}-{args.dataset_name}"
    return f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-serve-{slug(label)}"


def _start_server(args: argparse.Namespace, server_args: list[str], log_path: Path) -> tuple[Any, str]:
    from .serve_target import InProcessServer, SubprocessServer

    if args.model is not None:
        server_args = ["--model", args.model, *server_args]
    shown = " ".join(_redacted(server_args))
    print(f"[bench] starting `mimw serve {shown}` ({args.launch}) ...", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    if args.launch == "in-process":
        try:
            target = InProcessServer(server_args, args.launch_timeout)
        except ModuleNotFoundError as e:
            raise RuntimeError(f"cannot start a server here: the Python package {e.name!r} is missing") from None
    else:
        target = SubprocessServer(server_args, log_path, args.launch_timeout)
    print(f"[bench] server healthy at {target.url} after {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    return target, target.url


def _benchmark(args: argparse.Namespace, base_url: str, dataset: Any, tok: Any, patterns: list, out: Path,
               base: str) -> int:
    from ..cli import version
    from .main import git_commit
    from .serve_metrics import summarize
    from .serve_report import markdown, write_chart, write_json

    key = args.api_key or os.environ.get(API_KEY_ENV)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    model = args.served_model_name or _server_model(base_url, headers)
    requests = dataset.requests(args.num_prompts, random.Random(args.seed))
    _check_one(base_url, headers, model, args.endpoint, requests[0], tok)
    doc: dict[str, Any] = {
        "benchmark": "serve", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": git_commit(),
        "mimw": version(), "target": base_url, "model": model, "dataset": dataset.name,
        "command": _redacted_command(),
        "config": {**{k: v for k, v in vars(args).items() if k != "api_key"},
                   "server_args": " ".join(_redacted(shlex.split(args.server_args)))},
        "runs": []}
    paths = [out / f"{base}{s}" for s in (".json", ".md", ".png")]
    for pattern in patterns:
        results, duration = asyncio.run(_run_once(args, base_url, headers, model, requests, pattern, tok))
        t0 = min((r.start for r in results if r.start), default=0.0)
        doc["runs"].append({"label": f"rate {pattern.rate:g}", "request_rate": pattern.rate,
                            "burstiness": pattern.burstiness, "max_concurrency": pattern.max_concurrency,
                            "summary": summarize(results, duration), "requests": [r.to_json(t0) for r in results]})
        write_json(paths[0], doc)
        paths[1].write_text(markdown(doc))
    write_chart(doc, paths[2])
    print(markdown(doc), flush=True)
    print("[bench] wrote " + ", ".join(map(str, paths)), file=sys.stderr, flush=True)
    return 0


def _server_model(base_url: str, headers: dict[str, str]) -> str:
    import httpx

    try:
        r = httpx.get(base_url + "/v1/models", headers=headers, timeout=30, trust_env=False)
    except httpx.HTTPError as e:
        raise RuntimeError(f"{base_url}/v1/models: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise RuntimeError(f"{base_url}/v1/models answered {r.status_code}: {r.text[:200]}")
    return r.json()["data"][0]["id"]


def _check_one(base_url: str, headers: dict[str, str], model: str, endpoint: str, req: Any, tok: Any) -> None:
    """One short request before the runs: a wrong model id, key or endpoint fails here, once, clearly."""
    import httpx

    from .serve_client import request_body

    body = request_body(req, model, endpoint, tok.decode)
    body.update(max_tokens=1, stream=False)
    body.pop("stream_options")
    try:
        r = httpx.post(base_url + endpoint, json=body, headers=headers, timeout=300, trust_env=False)
    except httpx.HTTPError as e:
        raise RuntimeError(f"a first test request to {base_url}{endpoint}: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise RuntimeError(f"a first test request to {base_url}{endpoint} answered {r.status_code}: {r.text[:300]}")


async def _run_once(args: argparse.Namespace, base_url: str, headers: dict[str, str], model: str, requests: list,
                    pattern: Any, tok: Any) -> tuple[list, float]:
    import httpx
    from tqdm import tqdm

    from .serve_client import request_body, send
    from .serve_load import run_load

    bodies = [request_body(r, model, args.endpoint, tok.decode) for r in requests]
    index = {id(r): i for i, r in enumerate(requests)}
    limits = httpx.Limits(max_connections=pattern.max_concurrency or len(requests), max_keepalive_connections=None)
    timeout = httpx.Timeout(args.request_timeout, pool=None)
    rate = "inf" if math.isinf(pattern.rate) else f"{pattern.rate:g}/s"
    bar = tqdm(total=len(requests), desc=f"rate {rate}", unit="req", disable=args.disable_tqdm, file=sys.stderr)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout, limits=limits,
                                 trust_env=False) as client:
        async def one(req: Any, result: Any) -> None:
            await send(client, args.endpoint, bodies[index[id(req)]], result)

        try:
            return await run_load(requests, pattern, one, random.Random(args.seed), on_done=lambda r: bar.update())
        finally:
            bar.close()


def _redacted(argv: list[str]) -> list[str]:
    """``argv`` with API keys replaced (in --api-key and inside --server-args)."""
    out = list(argv)
    for i, a in enumerate(out):
        if a == "--api-key" and i + 1 < len(out):
            out[i + 1] = "<redacted>"
        elif a.startswith("--api-key="):
            out[i] = "--api-key=<redacted>"
        elif "--api-key" in a and i > 0 and out[i - 1] == "--server-args":
            out[i] = " ".join(_redacted(shlex.split(a)))
    return out


def _redacted_command() -> str:
    return " ".join(shlex.quote(a) for a in _redacted(sys.argv))
