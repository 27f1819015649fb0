"""The ``mimw`` command: ``generate`` (here), ``serve`` and ``bench`` (dispatched lazily to ``mimw.server.main`` /
``mimw.bench.main``, each exposing ``add_arguments(parser)`` and ``run(args) -> int``).

Exit codes: 0 success, 1 runtime failure, 2 bad arguments or input (message on stderr, never a traceback),
130 interrupted.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time
from typing import Sequence

_LAZY = {"serve": ("mimw.server.main", "serve a model with an OpenAI-compatible HTTP API"),
         "bench": ("mimw.bench.main", "benchmarks: decode steps, prefill, a serving load, trace replay")}
_DTYPES = ("auto", "float32", "bfloat16", "float16")


class _UsageError(Exception):
    """Bad input from the user: printed as ``mimw: error: ...`` with exit code 2."""


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, metavar="PATH|PRESET",
                   help="HF checkpoint directory, .gguf file or preset name (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prompt", required=True, help="the prompt text (a user message with --chat)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=_positive_int, default=64, help="new tokens at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = disabled")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="auto", choices=_DTYPES, help="auto: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--kv-dtype", default="auto", choices=("auto", "bf16", "fp8"),
                   help="KV cache element type: auto = the weights' dtype; fp8 = e4m3 with a scale per (token, head)")
    from .engine.spec import options as spec_options

    spec_options.add_arguments(p)


def version() -> str:
    """The installed distribution's version (``unknown`` when running from a source tree without installing)."""
    from importlib.metadata import PackageNotFoundError, version as dist_version

    try:
        return dist_version("mimw")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(prog="mimw", description="mimw: an LLM decode engine (reference decoder on "
                                     "any device; Hopper megakernel backend).")
    parser.add_argument("--version", action="version", version=f"mimw {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    gen = sub.add_parser("generate", help="generate text from a prompt, streamed to stdout",
                         description="Generate text from a prompt with the reference decoder; prints tokens/s "
                                     "to stderr at the end.")
    add_generate_arguments(gen)
    subs = {"generate": gen}
    for name, (_, help_) in _LAZY.items():
        subs[name] = sub.add_parser(name, help=help_, description=help_)
    return parser, subs


def _lazy_module(command: str):
    module_name = _LAZY[command][0]
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name in (module_name, module_name.rsplit(".", 1)[0]):
            raise _UsageError(f"'mimw {command}' is not available in this build ({module_name} is missing)") from None
        raise _UsageError(f"'mimw {command}' needs the Python package {e.name!r}, which is not installed") from None


def run_generate(args: argparse.Namespace) -> int:
    import torch

    from .engine.sampling import SamplingParams
    from .engine.spec import options as spec_options
    from .generate import generate, generate_with_engine
    from .kv.pages import parse_kv_dtype
    from .models.checkpoint import load_model

    if args.prompt == "":
        raise _UsageError("--prompt is empty: give the text to continue (or the user message with --chat)")
    if args.system is not None and not args.chat:
        raise _UsageError("--system needs --chat")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise _UsageError("--device cuda: no CUDA device is available (use --device cpu)")
    dtype_name = args.dtype if args.dtype != "auto" else ("bfloat16" if args.device == "cuda" else "float32")
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                max_tokens=args.max_tokens, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
        spec_config = spec_options.config_from_args(args)
    except ValueError as e:
        raise _UsageError(str(e)) from None
    print(f"[mimw] loading {args.model or 'the embedded default model (SmolLM2-135M-Instruct)'} ...", file=sys.stderr)
    model = load_model(args.model, dtype=getattr(torch, dtype_name), device=args.device)
    tok = model.tokenizer
    if tok is None:
        raise _UsageError(f"{model.source} has no tokenizer, so it cannot take a text prompt "
                          "(use a checkpoint with a tokenizer, or `mimw bench` for random-weight presets)")
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
                   [{"role": "user", "content": args.prompt}]
        prompt_ids = tok.apply_chat_template(messages)
    else:
        prompt_ids = tok.encode(args.prompt)

    out = sys.stdout
    if not args.chat:
        out.write(args.prompt)
    t0 = time.perf_counter()
    t_first, n, reason = None, 0, None
    spec_stats = []
    kv_dtype = parse_kv_dtype(args.kv_dtype)
    steps = (generate_with_engine(model, prompt_ids, params, tok, spec_config, on_stats=spec_stats.append,
                                  kv_dtype=kv_dtype)
             if spec_config is not None else generate(model.weights, prompt_ids, params, tokenizer=tok,
                                                      kv_dtype=kv_dtype))
    for step in steps:
        if step.token_id is not None:
            n += 1
            t_first = t_first or time.perf_counter()
        if step.text:
            out.write(step.text)
            out.flush()
        reason = step.finish_reason or reason
    out.write("\n")
    out.flush()
    t1 = time.perf_counter()
    decode_s = t1 - (t_first or t1)
    rate = f"{(n - 1) / decode_s:.1f} tok/s decode" if n > 1 and decode_s > 0 else "n/a tok/s"
    print(f"[mimw] {n} tokens in {t1 - t0:.2f}s ({rate}; prompt {len(prompt_ids)} tokens, first token after "
          f"{(t_first or t1) - t0:.2f}s; finish: {reason}; {model.spec.name} on {args.device}, {dtype_name}, KV "
          f"{dtype_name if args.kv_dtype == 'auto' else args.kv_dtype})",
          file=sys.stderr)
    if spec_stats and spec_stats[0].spec is not None:
        s = spec_stats[0].spec
        print(f"[mimw] speculative {spec_config.method}: {s.accepted_tokens} of {s.draft_tokens} drafted tokens "
              f"accepted, {s.mean_emitted:.2f} tokens per verify step ({s.verify_steps} verify steps)",
              file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, subs = build_parser()
    try:
        command = next((a for a in argv if not a.startswith("-")), None)
        module = None
        if command in _LAZY:
            module = _lazy_module(command)
            module.add_arguments(subs[command])
        args = parser.parse_args(argv)
        if module is not None:
            return int(module.run(args) or 0)
        return run_generate(args)
    except _UsageError as e:
        print(f"mimw: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # CheckpointError, SpecError and bad sampling/prompt values are ValueErrors
        print(f"mimw: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nmimw: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `mimw generate ... | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
