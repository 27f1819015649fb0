"""Step timing on the CPU (wall clock): sample statistics and the step budget."""
import torch

from mimw.bench.timing import steps_for_budget, summarize, time_steps


def test_summarize():
    t = summarize([3.0, 1.0, 2.0, 10.0])
    assert t.median_ms == 2.5 and t.min_ms == 1.0 and t.mean_ms == 4.0 and t.steps == 4 and t.p90_ms == 10.0


def test_steps_for_budget_clamps():
    assert steps_for_budget(1.0, 100, 2.0) == 100        # 2000 would fit, capped by max_steps
    assert steps_for_budget(100.0, 100, 2.0) == 20
    assert steps_for_budget(10_000.0, 100, 2.0) == 10    # never fewer than min_steps
    assert steps_for_budget(10_000.0, 5, 2.0) == 5       # ... unless max_steps is smaller


def test_time_steps_counts_calls():
    calls = []
    t = time_steps(lambda: calls.append(1), torch.device("cpu"), max_steps=7, warmup=2, budget_s=1.0)
    assert t.steps == 7 and len(calls) == 2 + 1 + 7 and t.median_ms >= 0.0
