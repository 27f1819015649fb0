"""The compute-sanitizer entry's cases (gpu/sanitize.py) on the CPU: what scripts/gpu_check.sh runs one process a
case. Building the cases needs no GPU; running them does."""
import subprocess
import sys

from mimw.megakernel.gpu.config import KernelConfig
from mimw.megakernel.gpu.sanitize import cases


def test_cases_start_with_the_default_kernel_and_end_with_the_per_warp_releases():
    todo = cases()
    names = list(todo)
    assert len(names) == len(set(names)) >= 14
    spec, context, num_sms, kcfg = todo["cluster_down"]
    assert names[0] == "cluster_down" and kcfg == KernelConfig.for_spec(spec) and num_sms == 72
    assert names[-1] == "warp_release" and todo["warp_release"][3].warp_release
    for spec, context, num_sms, kcfg in todo.values():
        kcfg.check(spec)  # every case is a valid kernel for its shape
        assert not kcfg.hold_count


def test_hold_count_puts_every_case_on_the_holds_count():
    assert all(k.hold_count and k.hold_bytes() == 16 for _, _, _, k in cases(hold_count=True).values())


def test_the_list_is_one_name_a_line_for_the_shell_loop():
    out = subprocess.run([sys.executable, "-m", "mimw.megakernel.gpu.sanitize", "--list", "--hold-count"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == list(cases()) and all(" " not in n for n in out)


def test_an_unknown_or_missing_case_is_a_clear_error_before_the_gpu_is_touched():
    for args in (["--case", "no-such-case"], ["--case"]):
        r = subprocess.run([sys.executable, "-m", "mimw.megakernel.gpu.sanitize", *args], capture_output=True,
                           text=True)
        assert r.returncode == 2 and "--list names them" in r.stderr, r.stderr
