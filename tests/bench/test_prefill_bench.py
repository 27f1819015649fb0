"""``mimw bench prefill`` end to end on the CPU at tiny shapes (the reference's kernels; the GPU-only sweeps off):
rows, checks against the plain SDPA prefill, FLOPs and MFU, the reports and the chart."""
import json

import pytest

from mimw.bench.prefill import PrefillBenchConfig, run_bench
from mimw.bench.prefill_report import prefill_flops
from mimw.cli import main
from mimw.models.spec import get_preset


def test_prefill_bench_runs_every_implementation_and_writes_its_reports(tmp_path, capsys):
    cfg = PrefillBenchConfig(models=("tiny-llama3",), lengths=(40, 100), impls=("plain-sdpa", "sdpa", "no-attention"),
                             chunk=32, chunk_sweep=(), attention_sweep=False, engine=False, out_dir=str(tmp_path),
                             device="cpu", kernels="torch")
    assert run_bench(cfg, gemm_tflops=1.0) == 0
    doc = json.loads(next(tmp_path.glob("*-prefill.json")).read_text())
    rows = {(r["tokens"], r["impl"]): r for r in doc["rows"]}
    assert set(rows) == {(n, i) for n in (40, 100) for i in ("plain-sdpa", "sdpa", "no-attention")}
    for (n, impl), r in rows.items():
        assert r["ttft_s"] > 0 and r["tokens_per_s"] == pytest.approx(n / r["ttft_s"])
        assert r["flops"] == prefill_flops(get_preset("tiny-llama3"), n)
        assert r["mfu"] == pytest.approx(r["flops"] / 1e12 / r["ttft_s"])
        if impl == "sdpa":  # chunked over pages, checked against the one-call prefill
            assert r["rel_err"] < 3e-2 and r["chunk"] == 32
        if impl == "no-attention":  # a timing of the rest of the pass: its logits are not a prefill's
            assert "rel_err" not in r
    assert next(tmp_path.glob("*-prefill.png")).stat().st_size > 0
    md = next(tmp_path.glob("*-prefill.md")).read_text()
    assert "| tiny-llama3 | 100 | sdpa | 32 |" in md
    # no-attention's time lacks the attention its FLOPs count: no MFU shown
    assert next(line for line in md.splitlines() if "| 100 | no-attention |" in line).split("|")[7].strip() == ""
    assert "TTFT s / MFU" in capsys.readouterr().out


def test_prefill_flops_count_causal_attention_pairs():
    spec = get_preset("llama-3.2-1b")
    one, two = prefill_flops(spec, 1), prefill_flops(spec, 2)
    layer_weights = 2 * (2048 * (2048 + 1024) + 2048 * 2048 + 3 * 2048 * 8192)
    # one more token: its weights, and 2 more causal pairs (3 instead of 1), 4 L Hq hd FLOPs each
    assert two - one == pytest.approx(16 * layer_weights + 4 * 16 * 32 * 64 * 2)


def test_bad_arguments_exit_2(capsys):
    assert main(["bench", "prefill", "--impls", "fa3"]) == 2
    assert main(["bench", "prefill", "--lengths", "2k"]) == 2
    assert main(["bench", "prefill", "--attention-lengths", "8192", "--chunk", "16384"]) == 2  # no prefix
    assert "error" in capsys.readouterr().err


def _rows(ttft: dict) -> list[dict]:
    return [{"model": m, "tokens": n, "impl": impl, "ttft_s": t} for (m, n, impl), t in ttft.items()]


# scripts/prefill_gpu.sh long on an H100 (commit 696047b): TTFT s per (model, tokens, attention)
H100 = {("llama-3.1-8b", 32768, "plain-sdpa"): 1.5185, ("llama-3.1-8b", 131072, "plain-sdpa"): 12.7796,
        ("llama-3.2-1b", 32768, "plain-sdpa"): 0.3358, ("llama-3.2-1b", 131072, "plain-sdpa"): 3.2884,
        ("llama-3.1-8b", 32768, "triton"): 1.4679, ("llama-3.1-8b", 131072, "triton"): 14.2483,
        ("llama-3.2-1b", 32768, "triton"): 0.3022, ("llama-3.2-1b", 131072, "triton"): 3.5822,
        ("llama-3.1-8b", 32768, "cudnn"): 1.4606, ("llama-3.1-8b", 131072, "cudnn"): 11.7661,
        ("llama-3.2-1b", 32768, "cudnn"): 0.3489, ("llama-3.2-1b", 131072, "cudnn"): 3.6994}
# and made-up rows: sdpa stops at 32k (incomplete), short prompts do not count
H100.update({("llama-3.1-8b", 32768, "sdpa"): 1.62, ("llama-3.2-1b", 32768, "sdpa"): 0.40,
             ("llama-3.2-1b", 2048, "plain-sdpa"): 1.0, ("llama-3.2-1b", 2048, "sdpa"): 0.1})


def test_verdict_keeps_triton_when_the_best_geomean_is_within_2_percent_of_its():
    """The H100 run: cudnn's geomean (1.009) beats triton's (1.014) by 0.5%, a tie that goes to triton; cudnn is
    the fastest in two cells, so it stays; sdpa ran only the 32k cells and is the fastest in none."""
    from mimw.bench.prefill_summary import verdict

    text = verdict({"rows": _rows(H100)})
    assert "triton  0.967 1.115 0.900 1.089   geomean 1.014" in text
    assert "cudnn   0.962 0.921 1.039 1.125   geomean 1.009" in text
    assert "sdpa    1.067 - 1.191 -   geomean 1.127 (incomplete)" in text
    assert "best geomean: cudnn (1.009); triton's (1.014) is within 2% of it: the tie goes to triton" in text
    assert "default: triton (geomean 1.014; loses to plain SDPA)" in text
    assert "keep: cudnn, triton; delete: sdpa" in text


def test_verdict_picks_an_attention_more_than_2_percent_ahead_and_names_the_losers():
    from mimw.bench.prefill_summary import verdict

    faster = {k: (0.95 * t if k[2] == "cudnn" else t) for k, t in H100.items()}  # cudnn's geomean 0.958
    text = verdict({"rows": _rows(faster)})
    assert "best geomean" not in text
    assert "default: cudnn (geomean 0.958; beats plain SDPA)" in text
    assert "keep: cudnn, triton; delete: sdpa" in text  # triton is still the fastest at 1B 32k
    # triton misses the cell where it is slowest: its geomean over the other three (0.990) beats cudnn's (1.009),
    # but only attentions that ran every cell compete
    missing = {k: t for k, t in H100.items() if k != ("llama-3.2-1b", 131072, "triton")}
    text = verdict({"rows": _rows(missing)})
    assert "triton  0.967 1.115 0.900 -   geomean 0.990 (incomplete)" in text
    assert "best geomean" not in text and "default: cudnn (geomean 1.009; loses to plain SDPA)" in text
    short = verdict({"rows": _rows({("llama-3.2-1b", 2048, "plain-sdpa"): 1.0})})
    assert short == "verdict: no long-prompt cell with a plain SDPA row"


def test_the_long_mode_arguments_of_prefill_gpu_sh_are_accepted(capsys):
    """scripts/prefill_gpu.sh long's bench arguments parse (here, with no GPU, the command stops right after)."""
    import re
    from pathlib import Path

    import torch

    if torch.cuda.is_available():
        pytest.skip("with a GPU this would run the benchmark")
    script = (Path(__file__).resolve().parents[2] / "scripts" / "prefill_gpu.sh").read_text()
    block = script[script.index("long)"):]
    block = block[block.index("mimw.bench.main prefill"):block.index("${COMMIT")]
    args = re.sub(r'"\$out"', "/tmp/unused", block.replace("\\\n", " ")).split()[1:]
    args = ["" if a == "''" else a for a in args]
    assert main(["bench", *args]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err
