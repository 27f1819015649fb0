"""Runs the ``*_interpreted.py`` test files (the prefill kernels, the greedy-pick kernel) in a process of their own
with TRITON_INTERPRET=1 (the interpreter must be on before triton is imported), so the Triton kernels are checked on
every CPU run."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
FILES = [HERE / "prefill" / "test_kernels_interpreted.py", HERE / "engine" / "test_argmax_interpreted.py"]


@pytest.mark.slow
def test_triton_kernels_pass_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *map(str, FILES)],
                       env=env, capture_output=True, text=True, timeout=900, cwd=HERE.parent)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert " skipped" not in r.stdout.splitlines()[-1], r.stdout[-3000:]  # every case ran
