"""EXPERT_DOWN's finisher (ops/expert_down.py) on the GPU: each row tile's slot parts come in one load whose layout
holds a token's slots whole in one thread, so that the thread adds them in slot order (the order ``finish`` adds
them in: results independent of which slot finishes last and of the reduction's lowering)."""
import pytest

from mimw.megakernel.device import layouts
from mimw.megakernel.plan import plan
from mimw.megakernel.program import StepShape
from mimw.models.spec import get_preset


@pytest.mark.parametrize("model,batch", [("qwen3-30b-a3b", 8), ("tiny-qwen3-moe-mt", 8), ("tiny-qwen3-moe-mt", 3)])
def test_a_decode_batchs_gather_holds_each_tokens_chosen_slots_in_one_thread_and_the_tile_once(model, batch):
    c = plan(get_preset(model), 132, StepShape((1,) * batch, 1024)).constants
    lay, k2 = layouts.chosen_parts(c), layouts.top_k_rows(c)
    assert k2 >= c.K and k2 & (k2 - 1) == 0
    assert (lay.size_per_thread[0], lay.threads_per_warp[0], lay.warps_per_cta[0]) == (k2, 1, 1)
    # [K2, TR, MB] covered exactly: no thread loads another's parts (a token's k parts of a tile: 2 * K2 loads)
    cover = [s * t * w for s, t, w in zip(lay.size_per_thread, lay.threads_per_warp, lay.warps_per_cta)]
    assert cover == [k2, c.TR, c.MB] and lay.size_per_thread[0] * lay.size_per_thread[1] == 2 * k2
    # the slot search runs each token's reductions over the slots within a warp (redux, no shared memory)
    w = layouts.slot_tokens(c)
    assert w.warps_per_cta[0] == 1 and w.threads_per_warp[1] == 1


@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "tiny-qwen3-moe"])
def test_one_tokens_gather_holds_every_slot_in_one_thread(model):
    c = plan(get_preset(model), 132).constants
    lay = layouts.slot_rows(c)
    assert c.M == 1 and c.S2 >= c.S == c.K
    assert (lay.size_per_thread[0], lay.threads_per_warp[0], lay.warps_per_cta[0]) == (c.S2, 1, 1)
