"""``mimw bench spec``: speculative decoding on real text - acceptance and per-user tokens/s against plain decoding.

For every prompt of each set (``spec_prompts``: input-grounded and open chat), one request at a time (batch 1,
greedy), the same engine configuration runs plain decoding and then each drafter, back to back, so that each
comparison is measured under the same machine load. Reported per set and drafter:
  mean accepted length  tokens emitted per verify step (accepted drafts + the target's own token)
  acceptance rate       accepted / drafted tokens
  tok/s e2e, decode     completion tokens / (submission -> last token) and / (first token -> last token), summed
                        over the set's prompts, and their ratios to plain decoding's: wall-clock time, and the
                        process's CPU time over the same spans (``time.process_time``; with one torch thread this
                        is the time the run would take on an idle core, which a shared machine's wall clock is not)
  identical             prompts whose output equals plain decoding's token for token (greedy is lossless)
The JSON keeps per-prompt rows and, per set and drafter, the verify steps' (drafted, accepted) counts, which
``python -m mimw.bench.spec_steps`` turns into GPU estimates.

``--warm N`` first answers N open-chat prompts of other topics (``spec_prompts.warm_prompts``; plain greedy decoding,
16 at a time) and hands each answer to every speculating engine's drafter as a finished request: the suffix drafter's
global history then holds a server's earlier outputs, as SuffixDecoding's global tree does (built from earlier
requests of the workload); greedy outputs are the same speculated or not, so this is what serving those requests
first would leave. The n-gram drafter keeps nothing across requests. The plain engine needs no warm-up.

"draft" needs a draft model: ``--draft-model PATH`` (one with the target's tokenizer), or ``--draft-layers N``: the
target's first N layers with its own final norm and LM head (a self-draft without training; there is no smaller
SmolLM2 on this machine).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

METHODS = ("ngram", "suffix", "draft")


@dataclass(frozen=True)
class SpecBenchConfig:
    model: str | None = None
    dtype: str = "float32"
    drafters: tuple[str, ...] = ("ngram", "suffix")
    draft_model: str | None = None
    draft_layers: int | None = None
    spec_tokens: int = 8
    max_tokens: int = 128
    sets: tuple[str, ...] = ("grounded", "chat")
    prompts: int = 10
    threads: int | None = None
    out_dir: str = "bench/results"
    packed_linear: bool = True  # the reference backend's oneDNN-prepacked few-row matmuls (verify blocks)
    warm: int = 0  # warm-up prompts answered before the measure, their outputs handed to the drafters


def add_arguments(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("spec", help="speculative decoding on real text (CPU): acceptance and tokens/s vs plain",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="target model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--drafters", default="ngram,suffix", help=f"comma-separated, of {', '.join(METHODS)}")
    p.add_argument("--draft-model", default=None, help="draft model for 'draft' (same tokenizer as the target)")
    p.add_argument("--draft-layers", type=int, default=None,
                   help="for 'draft' without --draft-model: the target's first N layers as the draft model")
    p.add_argument("--spec-tokens", type=int, default=8, help="K, most drafted tokens per step (default 8)")
    p.add_argument("--max-tokens", type=int, default=128, help="completion tokens per prompt (default 128)")
    p.add_argument("--sets", default="grounded,chat", help="prompt sets: grounded, chat")
    p.add_argument("--prompts", type=int, default=10, help="prompts per set (default 10)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--out", default="bench/results", help="results directory")
    p.add_argument("--warm", type=int, default=0,
                   help="answer N other open-chat prompts first and give the drafters their outputs, as a server's "
                        "earlier requests (default 0)")
    p.add_argument("--no-packed-linear", dest="packed_linear", action="store_false",
                   help="verify blocks through F.linear like one-token steps (default: oneDNN-prepacked weights "
                        "for steps of 4-64 tokens, engine/backends/packed_linear.py)")


def config_from_args(args: argparse.Namespace) -> SpecBenchConfig:
    from .spec_prompts import SETS, warm_prompts

    drafters = tuple(d.strip() for d in args.drafters.split(",") if d.strip())
    for d in drafters:
        if d not in METHODS:
            raise ValueError(f"--drafters: unknown drafter {d!r} (choose from {', '.join(METHODS)})")
    if "draft" in drafters and not (args.draft_model or args.draft_layers):
        raise ValueError("--drafters draft needs --draft-model PATH or --draft-layers N")
    sets = tuple(s.strip() for s in args.sets.split(",") if s.strip())
    for s in sets:
        if s not in SETS:
            raise ValueError(f"--sets: unknown set {s!r} (choose from {', '.join(SETS)})")
    if args.spec_tokens < 1 or args.max_tokens < 1 or args.prompts < 1:
        raise ValueError("--spec-tokens, --max-tokens and --prompts must be >= 1")
    warm_prompts(args.warm)  # its range checked
    return SpecBenchConfig(args.model, args.dtype, drafters, args.draft_model, args.draft_layers, args.spec_tokens,
                           args.max_tokens, sets, args.prompts, args.threads, args.out, args.packed_linear, args.warm)


def truncated(weights, n_layers: int):
    """The first ``n_layers`` layers of ``weights`` with its final norm and LM head: a self-draft model."""
    from ..models.weights import ModelWeights

    if not 1 <= n_layers < weights.spec.num_layers:
        raise ValueError(f"--draft-layers must be in [1, {weights.spec.num_layers - 1}], got {n_layers}")
    spec = dataclasses.replace(weights.spec, name=f"{weights.spec.name}-first{n_layers}", num_layers=n_layers)
    return ModelWeights(spec, weights.embed, weights.layers[:n_layers], weights.final_norm, weights.lm_head)


def _engine(backend, tokenizer, method: str | None, cfg: SpecBenchConfig, draft_backend, num_pages: int,
            draft_cost: float):
    from ..engine.engine import Engine, EngineConfig
    from ..engine.spec.config import SpecConfig
    from ..engine.spec.speculator import Speculator, make_drafter

    ecfg = EngineConfig(num_pages=num_pages, page_size=16, max_batch=1, max_step_tokens=4096,
                        enable_prefix_cache=False)
    speculator = None
    if method is not None:
        scfg = SpecConfig(method, num_tokens=cfg.spec_tokens, draft_model="bench" if method == "draft" else None,
                          drafter_token_cost=draft_cost if method == "draft" else 0.0)
        speculator = Speculator(make_drafter(scfg, draft_backend, 16, num_pages), scfg)
    return Engine(backend, tokenizer, ecfg, tokenizer.eos_token_ids, speculator=speculator)


def _run_one(engine, rid: str, prompt: list[int], max_tokens: int) -> dict:
    from ..engine.sampling import SamplingParams

    before = engine.stats().spec
    t0, c0 = time.perf_counter(), time.process_time()
    engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
    out, t_first, c_first, reason, steps0 = [], None, None, None, engine.stats().steps
    while engine.has_work():
        for ev in engine.step():
            if ev.token_ids and t_first is None:
                t_first, c_first = time.perf_counter(), time.process_time()
            out += ev.token_ids
            reason = ev.finish_reason or reason
    t1, c1 = time.perf_counter(), time.process_time()
    row = {"tokens": len(out), "e2e_s": t1 - t0, "decode_s": t1 - (t_first or t1), "cpu_e2e_s": c1 - c0,
           "cpu_decode_s": c1 - (c_first or c1), "finish": reason, "steps": engine.stats().steps - steps0,
           "output": out}
    after = engine.stats().spec
    if after is not None:
        blocks = {k: n - before.blocks.get(k, 0) for k, n in after.blocks.items() if n - before.blocks.get(k, 0)}
        row.update(drafted=after.draft_tokens - before.draft_tokens,
                   accepted=after.accepted_tokens - before.accepted_tokens,
                   verify_steps=after.verify_steps - before.verify_steps,
                   blocks={f"{k},{a}": n for (k, a), n in sorted(blocks.items())})
    return row


def warm_up(backend, tokenizer, speculators, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Answer ``prompts`` greedily on ``backend`` (plain decoding, 16 at a time) and hand each prompt and answer to
    every speculator's drafter as a finished request; returns the answers."""
    from ..engine.engine import Engine, EngineConfig
    from ..engine.sampling import SamplingParams
    from ..engine.spec.drafter import DraftInput

    if not prompts:
        return []
    longest = max(len(p) for p in prompts) + max_tokens + 16
    engine = Engine(backend, tokenizer, EngineConfig(num_pages=16 * (-(-longest // 16) + 1), page_size=16,
                                                      max_batch=16, enable_prefix_cache=False),
                    tokenizer.eos_token_ids)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outs: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"warm-{i}", p, params)
        outs[f"warm-{i}"] = []
    while engine.has_work():
        for ev in engine.step():
            outs[ev.request_id] += ev.token_ids
    for i, p in enumerate(prompts):
        for sp in speculators:
            sp.drafter.finish(DraftInput(f"warm-{i}", list(p) + outs[f"warm-{i}"], len(p), params))
    return [outs[f"warm-{i}"] for i in range(len(prompts))]


def summarize(rows: list[dict], plain_rows: list[dict]) -> dict:
    tok = sum(r["tokens"] for r in rows)
    ptok = sum(r["tokens"] for r in plain_rows)
    out = {"prompts": len(rows), "tokens": tok,
           "identical": sum(r["output"] == p["output"] for r, p in zip(rows, plain_rows))}
    for key in ("e2e", "decode", "cpu_e2e", "cpu_decode"):
        t = sum(r[f"{key}_s"] for r in rows)
        pt = sum(r[f"{key}_s"] for r in plain_rows)
        out[f"tok_s_{key}"] = tok / t if t else 0.0
        out[f"speedup_{key}"] = (tok / t) / (ptok / pt) if t and pt else 0.0
    if "drafted" in rows[0]:
        drafted = sum(r["drafted"] for r in rows)
        accepted = sum(r["accepted"] for r in rows)
        vsteps = sum(r["verify_steps"] for r in rows)
        blocks: dict[str, int] = {}
        for r in rows:
            for k, n in r["blocks"].items():
                blocks[k] = blocks.get(k, 0) + n
        out.update(drafted=drafted, accepted=accepted, verify_steps=vsteps,
                   acceptance_rate=accepted / drafted if drafted else 0.0,
                   mean_accepted_length=(accepted + vsteps) / vsteps if vsteps else 0.0,
                   verified_token_share=(accepted + vsteps) / tok if tok else 0.0, blocks=blocks)
    return out


def markdown(doc: dict) -> str:
    m = doc["meta"]
    lines = [f"# mimw bench spec - {m['model']} ({m['dtype']}) on {m['cpu']}, {m['date']}", "",
             f"commit {m['commit']}; K = {m['spec_tokens']}; up to {m['max_tokens']} tokens per prompt, greedy, "
             f"batch 1; torch threads {m['threads']}; draft model: {m['draft_model']}; prepacked few-row matmuls: "
             f"{m.get('packed_linear', False)}; warm-up: {m.get('warm', 0)} prompts ({m.get('warm_tokens', 0)} tokens) "
             "answered first, their outputs given to the drafters", "",
             "tok/s per user, end to end (submission to last token, prefill included) and decode (first to last "
             "token); CPU: process CPU time over the same spans, wall: wall clock.", "",
             "| set | drafter | mean accepted length | acceptance | CPU e2e tok/s | vs plain | CPU decode tok/s | "
             "vs plain | wall e2e vs plain | wall decode vs plain | identical |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for set_name, modes in doc["summary"].items():
        for mode, s in modes.items():
            mal = f"{s['mean_accepted_length']:.2f}" if "drafted" in s else "-"
            acc = f"{s['acceptance_rate']:.0%}" if "drafted" in s else "-"
            lines.append(f"| {set_name} | {mode} | {mal} | {acc} | {s['tok_s_cpu_e2e']:.1f} | "
                         f"{s['speedup_cpu_e2e']:.2f}x | {s['tok_s_cpu_decode']:.1f} | {s['speedup_cpu_decode']:.2f}x "
                         f"| {s['speedup_e2e']:.2f}x | {s['speedup_decode']:.2f}x | {s['identical']}/{s['prompts']} |")
    return "\n".join(lines) + "\n"


def run_spec_bench(cfg: SpecBenchConfig) -> dict:
    import torch

    from ..engine.backends.reference import ReferenceBackend
    from ..engine.spec.options import check_tokenizers, weight_ratio
    from ..models.checkpoint import load_model
    from .main import git_commit, slug
    from .spec_prompts import SETS, warm_prompts

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    dtype = getattr(torch, cfg.dtype)
    model = load_model(cfg.model, dtype=dtype, progress=False)
    if model.tokenizer is None:
        raise ValueError(f"{model.source} has no tokenizer: the benchmark needs real text")
    tok = model.tokenizer
    backend = ReferenceBackend(model.weights, packed_linear=cfg.packed_linear)
    draft_backend, draft_name, draft_cost = None, None, 0.0
    if "draft" in cfg.drafters:
        if cfg.draft_model:
            draft = load_model(cfg.draft_model, dtype=dtype, progress=False)
            check_tokenizers(draft, model)
            dw, draft_name = draft.weights, draft.source
        else:
            dw, draft_name = truncated(model.weights, cfg.draft_layers), f"first {cfg.draft_layers} layers of the target"
        draft_backend, draft_cost = ReferenceBackend(dw), weight_ratio(dw, model.weights)
    prompts = {s: [(p.name, tok.apply_chat_template(list(p.messages))) for p in SETS[s](cfg.prompts)]
               for s in cfg.sets}
    longest = max(len(ids) for ps in prompts.values() for _, ids in ps) + cfg.max_tokens + cfg.spec_tokens + 16
    num_pages = -(-longest // 16) + 1
    modes = ("plain",) + cfg.drafters
    engines = {m: _engine(backend, tok, None if m == "plain" else m, cfg, draft_backend, num_pages, draft_cost)
               for m in modes}
    meta = {"model": model.spec.name, "source": model.source, "dtype": cfg.dtype, "cpu": platform.processor() or
            platform.machine(), "threads": torch.get_num_threads(), "commit": git_commit(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "spec_tokens": cfg.spec_tokens,
            "max_tokens": cfg.max_tokens, "draft_model": draft_name, "draft_weight_ratio": draft_cost, "command": " ".join(sys.argv),
            "torch": torch.__version__, "packed_linear": backend.packed is not None, "warm": cfg.warm}
    if cfg.warm:
        t0 = time.perf_counter()
        warm = [tok.apply_chat_template(list(p.messages)) for p in warm_prompts(cfg.warm)]
        answers = warm_up(backend, tok, [e.speculator for e in engines.values() if e.speculator], warm,
                          cfg.max_tokens)
        meta["warm_tokens"] = sum(len(a) for a in answers)
        print(f"[bench spec] warm-up: {cfg.warm} prompts, {meta['warm_tokens']} tokens handed to the drafters in "
              f"{time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    rows: dict[str, dict[str, list[dict]]] = {s: {m: [] for m in modes} for s in cfg.sets}
    for s, plist in prompts.items():
        for i, (name, ids) in enumerate(plist):
            for m in modes:
                row = _run_one(engines[m], f"{s}-{i}-{m}", ids, cfg.max_tokens)
                row.update(prompt=name, prompt_tokens=len(ids))
                rows[s][m].append(row)
                extra = (f", {row['accepted']}/{row['drafted']} accepted" if "drafted" in row else "")
                print(f"[bench spec] {s} {i + 1}/{len(plist)} {name} {m}: {row['tokens']} tokens in "
                      f"{row['e2e_s']:.2f}s ({row['tokens'] / row['e2e_s']:.1f} tok/s{extra})", file=sys.stderr,
                      flush=True)
    summary = {s: {m: summarize(rows[s][m], rows[s]["plain"]) for m in modes} for s in cfg.sets}
    doc = {"meta": meta, "summary": summary, "rows": rows}
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = out / f"{time.strftime('%Y%m%d-%H%M', time.gmtime())}-cpu-spec-{slug(model.spec.name)}"
    base.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    base.with_suffix(".md").write_text(markdown(doc))
    print(markdown(doc), flush=True)
    print(f"[bench spec] wrote {base}.json and .md", file=sys.stderr)
    return doc


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"mimw bench spec: error: {e}", file=sys.stderr)
        return 2
    run_spec_bench(cfg)
    return 0
