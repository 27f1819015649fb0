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


def test_verdict_picks_the_best_geomean_over_the_long_cells_and_names_the_losers():
    from mimw.bench.prefill_summary import verdict

    def row(model, n, impl, t):
        return {"model": model, "tokens": n, "impl": impl, "ttft_s": t}

    rows = [row(m, n, "plain-sdpa", 1.0) for m in ("a", "b") for n in (32768, 131072)]
    rows += [row("a", 32768, "triton", 0.8), row("a", 131072, "triton", 1.3), row("b", 32768, "triton", 0.9),
             row("b", 131072, "triton", 1.2)]
    rows += [row("a", 32768, "flash", 0.95), row("a", 131072, "flash", 0.97), row("b", 32768, "flash", 0.96),
             row("b", 131072, "flash", 0.98)]
    rows += [row(m, n, "cudnn", 1.1) for m in ("a", "b") for n in (32768, 131072)]
    rows += [row("a", 2048, "cudnn", 0.1), row("a", 2048, "plain-sdpa", 1.0)]  # short prompts do not count
    text = verdict({"rows": rows})
    assert "default: flash" in text and "beats plain SDPA" in text and "long_attention='flash'" in text
    assert "keep: flash, triton; delete: cudnn" in text  # triton is fastest in two cells


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
