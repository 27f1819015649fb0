"""The compute-sanitizer entry's cases (tools/sanitize.py) on the CPU: what scripts/gpu_check.sh runs. Building the
cases needs no GPU; running them does."""
import subprocess
import sys

import torch

from mimw.megakernel.launch.one_token import query_blocks
from mimw.megakernel.plan import Tuning, plan
from mimw.megakernel.program import StepShape
from mimw.megakernel.tools.sanitize import cases


def test_cases_cover_both_pairs_the_shared_memory_merge_the_tickets_a_decode_batch_and_a_verify_block():
    todo = cases()
    assert list(todo)[0] == "cluster_down" and len(todo) == len(set(todo)) == 15
    shapes = {}
    for name, (spec, context, num_sms, tuning, lens, kv_dtype) in todo.items():
        # every case is a valid kernel: M one-token segments (a verify block's tokens each one: launch/one_token.py),
        # verify blocks as attention's query blocks as step_segments runs them
        p = plan(spec, num_sms, StepShape((1,) * sum(lens), context, query_blocks(lens)), 16, tuning, kv_dtype)
        shapes[name] = (p.program.attn_pairs, p.program.down_pairs, p.constants.SMEM_MERGE)
        if name == "kv_ring_batch":  # one split a sequence and KV head over five ring slots of its past
            c = p.constants
            assert p.program.max_splits == 1 and -(-(context - 1) // c.KVS) >= 5
            assert c.M == 8 and c.QT == 1 and c.KVS == 64 and c.ATTN_MMA and c.NB >= 4
        if name == "kv_ring_tail":  # a block of sixteen, then a one-token group continuing it
            c = p.constants
            assert c.M == 17 and c.KVS > 0 and p.program.shape.attn_blocks == (16, 1)
        if name == "query_block":  # one block of sixteen, four splits, each over eight K/V blocks
            c = p.constants
            assert c.QT == 16 and p.program.n_splits == (4,) and -(-(context // 4) // c.QBT) + 1 >= 8
        if name in ("kv_ring", "kv_ring_fp8"):  # a KV head's splits walk several ring slots, one starting inside a box
            from mimw.megakernel.state import split_range

            c, n = p.constants, p.program.max_splits
            los = [split_range(context, i, n)[0] for i in range(n)]
            assert c.M == 1 and n >= 2 and any(lo % c.KVBOX for lo in los)
            assert all(-(-(split_range(context, i, n)[1] - lo) // c.KVS) >= 4 for i, lo in enumerate(los))
            assert c.FP8 == (name == "kv_ring_fp8")
    assert todo["decode_batch"][4] == (1, 1, 1) and shapes["decode_batch"][:2] == (False, False)
    assert todo["verify_block"][4] == (3, 1) and shapes["verify_block"][:2] == (False, False)
    assert shapes["cluster_down"] == (True, True, False)  # SmolLM2: its staging buffer is too small to merge
    assert shapes["attn_smem_merge"][2] and shapes["cluster_qkv"][:2] == (True, False)
    assert shapes["tickets"][:2] == (False, False) and todo["tickets"][3] == Tuning(clusters=False, qkv_parts=2)
    assert all(c[4] == (1,) for n, c in todo.items() if n not in ("decode_batch", "verify_block", "moe_batch",
                                                                             "kv_ring_batch", "kv_ring_tail",
                                                                             "query_block"))
    assert all(c[5] == torch.bfloat16 for n, c in todo.items() if n != "kv_ring_fp8")
    assert todo["moe"][0].is_moe and todo["moe_a3b"][0].is_moe and shapes["moe_a3b"][2]  # eight heads: the merge


def test_the_list_is_one_name_a_line_for_the_shell_loop():
    out = subprocess.run([sys.executable, "-m", "mimw.megakernel.tools.sanitize", "--list"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == list(cases()) and all(" " not in n for n in out)


def test_an_unknown_or_missing_case_is_a_clear_error_before_the_gpu_is_touched():
    for args in (["--case", "no-such-case"], ["--case"]):
        r = subprocess.run([sys.executable, "-m", "mimw.megakernel.tools.sanitize", *args], capture_output=True,
                           text=True)
        assert r.returncode == 2 and "--list names them" in r.stderr, r.stderr
