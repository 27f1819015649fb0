"""The tensor-parallel VM proves the rank programs: N emulated ranks, each running its own program over its own
weight and KV shards, compute the reference decoder's logits in every interleaving the counters allow, and every
rank's logits and residual stream are bit-identical (to each other, and from one interleaving or launch to the
next).

Each case prefills a context with the reference decoder (``ReferenceDecoder``, one GPU's numerics, fp32 weights),
then runs its consecutive steps through ``TPDecoder`` several times over (the same steps launched again: the same
K/V re-stored), without resetting any counter, each time under another interleaving across every rank's SMs (the
first: lowest ready first; then random), every rank launching its next step as soon as its own ended, and diffs
every rank's logits against the reference (max|a - b| / max|b| <= 1e-5). The cases cover N = 2 and 4, one token,
a decode batch of three and a verify block, and the DOWN_PROJ variants whose partial leaves from a finisher
(cluster pairs, ticketed column parts). Presets whose KV heads do not divide by 4 run at N = 4 as variants with more
KV heads.
"""
from __future__ import annotations

import dataclasses
import functools
import random

import pytest
import torch

from mimw.kv.pages import KVLayout, PagedKVCache
from mimw.megakernel import isa
from mimw.megakernel.ops import CLASSES
from mimw.megakernel.peers import DOWN_SUM, LM_GATHER, O_SUM, PeerView
from mimw.megakernel.plan import Tuning
from mimw.megakernel.program import StepShape, build_program
from mimw.megakernel.readiness import DependencyError, InboxVersions
from mimw.megakernel.tensor_parallel import TensorParallel, shard_cache, shard_weights
from mimw.megakernel.tp_vm import TPVM, TPDecoder
from mimw.megakernel.state import alloc_scratch, alloc_state
from mimw.megakernel.vm import DeadlockError, VMDecoder
from mimw.models.reference import ReferenceDecoder, Segment
from mimw.models.spec import get_preset
from mimw.models.weights import random_weights

from vm_helpers import prefill, rel_err

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/megakernel/conftest.py

STEPS, INTERLEAVINGS = 3, 5

VARIANTS = {
    "tiny-qwen3-kv4": get_preset("tiny-qwen3").with_(num_kv_heads=4),  # 8 query heads in 4 groups: N = 4
    "tiny-qwen2-kv2": get_preset("tiny-qwen2").with_(num_kv_heads=2),  # biases; 160 intermediate rows, 80 a rank
    "tiny-llama3-hd64": get_preset("tiny-llama3").with_(head_dim=64),  # [32, 256] tiles: the GPU plan's shapes
}


@functools.lru_cache(maxsize=None)
def model(name: str):
    spec = VARIANTS.get(name) or get_preset(name)
    return spec, random_weights(spec, seed=1)


def config(spec, **overrides):
    return dataclasses.replace(Tuning().resolve(spec).program_config(), **overrides)


def prefilled(name: str, page_size: int, contexts: tuple[int, ...], new_tokens: int, seed: int):
    """``vm_helpers.prefill`` for the preset ``name`` (this file's ``model``)."""
    return prefill(*model(name), page_size, contexts, new_tokens, seed)


CASES = [  # (model, ranks, SMs a rank, page size, seg_lens, contexts, config overrides, what the case exercises)
    ("tiny-llama3", 2, 7, 16, (1,), (14,), {}, ""),
    ("tiny-llama3", 2, 132, 64, (1, 1, 1), (14, 63, 3), {}, "batch"),
    ("tiny-qwen3", 2, 1, 16, (4,), (30,), {}, "verify block, one SM a rank"),
    ("tiny-qwen3-kv4", 4, 7, 16, (1,), (20,), {}, ""),
    ("tiny-qwen3-kv4", 4, 132, 16, (1, 1, 1), (5, 33, 17), {}, "batch"),
    ("tiny-qwen2-kv2", 2, 8, 16, (1, 1, 1), (9, 40, 16), {"tile_k": 16}, "pairs"),  # DOWN_PROJ halves' finisher
    ("tiny-llama3", 2, 7, 16, (1, 1), (21, 2),
     {"tile_k": 16, "clusters": False, "down_parts": 2, "qkv_parts": 3}, "tickets"),  # ticketed DOWN_PROJ parts
]


@pytest.mark.parametrize("name,size,num_sms,page_size,seg_lens,contexts,overrides,what", CASES,
                         ids=[f"{c[0]}-N{c[1]}-sm{c[2]}-M{'x'.join(map(str, c[4]))}{'-' + c[7] if c[7] else ''}"
                              for c in CASES])
def test_rank_programs_match_the_reference_over_interleavings(name, size, num_sms, page_size, seg_lens, contexts,
                                                              overrides, what):
    spec, w, ref, ref_cache, cache, tables, g = prefilled(name, page_size, contexts, STEPS * max(seg_lens), 7)
    dec = TPDecoder(spec, w, cache, size, num_sms, StepShape(seg_lens), config(spec, **overrides))
    p = dec.programs[0]
    assert (p.down_pairs, p.down_parts > 1) == {"pairs": (True, True), "tickets": (False, True)}.get(what,
                                                                                                    (False, False))
    words = [q.encode() for q in dec.programs]  # every rank runs the same words
    assert all(torch.equal(a, b) for wl in words[1:] for a, b in zip(wl, words[0]))
    starts, inputs, wants = list(contexts), [], []
    for step in range(STEPS):
        tokens = torch.randint(0, spec.vocab_size, (sum(seg_lens),), generator=g)
        wants.append(ref.forward(tokens, [Segment(t, p0, n) for t, p0, n in zip(tables, starts, seg_lens)],
                                 ref_cache))
        inputs.append((tokens.tolist(), starts, tables))
        starts = [p0 + n for p0, n in zip(starts, seg_lens)]
    first, runs, lead = None, 0, 0
    for rep in range(INTERLEAVINGS):
        got = dec.steps(inputs, None if rep == 0 else random.Random(rep))
        runs, lead = runs + STEPS, max(lead, dec.lead)
        first = first or got
        for step, want in enumerate(wants):
            err = rel_err(got[step][0], want)
            assert err <= 1e-5, f"step {step}, interleaving {rep}: {err:.2e}"
            for r in range(size):  # bit-identical on every rank, in every interleaving
                assert torch.equal(got[step][r], first[step][0]), f"step {step}, interleaving {rep}, rank {r}"
        assert all(torch.equal(sc.x, dec.scratches[0].x) for sc in dec.scratches)
    assert lead == 1  # a rank ran its next step while a peer was still in the last one, and never further ahead
    # every rank stored its own heads' K/V: together, the reference cache
    for r, c in enumerate(dec.caches):
        want_k = shard_cache(ref_cache, TensorParallel(spec, r, size, p.config.tile_rows))
        assert rel_err(c.k, want_k.k) <= 1e-5 and rel_err(c.v, want_k.v) <= 1e-5
    # no counter was ever reset, the peer counters included: each sits at its per-step count times the steps run
    for st, prog in zip(dec.states, dec.programs):
        c = st.counters.tolist()
        assert c[-1] == runs and c[-2] == runs * num_sms
        n = len(prog.counters)  # then the padding (state.counter_slots), never signalled
        assert c[:n] == [runs * k.count for k in prog.counters] and not any(c[n:-2])
        assert any(k.peer for k in prog.counters)


@pytest.mark.slow
def test_the_8b_shape_matches_the_reference_at_2_and_4_ranks():
    """One layer of Llama 3.1 8B at its real shape (vocabulary cut to 2,048 rows: CPU memory), 132 SMs a rank."""
    spec = get_preset("llama-3.1-8b").with_(num_layers=1, vocab_size=2048)
    w = random_weights(spec, seed=1)
    layout = KVLayout.for_spec(spec, 16, 4, torch.float32)
    ref, ref_cache = ReferenceDecoder(w), PagedKVCache(layout)
    table, g = (2, 0, 3), torch.Generator().manual_seed(0)
    ref.forward(torch.randint(0, spec.vocab_size, (20,), generator=g), [Segment(table, 0, 20)], ref_cache)
    tokens = torch.randint(0, spec.vocab_size, (1,), generator=g)
    cache = PagedKVCache(layout)
    cache.k.copy_(ref_cache.k)
    cache.v.copy_(ref_cache.v)
    want = ref.forward(tokens, [Segment(table, 20, 1)], ref_cache)
    for size in (2, 4):
        dec = TPDecoder(spec, w, cache, size, 132, StepShape((1,)))
        got = dec.steps([(tokens.tolist(), [20], [table])] * 2, random.Random(size))  # the step launched twice
        assert rel_err(got[0][0], want) <= 1e-5
        assert all(torch.equal(x, got[0][0]) for step in got for x in step)


# --- the checks catch broken programs --------------------------------------------------------------------------

def _setup(size=2, name="tiny-llama3", num_sms=7, seg_lens=(1, 1), contexts=(40, 21)):
    spec, w, _, _, cache, tables, g = prefilled(name, 16, contexts, 1, 5)
    cfg = config(spec)
    progs = [build_program(spec, StepShape(seg_lens), num_sms, dataclasses.replace(cfg, tp=(r, size)))
             for r in range(size)]
    tps = [TensorParallel(spec, r, size, cfg.tile_rows) for r in range(size)]
    tokens = torch.randint(0, spec.vocab_size, (sum(seg_lens),), generator=g).tolist()
    fill = (tokens, contexts, tables, seg_lens)
    return progs, [shard_weights(w, tp) for tp in tps], [shard_cache(cache, tp) for tp in tps], fill


def _run(progs, weights, caches, fill, words, rng, steps=1):
    """``steps`` launches of the step on fresh state (a failed step leaves the counters mid-step)."""
    vm = TPVM(progs, weights, caches, words)
    states = [alloc_state(p, caches[0].layout.num_pages) for p in progs]
    return vm.run_steps(states, [alloc_scratch(p) for p in progs], vm.alloc_peer_memory(), [fill] * steps, rng)


def _edit(progs, rank, pred, word, value):
    """Every rank's words, with ``word`` of rank ``rank``'s first instruction matching ``pred`` set to ``value``."""
    words = [p.encode() for p in progs]
    w, n = words[rank]
    for s in range(w.shape[0]):
        for i in range(int(n[s])):
            if pred(isa.decode(w[s, i].tolist(), CLASSES)):
                w[s, i, word] = value
                return words
    raise AssertionError("no such instruction")


REMOVALS = [  # the REDUCE whose wait for the peers' partials is removed, on rank 1
    ("o", lambda i: i.OP == isa.Op.REDUCE and i.kind == O_SUM and i.layer == 1),
    ("down", lambda i: i.OP == isa.Op.REDUCE and i.kind == DOWN_SUM and i.layer == 0),
    ("lm", lambda i: i.OP == isa.Op.REDUCE and i.kind == LM_GATHER),
]


@pytest.mark.parametrize("kind,pred", REMOVALS, ids=[r[0] for r in REMOVALS])
def test_a_removed_cross_rank_wait_is_caught_by_some_interleaving(kind, pred):
    progs, weights, caches, fill = _setup()
    words = _edit(progs, 1, pred, isa.Word.WAIT, isa.NO_COUNTER)  # it runs as soon as it reaches its queue head
    for seed in range(30):
        try:
            _run(progs, weights, caches, fill, words, random.Random(seed))
        except DependencyError as e:
            assert f"reads the {kind} inbox" in str(e)  # caught by the inbox's readiness, not by a counter
            return
    pytest.fail(f"a {kind} REDUCE without its wait went unnoticed in 30 interleavings")


def test_the_intact_rank_programs_pass_the_same_interleavings():
    progs, weights, caches, fill = _setup()
    for seed in range(30):
        _run(progs, weights, caches, fill, None, random.Random(seed))
    assert _run(progs, weights, caches, fill, None, None, steps=3).lead == 1


def test_a_partial_that_signals_no_peer_is_a_deadlock_naming_the_peer_counter():
    progs, weights, caches, fill = _setup()
    words = _edit(progs, 0, lambda i: i.OP == isa.Op.O_PROJ and i.layer == 1, isa.Word.SIGNAL, isa.NO_COUNTER)
    with pytest.raises(DeadlockError, match=r"(?s)rank 1 \(step 0\): .*L1\.o_peer\.r\d+\) to reach 2, it is 1"):
        _run(progs, weights, caches, fill, words, random.Random(0))


def test_inbox_versions_catch_an_unread_overwrite_and_a_read_before_the_store():
    inbox = InboxVersions(2, 8, 4)
    rows = slice(0, 4)
    with pytest.raises(DependencyError, match=r"reads the o inbox's slots of ranks \[0, 1\] at never"):
        inbox.check_read("REDUCE", 0, O_SUM, rows, 0, 0)
    inbox.check_store("O_PROJ", 1, O_SUM, rows)
    inbox.stored(1, O_SUM, rows, 0, 0)
    inbox.stored(0, O_SUM, rows, 0, 0)
    with pytest.raises(DependencyError, match="overwrites rank 0's o inbox \\(step 0 layer 0\\)"):
        inbox.check_store("O_PROJ", 1, O_SUM, rows)  # the next partial while this one is unread
    inbox.check_read("REDUCE", 0, O_SUM, rows, 0, 0)
    with pytest.raises(DependencyError, match="overwrites rank 1's o inbox"):
        inbox.check_store("O_PROJ", 1, O_SUM, rows)  # read on rank 0, not yet on rank 1
    inbox.check_read("REDUCE", 1, O_SUM, rows, 0, 0)
    inbox.check_store("O_PROJ", 1, O_SUM, rows)  # read everywhere: free
    inbox.stored(1, O_SUM, rows, 1, 0)  # the next step's layer 0 on rank 1 only
    with pytest.raises(DependencyError, match=r"slots of ranks \[0\] at step 0 layer 0, needs step 1 layer 0"):
        inbox.check_read("REDUCE", 1, O_SUM, rows, 1, 0)  # rank 0's partial is the last step's


def test_the_vm_refuses_rank_programs_out_of_order_and_the_one_gpu_decoder_refuses_a_rank():
    progs, weights, caches, _ = _setup()
    with pytest.raises(ValueError, match="in order"):
        TPVM(progs[::-1], weights, caches)
    spec, w = model("tiny-llama3")
    with pytest.raises(ValueError, match="runs on N ranks"):
        VMDecoder(spec, w, caches[0], 7, StepShape((1,)), config(spec, tp=(0, 2)))


def test_one_inbox_for_both_sums_is_caught_overwriting_unread_partials(monkeypatch):
    """Why O_SUM and DOWN_SUM are separate inboxes (peers.py): were DOWN_PROJ's partials stored where O_PROJ's are,
    a rank running ahead would overwrite a peer's O_PROJ partials before the peer's REDUCE read them."""
    one = lambda kind: O_SUM if kind == DOWN_SUM else kind  # noqa: E731
    send, inbox = PeerView.send, PeerView.inbox
    store, stored, read = InboxVersions.check_store, InboxVersions.stored, InboxVersions.check_read
    monkeypatch.setattr(PeerView, "send", lambda self, kind, rows, value: send(self, one(kind), rows, value))
    monkeypatch.setattr(PeerView, "inbox", lambda self, kind: inbox(self, one(kind)))
    monkeypatch.setattr(InboxVersions, "check_store", lambda self, w, src, kind, rows: store(self, w, src, one(kind),
                                                                                              rows))
    monkeypatch.setattr(InboxVersions, "stored", lambda self, src, kind, *a: stored(self, src, one(kind), *a))
    monkeypatch.setattr(InboxVersions, "check_read", lambda self, w, dst, kind, *a: read(self, w, dst, one(kind), *a))
    progs, weights, caches, fill = _setup()
    for seed in range(30):
        try:
            _run(progs, weights, caches, fill, None, random.Random(seed))
        except DependencyError as e:
            assert "overwrites" in str(e)
            return
    pytest.fail("one inbox for both sums went unnoticed in 30 interleavings")


@pytest.mark.parametrize("seg_lens", [(1,), (1, 1, 1)])
def test_the_launch_plans_words_are_the_proved_programs(seg_lens):
    """``plan.plan(..., tp=(rank, N))`` (what a rank's GPU kernel runs: launch/tp.py) encodes, hold marks aside, the
    words of the rank programs proved above; the VM runs the plans' words (marks included) to the reference."""
    from mimw.megakernel.plan import plan

    size, num_sms, contexts = 2, 7, (14, 30, 5)[:len(seg_lens)]
    spec, w, ref, ref_cache, cache, tables, g = prefilled("tiny-llama3-hd64", 16, contexts, 1, 11)
    plans = [plan(spec, num_sms, StepShape(seg_lens), 16, tp=(r, size)) for r in range(size)]
    progs = [p.program for p in plans]
    for r, (p, prog) in enumerate(zip(plans, progs)):
        assert prog.config.tp == (r, size) and p.constants.TP == size
        words, _ = prog.encode()
        unmarked = p.words.clone()
        unmarked[..., isa.Word.FLAGS] &= ~(isa.HOLD_ARRIVE | isa.HOLD_WAIT)
        assert torch.equal(unmarked, words)
    tps = [TensorParallel(spec, r, size, progs[0].config.tile_rows) for r in range(size)]
    tokens = torch.randint(0, spec.vocab_size, (len(seg_lens),), generator=g)
    want = ref.forward(tokens, [Segment(t, c, 1) for t, c in zip(tables, contexts)], ref_cache)
    vm = TPVM(progs, [shard_weights(w, tp) for tp in tps], [shard_cache(cache, tp) for tp in tps],
              [(p.words, p.lens) for p in plans])
    states = [alloc_state(p, cache.layout.num_pages) for p in progs]
    run = vm.run_steps(states, [alloc_scratch(p) for p in progs], vm.alloc_peer_memory(),
                       [(tokens.tolist(), list(contexts), tables, seg_lens)], random.Random(3))
    for r in range(size):
        assert rel_err(run.logits[0][r], want) <= 1e-5
