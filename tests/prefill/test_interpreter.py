"""Runs ``test_kernels_interpreted.py`` in a process of its own with TRITON_INTERPRET=1 (the interpreter must be on
before triton is imported), so the Triton kernels are checked on every CPU run."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
def test_triton_kernels_pass_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE.parents[1] / "src"), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                        str(HERE / "test_kernels_interpreted.py")], env=env, capture_output=True, text=True,
                       timeout=900, cwd=HERE.parents[1])
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert " skipped" not in r.stdout.splitlines()[-1], r.stdout[-3000:]  # every case ran
