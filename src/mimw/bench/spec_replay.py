"""Offline replay of speculative decoding over the greedy outputs a ``mimw bench spec`` run recorded.

Greedy decoding is deterministic, so once a run has recorded each prompt's plain output, what any drafter would
propose at every point and how much of it the target would accept follow without running the model: a step at
output position i drafts ``d`` (the drafter and the draft-length policy, the engine's own classes, seeing the
prompt and output so far), accepts the longest prefix of ``d`` equal to the recorded output from i on, and emits one
token more. Priced by a verify-cost table v(k) (a step of 1 + k tokens against a one-token step; the policy sees it
per power-of-two token bucket, as ``StepCosts`` measures it), the replay predicts the decode-only speedup over plain
decoding in seconds for drafter and policy settings that would take an hour of model time to measure, e.g.:

    PYTHONPATH=src python -m mimw.bench.spec_replay \\
        --results bench/results/<run>.json --costs 1:1.05,2:1.13,3:1.2,4:1.34,8:1.38,12:1.6,16:1.73

It predicts, it does not measure: the numbers that count come from ``mimw bench spec``. It ignores prefill, the
drafters' host time and stops other than the recorded output's length.
"""
from __future__ import annotations

import argparse
import bisect
import json
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

from ..engine.sampling import SamplingParams
from ..engine.spec.config import SpecConfig, SuffixConfig
from ..engine.spec.drafter import DraftInput
from ..engine.spec.policy import DraftLengthPolicy
from ..engine.spec.speculator import make_drafter
from ..engine.step_costs import bucket


@dataclass(frozen=True)
class ReplayResult:
    tokens: int
    cost: float  # in one-token decode steps
    verify_steps: int
    drafted: int
    accepted: int

    @property
    def speedup(self) -> float:
        return self.tokens / self.cost if self.cost else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def cost_table(spec: str) -> Callable[[int], float]:
    """"k:v,k:v,..." -> v(k), linear between the given k (v(0) = 1), flat past the last."""
    pts = {0: 1.0}
    for item in spec.split(","):
        k, v = item.split(":")
        if int(k) < 1 or float(v) < 1.0:
            raise ValueError(f"--costs: need k >= 1 and v >= 1, got {item!r}")
        pts[int(k)] = float(v)
    ks = sorted(pts)

    def v(k: int) -> float:
        i = bisect.bisect_left(ks, k)
        if i < len(ks) and ks[i] == k:
            return pts[k]
        if i >= len(ks):
            return pts[ks[-1]]
        k0, k1 = ks[i - 1], ks[i]
        return pts[k0] + (pts[k1] - pts[k0]) * (k - k0) / (k1 - k0)
    return v


def replay(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], cfg: SpecConfig,
           v: Callable[[int], float]) -> ReplayResult:
    drafter, policy = make_drafter(cfg), DraftLengthPolicy(cfg)
    params = SamplingParams(temperature=0, max_tokens=1 << 30)
    priced = lambda k: v(bucket(1 + k) - 1)  # noqa: E731 - what StepCosts answers: its bucket's step
    tokens = steps = drafted = accepted = 0
    cost = 0.0
    for j, (prompt, out) in enumerate(zip(prompts, outputs)):
        rid, seq, i, n = f"replay-{j}", list(prompt), 0, len(out)
        while i < n:
            k = min(policy.length(rid, priced), n - i - 1)
            d = drafter.propose_one(DraftInput(rid, seq, len(prompt), params), k)[:k] if k > 0 else []
            a = 0
            while a < len(d) and d[a] == out[i + a]:
                a += 1
            if d:
                policy.update(rid, len(d), a)
                drafter.observe(rid, len(d), a)
                steps, drafted, accepted = steps + 1, drafted + len(d), accepted + a
            cost += v(len(d))
            seq += out[i:i + a + 1]
            i += a + 1
        policy.forget(rid)
        drafter.finish(DraftInput(rid, seq, len(prompt), params))
        tokens += n
    return ReplayResult(tokens, cost, steps, drafted, accepted)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", required=True, help="a `mimw bench spec` JSON (its plain rows' outputs)")
    p.add_argument("--costs", required=True, help="verify cost v(k) as k:v,... (v(0) = 1)")
    p.add_argument("--drafters", default="ngram,suffix")
    p.add_argument("--spec-tokens", type=int, default=None, help="K (default: the run's)")
    p.add_argument("--min-prob", type=float, default=None, help="suffix drafter's min_prob (default: the config's)")
    args = p.parse_args(argv)
    try:
        doc = json.loads(open(args.results).read())
        v = cost_table(args.costs)
    except (OSError, ValueError) as e:
        print(f"spec_replay: error: {e}", file=sys.stderr)
        return 2
    from ..models.checkpoint import load_model
    from .spec_prompts import SETS

    meta = doc["meta"]
    tok = load_model(None if "SmolLM2" in meta["model"] else meta["source"], progress=False).tokenizer
    k = args.spec_tokens or meta["spec_tokens"]
    suffix = SuffixConfig() if args.min_prob is None else SuffixConfig(min_prob=args.min_prob)
    print(f"| set | drafter | predicted decode speedup | acceptance | drafted | accepted | verify steps |")
    print("|---|---|---|---|---|---|---|")
    for s, modes in doc["rows"].items():
        plain = modes["plain"]
        by_name = {pp.name: tok.apply_chat_template(list(pp.messages)) for pp in SETS[s](len(plain))}
        prompts = [by_name[r["prompt"]] for r in plain]
        for m in args.drafters.split(","):
            r = replay(prompts, [r["output"] for r in plain], SpecConfig(m, num_tokens=k, suffix=suffix), v)
            print(f"| {s} | {m} | {r.speedup:.2f}x | {r.acceptance:.0%} | {r.drafted} | {r.accepted} | "
                  f"{r.verify_steps} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
