"""Tensor-parallel programs, structurally: the shards partition the model, each rank's program covers its shard
exactly once and reduces every row, the words are the same on every rank, one rank is the one-GPU program, and a split
that is not whole is refused. The VM proofs are in test_tp_vm.py."""
from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

from mimw.megakernel import isa
from mimw.megakernel.peers import DOWN_SUM, LM_GATHER, O_SUM
from mimw.megakernel.plan import Tuning
from mimw.megakernel.program import StepShape, build_program
from mimw.megakernel.tensor_parallel import TensorParallel, shard_spec, shard_weights
from mimw.models.spec import get_preset
from mimw.models.weights import expected_layer_shapes, random_weights


def config(spec, **overrides):
    return dataclasses.replace(Tuning().resolve(spec).program_config(), **overrides)


def rows_of(instructions) -> Counter:
    """How many times each (layer, row) is covered by row blocks."""
    return Counter((i.layer, r) for i in instructions for r in range(i.row0, i.row0 + i.nrows))


@pytest.mark.parametrize("size", [2, 4, 8])
def test_the_8b_shape_splits_into_rank_programs_that_cover_their_shard_once(size):
    spec = get_preset("llama-3.1-8b")
    tps = [TensorParallel(spec, r, size) for r in range(size)]
    # the shards partition every head and row: each exactly once over the ranks
    for attr, n in (("q_heads", spec.num_heads), ("kv_heads", spec.num_kv_heads), ("mlp_rows", spec.intermediate_size),
                    ("vocab_rows", spec.vocab_size)):
        got = [i for tp in tps for i in range(n)[getattr(tp, attr)]]
        assert got == list(range(n)), attr
    for tp in tps:  # a rank's query heads are exactly its KV heads' groups
        g = spec.group_size
        assert range(spec.num_heads)[tp.q_heads] == range(tp.kv_heads.start * g, tp.kv_heads.stop * g)

    shard = shard_spec(spec, size)
    # the first and the last rank (CPU time; test_tp_vm.py compares every rank's words at tiny shapes)
    progs = [build_program(spec, StepShape((1,)), 132, config(spec, tp=(r, size))) for r in (0, size - 1)]
    words = [p.encode() for p in progs]
    assert all(torch.equal(w[0], words[0][0]) and torch.equal(w[1], words[0][1]) for w in words)  # same words
    p, L, d = progs[0], spec.num_layers, spec.hidden_size
    assert p.spec == shard and p.tp_size == size and p.logits_width == spec.vocab_size
    ins = list(p.instructions())
    by_op = lambda op: [i for i in ins if i.OP == op]  # noqa: E731
    nh = shard.num_heads + 2 * shard.num_kv_heads
    assert Counter((i.layer, i.head, i.part) for i in by_op(isa.Op.ATTN_IN)) == Counter(
        {(l, h, q): 1 for l in range(L) for h in range(nh) for q in range(p.qkv_parts)})
    assert Counter((i.layer, i.kv_head) for i in by_op(isa.Op.ATTN_PARTIAL)) == Counter(
        {(l, k): p.n_splits[0] for l in range(L) for k in range(shard.num_kv_heads)})
    every_d = Counter({(l, r): 1 for l in range(L) for r in range(d)})
    parts = max(1, p.down_parts)
    assert rows_of(by_op(isa.Op.O_PROJ)) == every_d
    assert rows_of(by_op(isa.Op.MLP_IN)) == Counter(
        {(l, r): 1 for l in range(L) for r in range(spec.intermediate_size // size)})
    assert rows_of(by_op(isa.Op.DOWN_PROJ)) == Counter({k: parts for k in every_d})
    assert rows_of(by_op(isa.Op.LM_HEAD)) == Counter({(0, r): 1 for r in range(spec.vocab_size // size)})
    reduces = by_op(isa.Op.REDUCE)
    for kind, want in ((O_SUM, every_d), (DOWN_SUM, every_d),
                       (LM_GATHER, Counter({(0, r): 1 for r in range(spec.vocab_size // size)}))):
        assert rows_of([i for i in reduces if i.kind == kind]) == want
    # every partial goes to the peers and signals a peer counter of N signals, which its REDUCE waits for
    partials = by_op(isa.Op.O_PROJ) + [i for i in by_op(isa.Op.DOWN_PROJ) if i.signal != isa.NO_COUNTER] + \
        by_op(isa.Op.LM_HEAD)
    assert all(i.flags & isa.PEER and p.counters[i.signal].peer for i in partials)
    assert all(p.counters[i.wait].peer and i.wait_count == size == p.counters[i.wait].count for i in reduces)
    assert sorted(i.wait for i in reduces) == sorted(i.signal for i in partials)
    assert sum(c.peer for c in p.counters) == len(reduces)
    # local stages wait on the reductions: MLP_IN on its layer's O_SUM, ATTN_IN and LM_HEAD on the DOWN_SUM before
    names = [c.name for c in p.counters]
    assert {names[i.wait] for i in by_op(isa.Op.MLP_IN)} == {f"L{l}.o_reduce" for l in range(L)}
    assert {names[i.wait] for i in by_op(isa.Op.ATTN_IN) if i.layer} == {f"L{l}.down_reduce" for l in range(L - 1)}
    assert {names[i.wait] for i in by_op(isa.Op.LM_HEAD)} == {f"L{L - 1}.down_reduce"}


def test_one_rank_is_the_one_gpu_program():
    for name, shape, sms in (("tiny-qwen3", StepShape((1, 1)), 7), ("llama-3.2-1b", StepShape((1,)), 132)):
        spec = get_preset(name)
        a = build_program(spec, shape, sms, config(spec))
        b = build_program(spec, shape, sms, config(spec, tp=(0, 1)))
        assert all(torch.equal(x, y) for x, y in zip(a.encode(), b.encode()))
        assert b.spec == spec and not any(c.peer for c in b.counters)
        assert not any(i.OP == isa.Op.REDUCE or i.flags & isa.PEER for i in b.instructions())


@pytest.mark.parametrize("name,changes,size,match", [
    ("tiny-llama3", {}, 4, "2 KV heads do not split over 4 ranks"),
    ("tiny-qwen3", {}, 3, "2 KV heads do not split over 3 ranks"),
    ("tiny-qwen3-moe", {}, 2, "mixture-of-experts"),
    ("tiny-qwen3", {"intermediate_size": 136}, 2, "136 intermediate rows do not split over 2 ranks"),
    ("tiny-qwen3", {"vocab_size": 272}, 2, "272 vocabulary rows do not split over 2 ranks"),
    ("tiny-qwen3", {}, 0, "at least 1"),
])
def test_a_split_that_is_not_whole_is_refused(name, changes, size, match):
    spec = get_preset(name).with_(**changes)
    with pytest.raises(ValueError, match=match):
        build_program(spec, StepShape((1,)), 7, config(spec, tp=(0, size)))


def test_a_rank_out_of_range_is_refused():
    spec = get_preset("tiny-qwen3")
    with pytest.raises(ValueError, match=r"rank 2 is not in \[0, 2\)"):
        build_program(spec, StepShape((1,)), 7, config(spec, tp=(2, 2)))


def test_the_weight_shards_have_the_shard_shapes_and_put_the_model_back_together():
    spec = get_preset("tiny-qwen2").with_(num_kv_heads=2)  # biases; two GQA groups of two query heads
    w = random_weights(spec, seed=3)
    shards = [shard_weights(w, TensorParallel(spec, r, 2, 16)) for r in range(2)]
    sub = shard_spec(spec, 2, 16)
    for s in shards:
        assert s.spec == sub and s.embed is w.embed and s.lm_head.shape == (spec.vocab_size // 2, spec.hidden_size)
        for l, lw in enumerate(s.layers):
            assert {k: tuple(t.shape) for k, t in lw.tensors().items()} == expected_layer_shapes(sub, l)
    for l, lw in enumerate(w.layers):
        parts = [s.layers[l] for s in shards]
        for name, dim in (("wq", 0), ("wk", 0), ("wv", 0), ("bq", 0), ("bk", 0), ("bv", 0), ("wo", 1),
                          ("w_gate", 0), ("w_up", 0), ("w_down", 1)):
            assert torch.equal(torch.cat([getattr(p, name) for p in parts], dim), getattr(lw, name)), name
    assert torch.equal(torch.cat([s.lm_head for s in shards]), w.lm_head)


@pytest.mark.parametrize("size", [2, 4])
def test_a_ranks_launch_plan_is_its_shards_kernel_with_the_same_words_on_every_rank(size):
    from mimw.megakernel.plan import plan

    spec = get_preset("llama-3.1-8b")
    plans = [plan(spec, 132 // size, StepShape((1,) * 8), tp=(r, size)) for r in range(size)]
    shard = shard_spec(spec, size)
    for p in plans:
        c = p.constants
        assert p.spec == shard and c.TP == size
        assert (c.HQ, c.HKV, c.I, c.V, c.D) == (shard.num_heads, shard.num_kv_heads, shard.intermediate_size,
                                                 shard.vocab_size, spec.hidden_size)
        assert p.program.config.tp[1] == size
        assert any(i.OP == isa.Op.REDUCE for i in p.program.instructions())  # REDUCE has device code now
    assert all(torch.equal(p.words, plans[0].words) and p.constants == plans[0].constants for p in plans)
    one = plan(spec, 132, StepShape((1,) * 8))  # (0, 1): the one-GPU plan
    assert one.constants.TP == 1 and one.spec == spec
    assert torch.equal(one.words, plan(spec, 132, StepShape((1,) * 8), tp=(0, 1)).words)


def test_the_device_inbox_layout_is_the_vms():
    """device/peer.py addresses a rank's inboxes at the offsets and widths of peers.inbox_views."""
    from mimw.megakernel.device import peer
    from mimw.megakernel.launch.tp import inbox_shape
    from mimw.megakernel.peers import alloc_peer_memory
    from mimw.megakernel.plan import plan

    for size, m in ((2, 1), (4, 8)):
        c = plan(get_preset("llama-3.2-1b"), 132 // size, StepShape((1,) * m), tp=(0, size)).constants
        mem = alloc_peer_memory(*inbox_shape(c))
        base = mem.buffers[0].data_ptr()
        for kind in (O_SUM, DOWN_SUM, LM_GATHER):
            box = mem.inbox[0][kind]
            assert (box.data_ptr() - base) // 4 == peer.box_offset(kind, c)
            assert box.shape == (size, m, peer.box_width(kind, c)) and box.is_contiguous()
        assert mem.buffers[0].numel() == sum(b.numel() for b in mem.inbox[0])


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_placing_every_ranks_cache_shard_rebuilds_the_cache(kv):
    """tensor_parallel.place_shard inverts shard_cache: every rank's heads (an fp8 cache's scales too) back in place."""
    from mimw.kv import fp8
    from mimw.kv.pages import KVLayout, PagedKVCache
    from mimw.megakernel.tensor_parallel import place_shard, shard_cache

    spec = get_preset("llama-3.2-1b").with_(num_layers=2)
    dtype = fp8.FP8 if kv == "fp8" else torch.bfloat16
    cache = PagedKVCache(KVLayout.for_spec(spec, 16, 3, dtype))
    for t in cache.page_tensors():
        t.copy_(torch.randint(0, 120, t.shape, dtype=torch.uint8).view(t.dtype) if t.dtype == torch.uint8
                else torch.randn(t.shape).to(t.dtype))
    rebuilt = PagedKVCache(cache.layout)
    for r in range(4):
        tp = TensorParallel(spec, r, 4)
        shard = shard_cache(cache, tp)
        assert shard.k.shape[2] == spec.num_kv_heads // 4
        place_shard(rebuilt, shard.page_tensors(), tp)
    assert all(torch.equal(a, b) for a, b in zip(rebuilt.page_tensors(), cache.page_tensors()))
