"""``mimw bench engine-host`` on the CPU with the tiny preset: one short run writes a row per setup, context and
batch (with its profile); bad options are one-line errors."""
import json

import torch

from mimw.bench.engine_host import main


def test_a_short_run_writes_a_row_per_setup_context_and_batch(tmp_path, capsys):
    assert main(["--model", "tiny-llama", "--contexts", "40,70", "--batches", "1,3", "--steps", "4", "--profile", "3",
                 "--max-batch", "4", "--max-step-tokens", "64", "--page-size", "4", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "engine-host-cpu-tiny-llama.json").read_text())
    got = [(r["setup"], r["context"], r["batch"]) for r in doc["rows"]]
    assert got == [(s, c, b) for s in ("lru", "session+host") for c in (40, 70) for b in (1, 3)]
    for r in doc["rows"]:
        assert 0 < r["ms_p50"] <= r["ms_p90"] and r["ms_mean"] > 0 and len(r["profile"]) == 3
        assert r["pages_free"] == 0  # the decode steps' pages came from evicted parked pages
        assert (r["host_pages_used"] > 0) == (r["setup"] == "session+host")
    assert "| setup | context | batch |" in capsys.readouterr().out


def test_bad_options_are_one_line_errors(capsys):
    assert main(["--batches", "0"]) == 2
    assert main(["--model", "no-such-preset"]) == 2
    assert main(["--setups", "mru"]) == 2
    assert main(["--batches", "64"]) == 2
    n = 4
    if not torch.cuda.is_available():
        assert main(["--device", "cuda"]) == 2
        n += 1
    err = capsys.readouterr().err
    assert err.count("mimw bench engine-host: error:") == n and "Traceback" not in err
