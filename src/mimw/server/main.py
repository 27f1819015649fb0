"""``mimw serve``: command-line flags -> frozen configs -> model, engine thread, FastAPI app -> uvicorn.

``add_arguments(parser)`` and ``run(args) -> exit code`` are what ``mimw.cli`` calls; ``build(args)`` is the same
construction without uvicorn (tests start the real app on a free port with it). ``python -m mimw.server.main``
works as well.
"""
from __future__ import annotations

import argparse
import errno
import importlib
import importlib.util
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from ..engine.heap import freeze_heap
from ..engine.spec import options as spec_options

log = logging.getLogger("mimw.server")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_BACKENDS = {"reference": ("mimw.engine.backends.reference", "ReferenceBackend"),
             "megakernel": ("mimw.engine.backends.megakernel", "MegakernelBackend")}
API_KEY_ENV = "MIMW_API_KEY"  # read by ``run`` (the command line's edge) when --api-key is not given
_CPU_KV_BYTES = 1 << 30  # default KV pool on the CPU: 1 GiB
_GPU_KV_FRACTION = 0.8  # default KV pool on a GPU: this share of the memory left after the weights


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, metavar="PATH|PRESET",
                   help="HF checkpoint dir, .gguf file or preset name (random weights); default: the embedded "
                        "SmolLM2-135M-Instruct")
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: from --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8000, help="TCP port, 1-65535 (default 8000)")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (default: the {API_KEY_ENV} environment "
                        "variable, if set; prefer it: a command line is visible to other users)")
    p.add_argument("--backend", default="reference", choices=sorted(_BACKENDS),
                   help="reference: PyTorch on any device; megakernel: Hopper GPU decode megakernel")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", *_DTYPES], help="auto: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--max-batch", type=_positive, default=32, help="running requests per step at most")
    p.add_argument("--max-step-tokens", type=_positive, default=None,
                   help="token budget per step, prefill chunks + decodes (default: max(512, max-batch))")
    p.add_argument("--kv-pages", type=_positive, default=None,
                   help="KV cache pages (default: 1 GiB on CPU, 80%% of free memory on GPU)")
    p.add_argument("--page-size", type=_positive, default=16, help="tokens per KV page")
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "bf16", "fp8"],
                   help="KV cache element type: auto = the weights' dtype (bfloat16 on GPU, float32 on CPU); fp8 = "
                        "e4m3 with a scale per (token, head): twice the tokens in the same memory (reference backend)")
    p.add_argument("--max-model-len", type=_positive, default=None,
                   help="longest prompt + completion (default: the model's, capped by the KV pool)")
    p.add_argument("--max-queue", type=_positive, default=256,
                   help="requests waiting for a batch slot before new ones get 429")
    p.add_argument("--no-prefix-cache", action="store_true", help="disable prefix reuse across requests")
    p.add_argument("--session-ttl", type=_non_negative, default=300.0, metavar="SECONDS",
                   help="how long a session's KV stays retained after its last request (default 300)")
    p.add_argument("--host-kv-gb", type=_non_negative, default=0.0, metavar="GIB",
                   help="host-memory KV tier of this many GiB (pinned when serving on a GPU): evicted prefix "
                        "pages are kept there and copied back on a hit (default 0: none)")
    p.add_argument("--kv-eviction", default="session", choices=["session", "lru"],
                   help="session: pages of live sessions are evicted after all others (default); lru: plain LRU")
    p.add_argument("--no-overlap", action="store_true",
                   help="read each step's tokens before launching the next (default: overlap the host's per-token "
                        "work with the next step, engine/overlap.py)")
    p.add_argument("--tensor-parallel", type=_positive, default=1, metavar="N",
                   help="split the model over N ranks, one process each, started by torchrun: `torchrun "
                        "--nproc-per-node N -m mimw.server.main --tensor-parallel N ...`; rank 0 serves, the others "
                        "run its steps (reference backend; default 1)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    spec_options.add_arguments(p)


def _non_negative(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {s}")
    return v


def _positive(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {s!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {s}")
    return v


def _port(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a port number (1-65535), got {s!r}") from None
    if not 1 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number (1-65535), got {v}")
    return v


def check_args(args: argparse.Namespace) -> None:
    """Everything about the flags that can be checked before the model loads (seconds to minutes): the device,
    the backend on this machine, the API key. Raises ``ValueError`` with a one-line message."""
    if args.device != "auto":
        try:
            dev = torch.device(args.device)
        except (RuntimeError, ValueError):
            raise ValueError(f"--device {args.device!r}: expected auto, cpu, cuda or cuda:N") from None
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"--device {args.device!r}: expected auto, cpu, cuda or cuda:N")
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"--device {args.device}: no CUDA device is available (use --device cpu)")
            if dev.index is not None and dev.index >= torch.cuda.device_count():
                raise ValueError(f"--device {args.device}: this machine has {torch.cuda.device_count()} CUDA "
                                 "device(s)")
    if args.backend == "megakernel":
        if args.device == "cpu":
            raise ValueError("--backend megakernel runs on a Hopper GPU, not with --device cpu")
        if not torch.cuda.is_available():
            raise ValueError("--backend megakernel needs a Hopper GPU (H100/H200); none is available here "
                             "(use --backend reference)")
        dev = torch.device("cuda" if args.device == "auto" else args.device)
        cap = torch.cuda.get_device_capability(dev)
        if cap != (9, 0):
            raise ValueError(f"--backend megakernel needs a Hopper GPU (sm_90); {torch.cuda.get_device_name(dev)} "
                             f"is sm_{cap[0]}{cap[1]} (use --backend reference)")
        if importlib.util.find_spec("triton") is None:
            raise ValueError("--backend megakernel needs the triton package, which is not installed")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError(f"--api-key / {API_KEY_ENV}: the key must not be empty")
    tp = _ranks(args)
    if tp > 1:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != tp:
            raise ValueError(f"--tensor-parallel {tp}: start one process a rank with torchrun: torchrun "
                             f"--nproc-per-node {tp} -m mimw.server.main --tensor-parallel {tp} ... (this process's "
                             f"WORLD_SIZE is {world})")
        if args.backend != "reference":
            raise ValueError(f"--tensor-parallel with --backend {args.backend}: serving runs the reference backend's "
                             "ranks; the megakernel's ranks are checked and timed by python -m "
                             "mimw.megakernel.tools.tp_check")
        if args.host_kv_gb > 0:
            raise ValueError("--host-kv-gb with --tensor-parallel: the host KV tier copies pages outside the ranks' "
                             "steps, which the other ranks would not see")


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads so that a port in use is reported at once (and
    nothing can take it while the model loads); uvicorn serves on it."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ValueError(f"--port {port}: {host}:{port} is already in use (another server?); choose another "
                             "--port") from None
        if e.errno == errno.EACCES:
            raise ValueError(f"--port {port}: permission denied (ports below 1024 need privileges)") from None
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({e.strerror})") from None
    return sock


class ByteTokenizer:
    """Fallback for checkpoints without a tokenizer (presets with random weights, for benchmarking the server):
    UTF-8 bytes are token ids 0-255; larger ids decode to nothing. No chat template."""

    has_chat_template = False
    eos_token_ids: tuple[int, ...] = ()
    bytes_per_token = 1

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        return [bytes([i]) if 0 <= i < 256 else b"" for i in ids]


@dataclass
class Built:
    app: Any
    loop: Any  # EngineLoop, started
    model_name: str
    summary: str
    leader: Any = None  # tensor parallelism: rank 0's backend, closed (the other ranks stop) when serving ends


def build(args: argparse.Namespace) -> Built:
    """Load the model and start the engine thread; the caller serves ``app`` and stops ``loop`` (and closes
    ``leader``: tensor parallelism's rank 0)."""
    from ..kv.pages import parse_kv_dtype
    from ..models.checkpoint import load_model
    from .tokenizer_pool import TokenizerPool

    check_args(args)
    spec_cfg = spec_options.config_from_args(args)
    device = _device(args)
    control = _join_ranks(device) if _ranks(args) > 1 else None
    dtype = _dtype(args, device)
    t0 = time.monotonic()
    log.info("loading %s on %s ...", args.model or "the embedded default model (SmolLM2-135M-Instruct)", device)
    loaded = load_model(args.model, dtype=dtype, device=device, progress=sys.stderr.isatty())
    log.info("loaded %s in %.1f s", loaded.source, time.monotonic() - t0)
    tok = loaded.tokenizer
    if tok is None:
        log.warning("%s has no tokenizer: falling back to UTF-8 bytes as token ids (no chat template)",
                    loaded.source)
        tok = ByteTokenizer()
    tok = TokenizerPool(tok)
    if control is not None:  # rank 0 of tensor parallelism: every step goes to the other ranks too
        from ..engine.backends.tensor_parallel import Leader, TPReferenceBackend

        backend = Leader(TPReferenceBackend(loaded.weights, kv_dtype=parse_kv_dtype(args.kv_dtype)), control)
    else:  # speculation's verify blocks (4-64 rows) run on prepacked CPU weights, as in `mimw generate`
        backend = _backend(args.backend, loaded.weights, parse_kv_dtype(args.kv_dtype),
                           packed_linear=spec_cfg is not None)
    try:
        return _build_engine(args, loaded, backend, spec_cfg, device, dtype, tok, control)
    except BaseException:
        if control is not None:  # the other ranks wait for rank 0's messages: tell them to stop
            backend.close()
        raise


def _build_engine(args, loaded, backend, spec_cfg, device, dtype, tok, control) -> Built:
    from ..engine.engine import Engine, EngineConfig
    from ..engine.loop import EngineLoop
    from ..kv.pages import KVLayout
    from .app import ServerConfig, create_app

    spec = loaded.spec
    draft = spec_options.load_draft(spec_cfg, loaded) if spec_cfg else None
    one_page = KVLayout.for_spec(spec, args.page_size, 1, backend.kv_dtype)
    num_pages = args.kv_pages or _default_pages(one_page, backend.device, args.max_batch,
                                                args.max_model_len or spec.max_position_embeddings)
    if draft is not None and not args.kv_pages:  # the draft model's cache has as many pages: share the budget
        draft_page = KVLayout.for_spec(draft.spec, args.page_size, 1, draft.weights.dtype).bytes_per_page()
        num_pages = max(1, num_pages * one_page.bytes_per_page() // (one_page.bytes_per_page() + draft_page))
    cfg = EngineConfig(num_pages=num_pages, page_size=args.page_size, max_batch=args.max_batch,
                       max_step_tokens=args.max_step_tokens or max(512, args.max_batch),
                       max_model_len=args.max_model_len, enable_prefix_cache=not args.no_prefix_cache,
                       session_ttl_s=args.session_ttl, kv_eviction=args.kv_eviction,
                       host_kv_bytes=int(args.host_kv_gb * (1 << 30)), overlap=not args.no_overlap)
    speculator = spec_options.build_speculator(spec_cfg, loaded, args.page_size, num_pages, draft) if spec_cfg else None
    engine = Engine(backend, tok.for_engine(), cfg, tok.eos_token_ids, speculator=speculator)
    if args.backend == "megakernel":
        log.info("compiling the megakernel's step kernels and capturing its decode graphs (a first start takes ~10 s a "
                 "kernel; Triton's cache keeps them for the next) ...")
    t0 = time.monotonic()
    backend.prepare(engine.cache, engine.config.max_batch)  # no step waits for a compiler or a capture
    if args.backend == "megakernel":
        log.info("compiled in %.1f s", time.monotonic() - t0)
    kv = engine.cache.layout
    loop = EngineLoop(engine, max_queue=args.max_queue).start()
    name = args.served_model_name or _default_name(args.model, loaded.source)
    app = create_app(loop, tok, ServerConfig(model_name=name, api_key=args.api_key))
    summary = (f"model {name!r} from {loaded.source} ({spec.arch}, {spec.num_layers} layers) on {device} "
               f"{str(dtype).removeprefix('torch.')}, {args.backend} backend; KV {num_pages} pages x "
               f"{args.page_size} tokens = {kv.num_tokens} tokens, {engine.cache.nbytes / 2**30:.2f} GiB, "
               f"{kv.describe()}, context {engine.max_model_len}, batch {cfg.max_batch}, step budget "
               f"{cfg.max_step_tokens} tokens, prefix cache {'on' if cfg.enable_prefix_cache else 'off'}, speculative "
               f"{f'{spec_cfg.method} (K={spec_cfg.num_tokens})' if spec_cfg else 'off'}, host KV tier "
               f"{engine.host.num_pages if engine.host else 0} pages, eviction {cfg.kv_eviction}, session TTL "
               f"{cfg.session_ttl_s:g} s")
    if control is not None:
        summary += f", tensor parallel over {_ranks(args)} ranks"
    return Built(app, loop, name, summary, backend if control is not None else None)


def _ranks(args: argparse.Namespace) -> int:
    return getattr(args, "tensor_parallel", 1)


def _device(args: argparse.Namespace) -> torch.device:
    """--device, where ``auto`` is cuda if available, else cpu; under torchrun (``--tensor-parallel``) ``cuda``
    without an index is this rank's GPU (LOCAL_RANK)."""
    name = args.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and _ranks(args) > 1:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(name)


def _dtype(args: argparse.Namespace, device: torch.device) -> torch.dtype:
    """--dtype, where ``auto`` is bfloat16 on a GPU and float32 on the CPU."""
    return _DTYPES[args.dtype] if args.dtype != "auto" else (torch.bfloat16 if device.type == "cuda" else
                                                             torch.float32)


def _join_ranks(device: torch.device):
    """Tensor parallelism under torchrun: the process group (NCCL on GPUs, gloo on the CPU) and the gloo group the
    leader's host messages take (engine/backends/tensor_parallel.py)."""
    import torch.distributed as dist

    from ..engine.backends.tensor_parallel import control_group

    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return control_group()


def follow_rank(args: argparse.Namespace) -> int:
    """A rank > 0 of ``--tensor-parallel``: load the model, then run rank 0's steps until it stops (Ctrl-C in the
    torchrun terminal reaches every rank: this one ignores it and ends when rank 0, shutting down, stops it)."""
    import signal

    from ..engine.backends.tensor_parallel import TPReferenceBackend, follow
    from ..kv.pages import parse_kv_dtype
    from ..models.checkpoint import load_model

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    device = _device(args)
    control = _join_ranks(device)
    loaded = load_model(args.model, dtype=_dtype(args, device), device=device, progress=False)
    steps = follow(TPReferenceBackend(loaded.weights, kv_dtype=parse_kv_dtype(args.kv_dtype)), control)
    _leave_ranks()  # (a rank that fails raises instead: torchrun then stops the others)
    log.info("rank %s: ran %d steps of rank 0", os.environ.get("RANK"), steps)
    return 0


def _leave_ranks() -> None:
    """The process group's end, every rank together (its transport threads stopped before the interpreter
    exits)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _backend(name: str, weights: Any, kv_dtype: torch.dtype | None, packed_linear: bool = False) -> Any:
    module, cls = _BACKENDS[name]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise ValueError(f"--backend {name}: not available in this build ({e})") from None
    extra = {"packed_linear": True} if packed_linear and name == "reference" else {}
    return getattr(mod, cls)(weights, kv_dtype=kv_dtype, **extra)


def _default_name(model: str | None, source: str) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    p = Path(model)
    return p.stem if p.suffix.lower() == ".gguf" else p.name or model


def _default_pages(one_page: Any, device: torch.device, max_batch: int, max_len: int) -> int:
    per_page = one_page.bytes_per_page()
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * _GPU_KV_FRACTION)
    else:
        budget = _CPU_KV_BYTES
    useful = max_batch * -(-max_len // one_page.page_size)  # more than this can never be used at once
    return max(1, min(budget // per_page, useful))


def with_env_api_key(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> argparse.Namespace:
    """``args`` with ``api_key`` from the environment (``MIMW_API_KEY``) when the flag was not given."""
    if args.api_key is None and environ.get(API_KEY_ENV):
        return argparse.Namespace(**{**vars(args), "api_key": environ[API_KEY_ENV]})
    return args


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from .access_log import redact_access_log

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = with_env_api_key(args)
    try:
        check_args(args)
        if _ranks(args) > 1 and int(os.environ.get("RANK", "0")) > 0:
            return follow_rank(args)  # serves nothing: runs rank 0's steps
        sock = bind(args.host, args.port)  # before the model loads: a port in use fails now
    except ValueError as e:
        print(f"mimw serve: error: {e}", file=sys.stderr)
        return 2
    try:
        built = build(args)
    except ValueError as e:  # a bad --model or checkpoint (CheckpointError, SpecError, ...): exit code 2
        sock.close()
        print(f"mimw serve: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # no memory for the KV pool, a broken device, ...: one clear line, no traceback
        sock.close()
        print(f"mimw serve: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    log.info("%s", built.summary)
    freeze_heap()  # a full collection while serving skips what start-up built
    if args.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s without an API key (--api-key or %s): anyone who can reach this port can "
                    "use the model", args.host, API_KEY_ENV)
    log.info("OpenAI-compatible API on http://%s:%d/v1 (model id %r)", args.host, args.port, built.model_name)
    loop = built.loop

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            loop.close()  # end open streams now (clients get an error event) instead of waiting them out
            await super().shutdown(sockets)

    config = uvicorn.Config(built.app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5)
    redact_access_log()  # after uvicorn.Config, which sets up the loggers
    try:
        Server(config).run(sockets=[sock])
    except KeyboardInterrupt:  # Ctrl-C (uvicorn re-raises it once it has shut down): a server's normal stop
        pass
    finally:
        loop.stop()
        sock.close()
        if built.leader is not None:
            built.leader.close()
            _leave_ranks()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mimw serve", description="OpenAI-compatible server for a mimw model")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
