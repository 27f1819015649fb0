"""CI (CPU only): a tensor-parallel rank's megakernel (plan.plan(..., tp=(rank, N)): device/peer.py, REDUCE's
device code) compiles for sm_90a without spills and fits shared memory, for one token and for decode batches, its
peer counters signalled and waited for at system scope; the one-GPU kernel compiles none of it."""
import functools

import pytest

from mimw.megakernel.launch.compile import compile_sm90a, partition_barrier_errors, ptxas_report
from mimw.megakernel.plan import SHARED_BYTES, plan
from mimw.megakernel.program import StepShape
from mimw.models.spec import get_preset

pytestmark = pytest.mark.slow


@functools.lru_cache(maxsize=None)
def _build(model: str, ranks: int, batch: int, num_sms: int):
    p = plan(get_preset(model), num_sms, StepShape((1,) * batch, 1024), tp=(0, ranks))
    k = compile_sm90a(p)
    return p, k, ptxas_report(k.asm["ptx"])


# (model, ranks, tokens, SMs a rank): ranks sharing one H100/H200 (132 SMs) as launch/tp.py runs them, and a rank
# on a GPU of its own; the 8B's 16-token rank is the kernel nearest the register limit; the SmolLM2's three ranks
# pair their DOWN_PROJ halves on cluster mates
CASES = [("llama-3.2-1b", 2, 1, 66), ("llama-3.2-1b", 2, 1, 132), ("llama-3.2-1b", 2, 8, 66),
         ("llama-3.2-1b", 2, 32, 132), ("llama-3.1-8b", 2, 1, 66), ("llama-3.1-8b", 8, 1, 16),
         ("llama-3.1-8b", 2, 16, 66), ("qwen3-8b", 2, 8, 66), ("smollm2-135m", 3, 1, 44),
         ("llama-3.1-70b", 8, 1, 132), ("llama-3.1-70b", 4, 8, 132)]


@pytest.mark.parametrize("model,ranks,batch,num_sms", CASES)
def test_rank_kernels_compile_spill_free_with_system_scope_peer_counters(model, ranks, batch, num_sms):
    p, k, rep = _build(model, ranks, batch, num_sms)
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep
    assert k.metadata.shared + p.exchange_bytes <= SHARED_BYTES
    ptx = k.asm["ptx"]
    assert not partition_barrier_errors(ptx, p.constants.NW)  # REDUCE's noinline function has no barrier 0
    # the peer counters at system scope, every other counter at GPU scope as on one GPU
    assert "atom.global.sys.release.add" in ptx and "ld.global.sys.acquire" in ptx
    assert "atom.global.gpu.release.add" in ptx and "ld.global.gpu.acquire" in ptx
    c = p.constants
    assert (c.TP, c.HQ, c.HKV, c.V) == (ranks, p.spec.num_heads, p.spec.num_kv_heads, p.spec.vocab_size)
    if model == "smollm2-135m":
        assert c.DOWN_PAIRS and "st.async.shared::cluster" in ptx


def test_the_one_gpu_kernel_has_no_system_scope_counters():
    p, k, _ = _build("llama-3.2-1b", 1, 1, 132)
    assert p.constants.TP == 1
    assert ".sys." not in k.asm["ptx"]
