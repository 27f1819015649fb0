"""``mimw bench kv-accuracy``: how far each KV element format moves a real model's predictions (CPU, minutes).

Texts are real and present on every machine: Python standard-library sources and the Python reference manual
(``pydoc_data.topics``), first ``tokens`` tokens of each. For every text, every variant (``mimw.bench.kv_variants``:
the real fp32, bf16 and fp8 caches, and the simulated scale granularities) runs the same teacher-forced prefill in
chunks, in lockstep, and each chunk's logits are compared with the bf16-KV run's at every position:

  agree      fraction of positions whose argmax equals bf16 KV's   (``late``: positions in the second half only)
  kl         KL(P_bf16 || P_variant) in nats, mean and max over positions
  top1       fraction of positions whose argmax is the text's actual next token (the model's own accuracy)
then each variant greedily continues its own text for ``generate`` tokens from its own cache:
  greedy     the number of leading tokens identical to bf16 KV's continuation, and the fraction identical.

A query attends to the cache's values (the decoder writes a chunk's K/V, then reads the cache), so a prefill chunk
sees exactly what a decode step at that position would. The static calibrated variant takes its per (layer, head)
amax from a separate text (``CALIBRATION``). Weights are fp32 so that only the cache's format differs.
Results: a JSON document and a markdown table in ``out_dir`` (``<date>-<time>-cpu-kv-accuracy.{json,md}``), rewritten
after every text.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from ..kv.pages import KVLayout
from ..models.reference import ReferenceDecoder, Segment
from .kv_variants import VARIANTS, AmaxRecorder, make_cache

# label -> (source, where): a stdlib file by relative path, or "topics" (the reference manual) at a fraction
TEXTS = {"argparse.py": ("argparse.py", 0.0), "subprocess.py": ("subprocess.py", 0.0),
         "manual@0.25": ("topics", 0.25), "manual@0.60": ("topics", 0.60)}
CALIBRATION = ("dataclasses.py", 0.0)
BASELINE = "bf16"


@dataclass(frozen=True)
class KVAccuracyConfig:
    model: str | None = None             # None: the embedded default model (SmolLM2-135M-Instruct)
    tokens: int = 4096                   # teacher-forced tokens per text
    chunk: int = 512                     # prefill chunk
    generate: int = 64                   # greedy tokens after the text
    page_size: int = 16
    variants: tuple[str, ...] = tuple(VARIANTS)
    texts: tuple[str, ...] = tuple(TEXTS)
    out_dir: str = "bench/results"

    def __post_init__(self) -> None:
        unknown = [v for v in self.variants if v not in VARIANTS] + [t for t in self.texts if t not in TEXTS]
        if unknown:
            raise ValueError(f"unknown variant(s)/text(s) {', '.join(unknown)}; variants: {', '.join(VARIANTS)}; "
                             f"texts: {', '.join(TEXTS)}")
        if min(self.tokens, self.chunk, self.generate + 1, self.page_size) < 1:
            raise ValueError("tokens, chunk and page_size must be positive, generate >= 0")


def source_text(source: str, where: float, num_chars: int) -> str:
    if source == "topics":
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[k] for k in sorted(topics))
    else:
        text = (Path(sysconfig.get_paths()["stdlib"]) / source).read_text()
    start = int(len(text) * where)
    return text[start:start + num_chars]


def text_tokens(tokenizer, source: str, where: float, n: int) -> list[int]:
    ids = tokenizer.encode(source_text(source, where, 12 * n))
    if len(ids) < n:
        raise ValueError(f"{source}@{where} has only {len(ids)} tokens, {n} asked")
    return ids[:n]


@dataclass
class Tally:
    """Running sums for one (variant, text)."""

    n: int = 0
    agree: int = 0
    n_late: int = 0
    agree_late: int = 0
    kl_sum: float = 0.0
    kl_late_sum: float = 0.0
    kl_max: float = 0.0
    top1: int = 0
    n_top1: int = 0
    greedy: list[int] = field(default_factory=list)

    def add(self, base_lp: torch.Tensor, lp: torch.Tensor, pos: torch.Tensor, late_from: int,
            nxt: torch.Tensor, has_next: torch.Tensor) -> None:
        same = lp.argmax(-1) == base_lp.argmax(-1)
        kl = (base_lp.exp() * (base_lp - lp)).sum(-1).clamp_min(0.0)
        late = pos >= late_from
        self.n += len(pos)
        self.agree += int(same.sum())
        self.n_late += int(late.sum())
        self.agree_late += int(same[late].sum())
        self.kl_sum += float(kl.sum())
        self.kl_late_sum += float(kl[late].sum())
        self.kl_max = max(self.kl_max, float(kl.max()))
        self.top1 += int((lp.argmax(-1) == nxt)[has_next].sum())
        self.n_top1 += int(has_next.sum())


def _greedy(dec: ReferenceDecoder, cache, table, logits: torch.Tensor, pos: int, n: int) -> list[int]:
    out = []
    for i in range(n):
        t = int(logits.argmax())
        out.append(t)
        if i + 1 < n:
            logits = dec.forward(torch.tensor([t]), [Segment(table, pos + i, 1)], cache)[-1]
    return out


def calibrate(weights, tokenizer, cfg: KVAccuracyConfig) -> dict[str, torch.Tensor]:
    toks = text_tokens(tokenizer, *CALIBRATION, cfg.tokens)
    layout = KVLayout.for_spec(weights.spec, cfg.page_size, -(-cfg.tokens // cfg.page_size), torch.float32)
    rec = AmaxRecorder(layout)
    table, dec = tuple(range(layout.num_pages)), ReferenceDecoder(weights)
    for s in range(0, cfg.tokens, cfg.chunk):
        n = min(cfg.chunk, cfg.tokens - s)
        dec.forward(torch.tensor(toks[s:s + n]), [Segment(table, s, n)], rec, last_only=True)
    return rec.amax


def run_text(weights, toks: list[int], cfg: KVAccuracyConfig, calibration, log=print) -> dict[str, Tally]:
    spec, n_tok = weights.spec, len(toks)
    layout = KVLayout.for_spec(spec, cfg.page_size, -(-(n_tok + cfg.generate) // cfg.page_size), torch.float32)
    variants = list(dict.fromkeys([BASELINE, *cfg.variants]))
    caches = {v: make_cache(v, layout, calibration) for v in variants}
    tallies = {v: Tally() for v in variants}
    table, dec = tuple(range(layout.num_pages)), ReferenceDecoder(weights)
    ids = torch.tensor(toks)
    last: dict[str, torch.Tensor] = {}
    for s in range(0, n_tok, cfg.chunk):
        n = min(cfg.chunk, n_tok - s)
        pos = torch.arange(s, s + n)
        nxt = ids[(pos + 1).clamp_max(n_tok - 1)]
        has_next = pos + 1 < n_tok
        base = None
        for v in variants:
            lp = torch.log_softmax(dec.forward(ids[s:s + n], [Segment(table, s, n)], caches[v]), -1)  # [n, V]
            base = lp if v == BASELINE else base
            tallies[v].add(base, lp, pos, n_tok // 2, nxt, has_next)
            last[v] = lp[-1]
        log(f"[kv-accuracy]   {s + n}/{n_tok} tokens")
    if cfg.generate:
        for v in variants:
            tallies[v].greedy = _greedy(dec, caches[v], table, last[v], n_tok, cfg.generate)
    return tallies


def _row(variant: str, text: str, t: Tally, base: Tally, kv_bytes: int | None) -> dict:
    g, b = t.greedy, base.greedy
    prefix = next((i for i, (x, y) in enumerate(zip(g, b)) if x != y), len(g))
    return {"variant": variant, "text": text, "positions": t.n, "agree": t.agree / t.n,
            "agree_late": t.agree_late / max(1, t.n_late), "kl_mean": t.kl_sum / t.n,
            "kl_late": t.kl_late_sum / max(1, t.n_late), "kl_max": t.kl_max, "top1": t.top1 / max(1, t.n_top1),
            "greedy_prefix": prefix, "greedy_same": sum(x == y for x, y in zip(g, b)) / max(1, len(g)),
            "greedy_tokens": g, "kv_bytes_per_token": kv_bytes}


def summarize(rows: list[dict]) -> list[dict]:
    """Per variant, over texts: position-weighted agreement and KL, worst greedy prefix."""
    out = []
    for v in dict.fromkeys(r["variant"] for r in rows):
        rs = [r for r in rows if r["variant"] == v]
        n = sum(r["positions"] for r in rs)
        w = lambda k: sum(r[k] * r["positions"] for r in rs) / n  # noqa: E731
        out.append({"variant": v, "texts": len(rs), "positions": n, "agree": w("agree"),
                    "agree_late": w("agree_late"), "kl_mean": w("kl_mean"), "kl_late": w("kl_late"),
                    "kl_max": max(r["kl_max"] for r in rs), "top1": w("top1"),
                    "greedy_prefix_min": min(r["greedy_prefix"] for r in rs),
                    "greedy_same": sum(r["greedy_same"] for r in rs) / len(rs),
                    "kv_bytes_per_token": rs[0]["kv_bytes_per_token"]})
    return out


def kv_bytes_per_token(variant: str, spec) -> int:
    """Bytes a position costs in that format (scales included; static scales are negligible)."""
    hd = spec.head_dim
    k_v = {"fp32": (4 * hd, 4 * hd), "bf16": (2 * hd, 2 * hd), "fp8-token-f32": (hd + 4, hd + 4),
           "fp8-v-only": (2 * hd, hd + 2), "fp8-page": (hd, hd), "fp8-static-1": (hd, hd),
           "fp8-static-cal": (hd, hd)}.get(variant, (hd + 2, hd + 2))  # the others: a 2-byte scale a row
    return spec.num_layers * spec.num_kv_heads * sum(k_v)


def markdown(doc: dict) -> str:
    cfg = doc["config"]
    lines = [f"# KV element formats vs bf16 KV: {doc['model']} on the CPU, {len(cfg['texts'])} texts x "
             f"{cfg['tokens']} tokens", "",
             f"{doc['date']} · commit `{doc['commit']}` · torch {doc['torch']} · Python {doc['python']} · texts: "
             f"{', '.join(cfg['texts'])} · greedy: {cfg['generate']} tokens", "",
             "| KV format | bytes/token | argmax agreement | 2nd half | mean KL (nats) | 2nd half | max KL | "
             "top-1 on text | greedy: identical prefix (worst) | greedy: same tokens |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s in doc["summary"]:
        lines.append(f"| {s['variant']} | {s['kv_bytes_per_token']} | {s['agree']:.4%} | {s['agree_late']:.4%} | "
                     f"{s['kl_mean']:.2e} | {s['kl_late']:.2e} | {s['kl_max']:.2e} | {s['top1']:.2%} | "
                     f"{s['greedy_prefix_min']} / {cfg['generate']} | {s['greedy_same']:.1%} |")
    lines += ["", "Agreement, KL and greedy are against the bf16-KV run of the same fp32 weights; the bf16 row is the "
              "baseline itself.", ""]
    return "\n".join(lines)


def run(cfg: KVAccuracyConfig, log=print) -> dict:
    from ..models.checkpoint import load_model
    from .main import git_commit

    torch.set_grad_enabled(False)
    loaded = load_model(cfg.model, dtype=torch.float32, device="cpu", progress=False)
    if loaded.tokenizer is None:
        raise ValueError(f"{loaded.source} has no tokenizer: kv-accuracy needs real text")
    w, tok = loaded.weights, loaded.tokenizer
    t0 = time.perf_counter()
    calibration = calibrate(w, tok, cfg) if "fp8-static-cal" in cfg.variants else None
    doc = {"model": loaded.spec.name, "source": loaded.source, "commit": git_commit(), "torch": torch.__version__,
           "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "command": " ".join(sys.argv), "config": asdict(cfg), "baseline": BASELINE,
           "calibration": None if calibration is None else {"text": CALIBRATION[0],
                                                            **{k: v.tolist() for k, v in calibration.items()}},
           "results": [], "summary": []}
    for label in cfg.texts:
        toks = text_tokens(tok, *TEXTS[label], cfg.tokens)
        log(f"[kv-accuracy] {label}: {len(toks)} tokens x {len(cfg.variants)} variants")
        tallies = run_text(w, toks, cfg, calibration, log)
        doc["results"] += [_row(v, label, t, tallies[BASELINE], kv_bytes_per_token(v, w.spec))
                           for v, t in tallies.items()]
        doc["summary"] = summarize(doc["results"])
        doc["elapsed_s"] = time.perf_counter() - t0
        _write(doc, cfg)
    return doc


def _write(doc: dict, cfg: KVAccuracyConfig) -> None:
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = doc["date"][:16].replace("-", "").replace(":", "").replace(" ", "-")  # 20261205-2350
    base = out / f"{stamp}-cpu-kv-accuracy"
    (base.with_suffix(".json")).write_text(json.dumps(doc, indent=1) + "\n")
    (base.with_suffix(".md")).write_text(markdown(doc))


def add_parser(sub) -> None:
    p = sub.add_parser("kv-accuracy", help="FP8 vs bf16 KV with a real model on long real texts (CPU)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, metavar="PATH", help="checkpoint with a tokenizer (default: the "
                   "embedded SmolLM2-135M-Instruct)")
    p.add_argument("--tokens", type=int, default=4096, help="teacher-forced tokens per text (default 4096)")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (default 512)")
    p.add_argument("--generate", type=int, default=64, help="greedy tokens after each text (default 64)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--texts", default=",".join(TEXTS), help=f"comma list of {', '.join(TEXTS)}")
    p.add_argument("--out", default="bench/results", metavar="DIR")


def run_args(args: argparse.Namespace) -> int:
    try:
        cfg = KVAccuracyConfig(model=args.model, tokens=args.tokens, chunk=args.chunk, generate=args.generate,
                               variants=tuple(v for v in args.variants.split(",") if v),
                               texts=tuple(t for t in args.texts.split(",") if t), out_dir=args.out)
    except ValueError as e:
        print(f"mimw bench kv-accuracy: error: {e}", file=sys.stderr)
        return 2
    doc = run(cfg, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(markdown(doc))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mimw.bench.kv_accuracy")
    add_parser(parser.add_subparsers(dest="bench_command", required=True))
    return run_args(parser.parse_args(["kv-accuracy", *(argv if argv is not None else sys.argv[1:])]))


if __name__ == "__main__":
    sys.exit(main())
