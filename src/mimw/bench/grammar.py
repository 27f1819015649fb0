"""Per-token cost of structured generation on this CPU: the libraries mimw could use to constrain decoding to a
JSON schema, measured on the default model's tokenizer (SmolLM2, 49,152 ids).

For each library: the one-time tokenizer setup, the schema's compilation, and then - over a valid JSON document
of that schema, tokenized by the model's tokenizer - the per-token work of constrained decoding: fill the
next-token mask (a packed int32 bitmask, the form mimw applies to the logits) and advance the matcher by the
token. Prints one markdown table row per library; ``--json PATH`` writes the numbers.

    PYTHONPATH=src python -m mimw.bench.grammar [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
            "tags": ["mathematics", "engines", "poetry of science"],
            "address": {"city": "London", "zip": "W1 4AB"}, "active": True}


def _xgrammar(hf: Any, vocab: int, eos: list[int]) -> tuple[Callable, Callable]:
    import xgrammar as xgr

    def setup():
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos)
        return xgr.GrammarCompiler(info, max_threads=1)

    def compile_(compiler):
        g = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
        m = xgr.GrammarMatcher(g)
        mask = xgr.allocate_token_bitmask(1, vocab)

        def step(tok: int) -> None:
            m.fill_next_token_bitmask(mask)
            if not m.accept_token(tok):
                raise RuntimeError("xgrammar rejected a valid token")
        return step
    return setup, compile_


def _llguidance(hf: Any, vocab: int, eos: list[int]) -> tuple[Callable, Callable]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    def setup():
        return llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=eos[0])

    def compile_(tok_ll):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
        m = llguidance.LLMatcher(tok_ll, grammar)
        if m.is_error():
            raise RuntimeError(m.get_error())
        mask = llguidance.torch.allocate_token_bitmask(1, vocab)

        def step(tok: int) -> None:
            llguidance.torch.fill_next_token_bitmask(m, mask, 0)
            if not m.consume_token(tok):
                raise RuntimeError(f"llguidance rejected a valid token: {m.get_error()}")
        return step
    return setup, compile_


def _outlines_core(hf: Any, vocab: int, eos: list[int]) -> tuple[Callable, Callable]:
    import outlines_core as oc

    def setup():
        byte_decoder = _byte_decoder()
        tokens: dict[bytes, list[int]] = {}
        for tid in range(vocab):
            if tid in eos:
                continue
            piece = hf.convert_ids_to_tokens(tid)
            if piece is None or (hf.all_special_ids and tid in hf.all_special_ids):
                continue
            try:
                b = bytes(byte_decoder[c] for c in piece)
            except KeyError:
                b = piece.encode()
            tokens.setdefault(b, []).append(tid)
        return oc.Vocabulary(eos[0], tokens)

    def compile_(v):
        regex = oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern="")
        index = oc.Index(regex, v)
        guide = oc.Guide(index)
        mask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)

        def step(tok: int) -> None:
            guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
            if not guide.is_finished():  # EOS at the end is allowed by the mask; the guide has no state past it
                guide.advance(tok, return_tokens=False)
        return step
    return setup, compile_


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-character <-> byte table (byte-level BPE pieces -> raw bytes)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


LIBRARIES = {"xgrammar": _xgrammar, "llguidance": _llguidance, "outlines-core": _outlines_core}


def measure(name: str, hf: Any, vocab: int, eos: list[int], tokens: list[int], repeats: int) -> dict[str, Any]:
    from importlib.metadata import version

    setup, compile_ = LIBRARIES[name](hf, vocab, eos)
    t0 = time.perf_counter()
    ctx = setup()
    t_setup = time.perf_counter() - t0
    compiles, per_token = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step = compile_(ctx)
        compiles.append(time.perf_counter() - t0)
        times = []
        for tok in tokens:
            t0 = time.perf_counter()
            step(tok)
            times.append(time.perf_counter() - t0)
        per_token.append(times)
    flat = sorted(t for run in per_token[1:] or per_token for t in run)  # the first run warms caches
    return {"library": name, "version": version(name), "setup_s": t_setup, "compile_ms": statistics.median(compiles) * 1e3,
            "first_compile_ms": compiles[0] * 1e3, "token_us_median": flat[len(flat) // 2] * 1e6,
            "token_us_p99": flat[min(len(flat) - 1, int(len(flat) * 0.99))] * 1e6,
            "token_us_mean": statistics.fmean(flat) * 1e6, "tokens": len(tokens)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mimw.bench.grammar", description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--libraries", nargs="*", default=list(LIBRARIES), choices=list(LIBRARIES))
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    from ..models.default_model import default_gguf_path
    from ..models.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(default_gguf_path())
    vocab = tok.vocab_size
    tokens = tok.encode(json.dumps(DOCUMENT, separators=(",", ":")), add_special_tokens=False)
    tokens.append(tok.eos_token_ids[0])
    rows = []
    print(f"vocabulary {vocab}, document {len(tokens)} tokens (EOS included), {torch.get_num_threads()} threads")
    print("| library | setup (s) | compile (ms, first / median) | mask + advance per token (µs, median / p99 / mean) |")
    print("|---|---|---|---|")
    for name in args.libraries:
        try:
            r = measure(name, tok.hf, vocab, list(tok.eos_token_ids), tokens, args.repeats)
        except Exception as e:  # a library that cannot run here is reported, not fatal
            print(f"| {name} | failed: {type(e).__name__}: {e} | | |")
            continue
        rows.append(r)
        print(f"| {name} {r['version']} | {r['setup_s']:.2f} | {r['first_compile_ms']:.1f} / {r['compile_ms']:.1f} | "
              f"{r['token_us_median']:.0f} / {r['token_us_p99']:.0f} / {r['token_us_mean']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"vocab": vocab, "tokens": len(tokens), "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
