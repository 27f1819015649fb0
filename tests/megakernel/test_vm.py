"""The VM proves the program: every interleaving the counters allow computes the reference decoder's logits.

Each case plans one program (model preset x SM count x step shape), prefills a context with the reference decoder,
then runs several consecutive steps through ``VMDecoder`` without resetting the counters (so every step waits on
step-numbered targets), each step under several random interleavings, and diffs the logits against
``ReferenceDecoder`` (fp32: max|a - b| / max|b| <= 1e-5). Unless a test says otherwise the programs are the ones
the GPU kernel runs for the shape (plan.Tuning's defaults: ``shipping``). Block tables are shuffled page ids and the contexts cross
page boundaries during the steps. The cases are a covering selection, not the full product, so that the file
runs in well under two minutes on two CPU cores: every preset meets M = 1, a verify block StepShape((4,)) and a
batch StepShape((1, 1, 1, 1)); SM counts 1, 7, 132 and page sizes 16, 64 are spread over them. SmolLM2-135M runs
at its real shape but with 2 of its 30 layers (random weights) to keep CPU time low; with 7 SMs its matvecs split
into ~3,200 one-tile instructions, so it runs at 1 and 132 SMs only. Qwen3-MoE programs (tiny-qwen3-moe: 16
experts, 4 per token, layer 1 dense; variants without renormalisation and with 12 experts, whose router the tile
array pads, and with one expert per token) run the same way: at M = 1 every routing slot holds an expert, in a batch
some stay idle.
"""
from __future__ import annotations

import dataclasses
import functools
import random

import pytest
import torch

from mimw.kv import fp8
from mimw.kv.pages import KVLayout, PagedKVCache
from mimw.megakernel import isa
from mimw.megakernel.ops import CLASSES
from mimw.megakernel.ops.attn_in import AttnIn
from mimw.megakernel.launch.one_token import split_segments
from mimw.megakernel.ops.attn_partial import AttnPartial
from mimw.megakernel.plan import MIN_QUERY_BLOCK, Tuning, plan
from mimw.megakernel.program import ProgramConfig, StepShape, build_program, cluster_mate_errors
from mimw.megakernel.state import alloc_scratch, alloc_state
from mimw.megakernel.vm import VM, DeadlockError, DependencyError, VMDecoder, i32
from mimw.models.reference import ReferenceDecoder, Segment
from mimw.models.spec import get_preset
from mimw.models.weights import random_weights

from vm_helpers import prefill, rel_err

STEPS, INTERLEAVINGS_PER_STEP = 4, 5  # 20 random interleavings per case, over 4 consecutive steps


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/megakernel/conftest.py


MOE_VARIANTS = {  # MoE specs that are no preset, by name
    "moe-nonorm-e12": get_preset("tiny-qwen3-moe").with_(norm_topk_prob=False, num_experts=12, dense_layers=()),
    "moe-top1": get_preset("tiny-qwen3-moe").with_(num_experts_per_tok=1, dense_layers=(0,)),
    "moe-e32": get_preset("tiny-qwen3-moe").with_(num_experts=32),  # a router of two row tiles
    # SmolLM2's shape with an intermediate size whose staged act (33 column tiles of 8 tokens) does not fit beside
    # the ring: a decode batch's plan splits its DOWN_PROJ into ticketed column parts
    "smollm2-wide": get_preset("smollm2-135m").with_(num_layers=1, intermediate_size=8448),
}


@functools.lru_cache(maxsize=None)
def model(name: str):
    spec = MOE_VARIANTS.get(name) or get_preset(name)
    if name == "smollm2-135m":
        spec = spec.with_(num_layers=2)  # the real shape, fewer layers: CPU time
    return spec, random_weights(spec, seed=1)


def prefilled(name: str, page_size: int, contexts: tuple[int, ...], new_tokens: int, seed: int,
              kv_dtype: torch.dtype = torch.float32):
    """``vm_helpers.prefill`` for the preset ``name`` (this file's ``model``)."""
    return prefill(*model(name), page_size, contexts, new_tokens, seed, kv_dtype)


CASES = [  # (preset, num_sms, page_size, seg_lens, contexts before the first step)
    ("tiny-llama", 1, 16, (1,), (14,)),
    ("tiny-llama", 7, 64, (4,), (62,)),
    ("tiny-llama", 132, 16, (1, 1, 1, 1), (14, 31, 3, 47)),
    ("tiny-qwen2", 7, 16, (1,), (15,)),
    ("tiny-qwen2", 132, 64, (4,), (126,)),
    ("tiny-qwen2", 1, 64, (1, 1, 1, 1), (62, 127, 5, 64)),
    ("tiny-qwen3", 132, 64, (1,), (63,)),
    ("tiny-qwen3", 1, 16, (4,), (30,)),
    ("tiny-qwen3", 7, 16, (1, 1, 1, 1), (13, 16, 33, 2)),
    ("tiny-llama3", 7, 16, (4,), (45,)),
    ("smollm2-135m", 132, 64, (1, 1, 1, 1), (62, 1, 127, 30)),
    ("smollm2-135m", 132, 16, (4,), (14,)),
    ("smollm2-135m", 1, 16, (1,), (31,)),
    ("tiny-qwen3-moe", 1, 16, (1,), (14,)),
    ("tiny-qwen3-moe", 7, 64, (4,), (62,)),
    ("tiny-qwen3-moe", 132, 16, (1, 1, 1, 1), (14, 31, 3, 47)),
    ("moe-nonorm-e12", 7, 16, (1, 1), (5, 20)),
    ("moe-top1", 132, 64, (1,), (63,)),
]


def shipping(spec, **overrides) -> ProgramConfig:
    """The program config the GPU kernel runs for ``spec`` (plan.Tuning's defaults), with ``overrides``."""
    return dataclasses.replace(Tuning().resolve(spec).program_config(), **overrides)


def decode(words):
    return isa.decode(words, CLASSES)


@pytest.mark.parametrize("name,num_sms,page_size,seg_lens,contexts", CASES,
                         ids=[f"{c[0]}-sm{c[1]}-ps{c[2]}-M{'x'.join(map(str, c[3]))}" for c in CASES])
def test_vm_matches_reference_over_random_interleavings(name, num_sms, page_size, seg_lens, contexts):
    _vm_against_reference(name, num_sms, page_size, seg_lens, contexts)


TICKET_CASES = [  # ATTN_IN split in column parts with tickets: (preset, num_sms, seg_lens, contexts, parts)
    ("tiny-llama", 7, (1,), (14,), 3),
    ("tiny-qwen3", 132, (4,), (30,), 4),  # q/k norms in the finisher; every part on its own SM
    ("tiny-qwen2", 1, (1, 1), (5, 20), 2),  # one SM: the parts run back to back, the last one finishes
]


@pytest.mark.parametrize("name,num_sms,seg_lens,contexts,parts", TICKET_CASES)
def test_vm_with_attn_in_column_parts_matches_reference(name, num_sms, seg_lens, contexts, parts):
    spec, _ = model(name)
    prog = _vm_against_reference(name, num_sms, 16, seg_lens, contexts,
                                 shipping(spec, tile_k=16, qkv_parts=parts, clusters=False))
    assert prog.qkv_parts == parts
    assert sum(1 for c in prog.counters if ".qkv_ticket." in c.name) == prog.spec.num_layers * (
        prog.spec.num_heads + 2 * prog.spec.num_kv_heads)


def test_the_splits_combine_themselves_behind_a_ticket():
    spec = get_preset("tiny-llama")
    prog = build_program(spec, StepShape((1, 1)), 132, shipping(spec))
    parts = [i for i in prog.instructions() if i.OP == isa.Op.ATTN_PARTIAL]
    for layer in range(spec.num_layers):  # every split of a layer signals the layer's attention-output counter
        assert len({i.signal for i in parts if i.layer == layer}) == 1
    assert all((i.ticket == isa.NO_COUNTER) == (i.n_splits == 1) for i in parts)
    assert max(i.n_splits for i in parts) > 1  # the case exercises tickets
    # nobody waits for the logits inside a step: LM_HEAD signals no counter
    assert all(i.signal == isa.NO_COUNTER for i in prog.instructions() if i.OP == isa.Op.LM_HEAD)


def _vm_against_reference(name, num_sms, page_size, seg_lens, contexts, config=None):
    spec, w, ref, ref_cache, vm_cache, tables, g = prefilled(name, page_size, contexts, STEPS * max(seg_lens), 7)
    dec = VMDecoder(spec, w, vm_cache, num_sms, StepShape(seg_lens), config)
    # one SM has exactly one interleaving: run it once per step instead of five times
    reps = INTERLEAVINGS_PER_STEP if num_sms > 1 else 1
    starts, runs = list(contexts), 0
    for step in range(STEPS):
        tokens = torch.randint(0, spec.vocab_size, (sum(seg_lens),), generator=g)
        want = ref.forward(tokens, [Segment(t, p, n) for t, p, n in zip(tables, starts, seg_lens)], ref_cache)
        for rep in range(reps):
            rng = random.Random(1000 * step + rep)
            got = dec.step(tokens.tolist(), starts, tables, rng)
            runs += 1
            assert rel_err(got, want) <= 1e-5, f"step {step}, interleaving {rep}: {rel_err(got, want):.2e}"
        starts = [p + n for p, n in zip(starts, seg_lens)]
    # every step re-stored the same K/V: the VM's cache equals the reference's
    assert rel_err(vm_cache.k, ref_cache.k) <= 1e-5 and rel_err(vm_cache.v, ref_cache.v) <= 1e-5
    # counters were never reset: each sits at its per-step count times the steps run
    c = dec.state.counters.tolist()
    assert c[-1] == runs and c[-2] == runs * num_sms
    n = len(dec.program.counters)  # then the padding (state.counter_slots), never signalled
    assert c[:n] == [runs * k.count for k in dec.program.counters] and not any(c[n:-2])
    return dec.program


def test_deterministic_order_matches_reference_and_random_interleavings():
    spec, w, ref, ref_cache, vm_cache, tables, g = prefilled("tiny-qwen3", 16, (20, 9), 1, 3)
    dec = VMDecoder(spec, w, vm_cache, 7, StepShape((1, 1)))
    tokens = torch.randint(0, spec.vocab_size, (2,), generator=g)
    want = ref.forward(tokens, [Segment(t, p, 1) for t, p in zip(tables, (20, 9))], ref_cache)
    first = dec.step(tokens.tolist(), [20, 9], tables)  # no rng: lowest-numbered ready SM first
    assert rel_err(first, want) <= 1e-5
    for seed in range(3):
        assert torch.equal(dec.step(tokens.tolist(), [20, 9], tables, random.Random(seed)), first)


# --- the checks catch broken programs --------------------------------------------------------------------------

def _setup(name="tiny-qwen3", num_sms=7, seg_lens=(1, 1), contexts=(40, 21), config=None):
    spec, w, _, _, vm_cache, tables, g = prefilled(name, 16, contexts, 1, 5)
    prog = build_program(spec, StepShape(seg_lens), num_sms, config or shipping(spec))
    state, scratch = alloc_state(prog, vm_cache.layout.num_pages), alloc_scratch(prog)
    tokens = torch.randint(0, spec.vocab_size, (sum(seg_lens),), generator=g).tolist()
    state.fill(tokens, contexts, tables, seg_lens)
    return prog, w, vm_cache, state, scratch


def _find(prog, words, lengths, op, pred=lambda ins: True):
    """(sm, index) of the first instruction with opcode ``op`` (and ``pred``) that is not first in its queue."""
    for s in range(prog.num_sms):
        for i in range(1, int(lengths[s])):
            ins = decode(words[s, i].tolist())
            if ins.OP == op and pred(ins):
                return s, i
    raise AssertionError(f"no {op.name} instruction found")


REMOVALS = [  # (opcode whose wait is removed, which instruction)
    (isa.Op.ATTN_IN, lambda ins: ins.layer == 1),
    (isa.Op.ATTN_PARTIAL, lambda ins: ins.layer == 1 and ins.split == 0),
    (isa.Op.O_PROJ, lambda ins: ins.layer == 1),
    (isa.Op.MLP_IN, lambda ins: ins.layer == 1),
    (isa.Op.DOWN_PROJ, lambda ins: ins.layer == 1),
    (isa.Op.LM_HEAD, lambda ins: True),
]


@pytest.mark.parametrize("op,pred", REMOVALS, ids=[r[0].name for r in REMOVALS])
def test_a_removed_dependency_is_caught_by_some_random_interleaving(op, pred):
    prog, w, cache, state, scratch = _setup()
    words, lengths = prog.encode()
    s, i = _find(prog, words, lengths, op, pred)
    words[s, i, isa.Word.WAIT] = isa.NO_COUNTER  # the instruction now runs as soon as it reaches its queue head
    vm = VM(prog, w, cache, (words, lengths))
    for seed in range(20):
        try:
            vm.run_step(state, scratch, random.Random(seed))
        except DependencyError as e:
            assert "reads" in str(e)  # caught by the data-readiness check, not by a counter
            return
    pytest.fail(f"removing the wait of {decode(words[s, i].tolist())} went unnoticed in 20 interleavings")


def _dependency_errors(vm, prog, cache, fill, seeds):
    """The DependencyError message of every random interleaving (seeds 0..seeds-1) that raises one; a fresh step
    each time: a failed step leaves the counters mid-step. ``fill``: StepState.fill's arguments."""
    for seed in range(seeds):
        state, scratch = alloc_state(prog, cache.layout.num_pages), alloc_scratch(prog)
        state.fill(*fill)
        try:
            vm.run_step(state, scratch, random.Random(seed))
        except DependencyError as e:
            yield str(e)


def _query_block_setup(num_sms=7):
    """A query block of three one-token segments of one sequence (context 40) beside a decode token (context 21)."""
    spec, w, _, _, cache, tables, g = prefilled("tiny-qwen3", 16, (40, 21), 4, 5)
    prog = build_program(spec, StepShape((1,) * 4, 64, (3, 1)), num_sms, shipping(spec))
    tokens = torch.randint(0, spec.vocab_size, (4,), generator=g).tolist()
    fill = (tokens, [40, 41, 42, 21], [tables[0]] * 3 + [tables[1]], (1,) * 4, [40, 40, 40, 21])
    return prog, w, cache, fill


def test_a_query_block_split_without_its_wait_is_caught_reading_the_blocks_own_rows():
    prog, w, cache, fill = _query_block_setup()
    words, lengths = prog.encode()
    s, i = _find(prog, words, lengths, isa.Op.ATTN_PARTIAL,
                 lambda ins: ins.layer == 1 and ins.tokens == 3 and ins.split == ins.n_splits - 1)
    words[s, i, isa.Word.WAIT] = isa.NO_COUNTER
    errors = list(_dependency_errors(VM(prog, w, cache, (words, lengths)), prog, cache, fill, 20))
    assert errors and all("reads" in e for e in errors)


def test_a_query_block_whose_segments_are_not_one_sequence_is_refused():
    prog, w, cache, (tokens, positions, tables, lens, firsts) = _query_block_setup()
    vm = VM(prog, w, cache)
    state, scratch = alloc_state(prog, cache.layout.num_pages), alloc_scratch(prog)
    state.fill(tokens, [40, 41, 43, 21], tables, lens, [40, 40, 40, 21])  # a gap in the block's positions
    with pytest.raises(ValueError, match="not one sequence"):
        vm.run_step(state, scratch, random.Random(0))


def test_a_part_that_skips_its_ticket_is_caught_finishing_before_the_other_parts():
    spec, w, _, _, cache, tables, g = prefilled("tiny-llama", 16, (14,), 4, 7)
    prog = build_program(spec, StepShape((1,)), 7, shipping(spec, tile_k=16, qkv_parts=3, clusters=False))
    words, lengths = prog.encode()
    s, i = _find(prog, words, lengths, isa.Op.ATTN_IN, lambda ins: ins.layer == 1 and ins.part == 0)
    words[s, i, isa.Word.D] = isa.NO_COUNTER  # part 0 now believes it is alone: it finishes the head at once
    vm = VM(prog, w, cache, (words, lengths))
    for e in _dependency_errors(vm, prog, cache, ([3], [14], tables, (1,)), 20):
        if "qkv parts" in e:  # caught by data readiness: it summed parts not yet written
            return
        assert "counters off" in e  # it finished last: its missing ticket leaves the ticket short
    pytest.fail("a part finishing without its ticket went unnoticed in 20 interleavings")


def test_a_split_that_skips_its_ticket_is_caught_combining_before_the_other_splits():
    spec, w, _, _, cache, tables, g = prefilled("tiny-qwen3", 16, (40, 21), 1, 5)
    prog = build_program(spec, StepShape((1, 1)), 132, shipping(spec))  # several splits per segment
    words, lengths = prog.encode()
    s, i = _find(prog, words, lengths, isa.Op.ATTN_PARTIAL,
                 lambda ins: ins.layer == 1 and ins.split == 0 and ins.n_splits > 1)
    words[s, i, isa.Word.E] = isa.NO_COUNTER  # split 0 now believes it is alone: it combines at once
    vm = VM(prog, w, cache, (words, lengths))
    for e in _dependency_errors(vm, prog, cache, ([3, 5], [40, 21], tables, (1, 1)), 20):
        if "partials" in e:  # caught by data readiness: it combined partials not yet written
            return
        assert "counters off" in e
    pytest.fail("a split combining without its ticket went unnoticed in 20 interleavings")


def test_the_intact_program_passes_the_same_interleavings():
    prog, w, cache, state, scratch = _setup()
    vm = VM(prog, w, cache)
    for seed in range(20):
        vm.run_step(state, scratch, random.Random(seed))
    assert state.epoch == 20


def test_the_vm_refuses_an_instruction_whose_wait_is_unmet():
    prog, w, cache, state, scratch = _setup()
    run = VM(prog, w, cache).start(state, scratch)

    def blocked():
        return [s for s in range(prog.num_sms) if run.head(s) is not None and not run.counter_met(run.head(s))]

    while not blocked():  # every queue starts with layer 0's ATTN_IN, which waits for nothing
        run.run(run.pick())
    with pytest.raises(DependencyError, match="waits for counter"):
        run.run(blocked()[0])


def test_a_wait_that_can_never_be_met_is_a_deadlock():
    prog, w, cache, state, scratch = _setup()
    words, lengths = prog.encode()
    s, i = _find(prog, words, lengths, isa.Op.LM_HEAD)
    words[s, i, isa.Word.WAIT_COUNT] += 1  # one more signal than the counter gets per step
    with pytest.raises(DeadlockError, match="no queue head may run"):
        VM(prog, w, cache, (words, lengths)).run_step(state, scratch, random.Random(0))


def test_a_missing_signal_is_a_deadlock_naming_the_counter():
    prog, w, cache, state, scratch = _setup()
    words, lengths = prog.encode()
    s, i = _find(prog, words, lengths, isa.Op.MLP_IN, lambda ins: ins.layer == 1)
    words[s, i, isa.Word.SIGNAL] = isa.NO_COUNTER  # layer 1's DOWN_PROJ now waits for a signal that never comes
    with pytest.raises(DeadlockError, match="L1.mlp_in"):
        VM(prog, w, cache, (words, lengths)).run_step(state, scratch)


def test_readiness_catches_a_later_layer_overwriting_what_an_earlier_one_still_reads():
    # write-after-read: layer 1's ATTN_IN stores q head 0 while layer 0's ATTN_PARTIAL has not read it yet
    prog, w, cache, state, scratch = _setup()
    run = VM(prog, w, cache).start(state, scratch)
    part = AttnPartial(layer=0, kv_head=0, seg=0, split=0, n_splits=prog.n_splits[0])
    for h in range(prog.spec.num_heads + 2 * prog.spec.num_kv_heads):
        run.readiness.after_finish(AttnIn(layer=0, head=h))
    run.readiness.before(part)  # layer 0's q and K/V are in place
    run.readiness.after_finish(AttnIn(layer=1, head=0))
    with pytest.raises(DependencyError, match=r"q heads at version \[1\], needs version 0"):
        run.readiness.before(part)


def test_counters_wrap_around_int32_without_a_reset():
    # start at an epoch where the largest per-step count's target crosses 2^31 during the next steps
    spec, w, ref, ref_cache, vm_cache, tables, g = prefilled("tiny-llama", 16, (9,), 3, 11)
    dec = VMDecoder(spec, w, vm_cache, 7, StepShape((1,)))
    pad = dec.state.counters.numel() - 2 - len(dec.program.counters)  # state.counter_slots' unused counters
    counts = [c.count for c in dec.program.counters] + [0] * pad + [dec.program.num_sms]
    epoch = 2**31 // max(i.wait_count for i in dec.program.instructions()) - 1  # a waited target wraps in step 1
    dec.state.counters.copy_(torch.tensor([i32(epoch * n) for n in counts] + [epoch], dtype=torch.int32))
    for step in range(3):
        tokens = torch.randint(0, spec.vocab_size, (1,), generator=g)
        want = ref.forward(tokens, [Segment(tables[0], 9 + step, 1)], ref_cache)
        assert rel_err(dec.step(tokens.tolist(), [9 + step], tables, random.Random(step)), want) <= 1e-5
    assert dec.state.counters.tolist() == [i32((epoch + 3) * n) for n in counts] + [epoch + 3]
    assert min(dec.state.counters.tolist()) < 0  # some counter did wrap


def test_vm_with_fewer_larger_matvec_blocks_matches_reference():
    """The shipping config prices an instruction at its measured fixed cost (96 KB) and caps blocks at 1 MB: fewer,
    larger blocks than a 16 KB / 256 KB model builds; the program still computes the reference."""
    old = dict(fixed_cost_bytes=16 << 10, max_block_bytes=256 << 10)
    spec, _ = model("smollm2-135m")
    prog = _vm_against_reference("smollm2-135m", 4, 16, (1,), (14,))  # the real widths, two layers, cluster pairs
    assert prog.attn_pairs
    small = build_program(prog.spec, StepShape((1,), 14), 4, shipping(spec, **old))
    assert len(list(prog.instructions())) < 0.7 * len(list(small.instructions()))
    llama = get_preset("llama-3.2-1b")
    before = build_program(llama, StepShape((1,), 1024), 132, shipping(llama, **old))
    fewer = build_program(llama, StepShape((1,), 1024), 132, shipping(llama))
    lm = lambda p: [i for i in p.instructions() if i.OP == isa.Op.LM_HEAD]  # noqa: E731
    assert sum(i.nrows for i in lm(fewer)) == llama.vocab_size and len(lm(fewer)) < len(lm(before)) // 2


CLUSTER_CASES = [  # (preset, num_sms, seg_lens, contexts), 16-column tiles so that the tiny rows split in two
    ("tiny-llama", 132, (1,), (14,)),  # every head on its own cluster
    ("tiny-qwen3", 8, (4,), (30,)),  # q/k norms in part 0's finish; several pairs a layer on each cluster
    ("tiny-qwen2", 2, (1, 1), (5, 20)),  # one cluster: every pair on SMs 0 and 1, back to back; bias
]


@pytest.mark.parametrize("name,num_sms,seg_lens,contexts", CLUSTER_CASES, ids=[c[0] for c in CLUSTER_CASES])
def test_vm_with_cluster_pairs_matches_reference(name, num_sms, seg_lens, contexts):
    """ATTN_IN's two parts of a head on SMs 2c and 2c + 1, no ticket; part 0 finishes and signals. Where DOWN_PROJ's
    row blocks are at most half the SMs, its two column halves run the same way: part 0 adds part 1's sums and the
    residual, and alone signals."""
    spec, _ = model(name)
    prog = _vm_against_reference(name, num_sms, 16, seg_lens, contexts, shipping(spec, tile_k=16))
    assert prog.qkv_parts == 2 and not any(".qkv_ticket." in c.name for c in prog.counters)
    for s, q in enumerate(prog.queues):
        for ins in q:
            if ins.OP == isa.Op.ATTN_IN:
                assert ins.flags & isa.CLUSTER_PAIR and ins.ticket == isa.NO_COUNTER and ins.part == s % 2
                assert ins.has_finisher == (ins.part == 0) and (ins.signal == isa.NO_COUNTER) == (ins.part == 1)
    downs = [(s, ins) for s, q in enumerate(prog.queues) for ins in q if ins.OP == isa.Op.DOWN_PROJ]
    blocks = {(ins.layer, ins.row0) for _, ins in downs}
    paired = 2 * len(blocks) // prog.spec.num_layers <= num_sms
    assert all(bool(ins.flags & isa.CLUSTER_PAIR) == paired for _, ins in downs) and downs
    assert prog.down_pairs == paired
    if paired:
        assert len(downs) == 2 * len(blocks)
        for s, ins in downs:
            assert ins.part == s % 2 and ins.n_parts == 2 and ins.has_finisher == (ins.part == 0)
            assert (ins.signal == isa.NO_COUNTER) == (ins.part == 1)
    assert cluster_mate_errors(prog.queues) == []


def test_cluster_pairs_only_where_the_shape_forms_them():
    spec, _ = model("tiny-llama")
    for sms, cfg in ((7, shipping(spec, tile_k=16)), (8, shipping(spec, tile_k=16, qkv_parts=3)),
                     (8, shipping(spec)), (8, shipping(spec, tile_k=16, clusters=False))):
        prog = build_program(spec, StepShape((1,)), sms, cfg)  # an odd SM count, three parts, one column tile, off
        assert not prog.attn_pairs and not prog.down_pairs


def _swapped_mates(name="tiny-qwen3", num_sms=8):
    """A program with cluster pairs whose SM 1 holds its first two pair instructions in the other order (different
    heads of one layer): SM 0 and SM 1 meet at different heads."""
    spec, w, _, _, cache, tables, g = prefilled(name, 16, (40,), 1, 5)
    prog = build_program(spec, StepShape((1,)), num_sms, shipping(spec, tile_k=16))
    words, lengths = prog.encode()
    idx = [i for i in range(int(lengths[1])) if decode(words[1, i].tolist()).OP == isa.Op.ATTN_IN][:2]
    assert len(idx) == 2 and prog.queues[1][idx[0]].layer == prog.queues[1][idx[1]].layer
    words[1, idx] = words[1, idx[::-1]].clone()
    return prog, w, cache, tables, words, lengths


def test_cluster_mates_that_meet_at_different_heads_are_caught():
    prog, w, cache, tables, words, lengths = _swapped_mates()
    vm = VM(prog, w, cache, (words, lengths))
    state, scratch = alloc_state(prog, cache.layout.num_pages), alloc_scratch(prog)
    state.fill([3], [40], tables, (1,))
    with pytest.raises(DependencyError, match="cluster mates disagree"):
        vm.run_step(state, scratch, random.Random(0))
    # and the program's own check names them before anything runs
    queues = [[decode(x) for x in words[s, : int(lengths[s])].tolist()] for s in range(prog.num_sms)]
    assert any("does not pair" in e for e in cluster_mate_errors(queues))
    assert cluster_mate_errors(prog.queues) == []


def test_a_cluster_pair_whose_part_1_also_signals_is_caught():
    spec, _ = model("tiny-qwen3")
    prog, w, cache, state, scratch = _setup(num_sms=8, seg_lens=(1,), contexts=(40,),
                                            config=shipping(spec, tile_k=16))
    words, lengths = prog.encode()
    s, i = _find(prog, words, lengths, isa.Op.ATTN_IN, lambda ins: ins.part == 0)
    mate = [j for j in range(int(lengths[s ^ 1])) if decode(words[s ^ 1, j].tolist()).OP == isa.Op.ATTN_IN]
    k = [j for j in range(int(lengths[s])) if decode(words[s, j].tolist()).OP == isa.Op.ATTN_IN].index(i)
    words[s ^ 1, mate[k], isa.Word.SIGNAL] = words[s, i, isa.Word.SIGNAL]  # part 1 signals the group too
    with pytest.raises(DependencyError, match="counters off|waits for"):
        VM(prog, w, cache, (words, lengths)).run_step(state, scratch, random.Random(0))


# --- MoE programs -----------------------------------------------------------------------------------------------

MOE_REMOVALS = [  # tiny-qwen3-moe: layers 0 and 2 MoE, layer 1 dense
    (isa.Op.ROUTER, lambda ins: ins.layer == 2),
    (isa.Op.EXPERT_IN, lambda ins: ins.layer == 2),
    (isa.Op.EXPERT_DOWN, lambda ins: ins.layer == 2),
    (isa.Op.ATTN_IN, lambda ins: ins.layer == 1),  # waits for layer 0's expert rows
    (isa.Op.MLP_IN, lambda ins: ins.layer == 1),
    (isa.Op.LM_HEAD, lambda ins: True),
]


@pytest.mark.parametrize("op,pred", MOE_REMOVALS, ids=[r[0].name for r in MOE_REMOVALS])
@pytest.mark.parametrize("seg_lens", [(1,), (1, 1)])
def test_a_removed_moe_dependency_is_caught_by_some_random_interleaving(op, pred, seg_lens):
    prog, w, cache, state, scratch = _setup("tiny-qwen3-moe", seg_lens=seg_lens, contexts=(40, 21)[: len(seg_lens)])
    words, lengths = prog.encode()
    s, i = _find(prog, words, lengths, op, pred)
    words[s, i, isa.Word.WAIT] = isa.NO_COUNTER
    vm = VM(prog, w, cache, (words, lengths))
    for seed in range(20):
        try:
            vm.run_step(state, scratch, random.Random(seed))
        except DependencyError as e:
            assert "reads" in str(e)  # caught by the data-readiness check, not by a counter
            return
    pytest.fail(f"removing the wait of {decode(words[s, i].tolist())} went unnoticed in 20 interleavings")


@pytest.mark.parametrize("op,what", [(isa.Op.ROUTER, "router logits"), (isa.Op.EXPERT_DOWN, "expert rows")],
                         ids=["ROUTER", "EXPERT_DOWN"])
def test_an_moe_part_that_skips_its_ticket_is_caught(op, what):
    spec, w, _, _, cache, tables, g = prefilled("moe-e32", 16, (40, 21), 1, 5)
    prog = build_program(spec, StepShape((1, 1)), 7, shipping(spec, max_block_bytes=1024))  # one-tile blocks
    assert sum(1 for i in prog.instructions() if i.OP == isa.Op.ROUTER and i.layer == 2) == 2
    words, lengths = prog.encode()
    s, i = _find(prog, words, lengths, op, lambda ins: ins.layer == 2 and ins.ticket != isa.NO_COUNTER)
    words[s, i, isa.Word.D] = isa.NO_COUNTER  # this part believes it is alone: it finishes at once
    vm = VM(prog, w, cache, (words, lengths))
    for e in _dependency_errors(vm, prog, cache, ([3, 5], [40, 21], tables, (1, 1)), 20):
        if what in e:  # caught by data readiness: it finished from parts not yet written
            return
        assert "counters off" in e
    pytest.fail(f"a {op.name} part finishing without its ticket went unnoticed in 20 interleavings")


def test_the_routing_table_holds_the_steps_distinct_experts_once_each():
    """A batch of four tokens: each MoE layer's routing slots hold the distinct experts the reference routed to,
    ascending, each once; the other slots are idle, so the step reads each chosen expert once."""
    spec, w, ref, ref_cache, vm_cache, tables, g = prefilled("tiny-qwen3-moe", 16, (14, 31, 3, 47), 1, 7)
    dec = VMDecoder(spec, w, vm_cache, 7, StepShape((1, 1, 1, 1)))
    tokens = torch.randint(0, spec.vocab_size, (4,), generator=g)
    routings = []
    want = ref.forward(tokens, [Segment(t, p, 1) for t, p in zip(tables, (14, 31, 3, 47))], ref_cache,
                       routings=routings)
    assert rel_err(dec.step(tokens.tolist(), [14, 31, 3, 47], tables, random.Random(0)), want) <= 1e-5
    epoch = dec.state.epoch - 1  # the step just run
    assert dec.program.moe_slots == 16 and len(routings) == len(spec.moe_layers)
    idle = 0
    for layer, r in zip(spec.moe_layers, routings):
        table = [isa.routed_expert(int(v), epoch) for v in dec.scratch.routed[layer]]
        assert table[: len(r.experts)] == r.experts  # distinct, ascending
        assert set(table[len(r.experts):]) <= {isa.NO_EXPERT}
        idle += len(table) - len(r.experts)
    assert idle > 0  # the case exercises idle slots
    ins = [i for i in dec.program.instructions() if i.OP == isa.Op.EXPERT_IN and i.layer == 0]
    assert {i.slot for i in ins} == set(range(16)) and all(i.flags & isa.EXPERT_SPAN for i in ins)


def test_an_expert_reading_the_previous_steps_routing_is_caught():
    """The routing table is never cleared: an entry left by the previous step carries that step's tag, so an
    expert instruction run before this step's router is refused (readiness), and its solver could not read the
    stale entry either (isa.routed_expert returns None)."""
    prog, w, cache, state, scratch = _setup("tiny-qwen3-moe", seg_lens=(1,), contexts=(40,))
    VM(prog, w, cache).run_step(state, scratch, random.Random(0))  # step 0 fills the table
    run = VM(prog, w, cache).start(state, scratch)
    ins = next(i for i in prog.instructions() if i.OP == isa.Op.EXPERT_IN and i.layer == 2)
    with pytest.raises(DependencyError, match="before the layer's ROUTER finisher wrote it"):
        run.readiness.before(ins)
    assert isa.routed_expert(int(scratch.routed[2, ins.slot]), state.epoch) is None
    assert isa.routed_expert(int(scratch.routed[2, ins.slot]), state.epoch - 1) is not None


def test_vm_over_an_fp8_cache_matches_the_reference_over_the_same_cache():
    """The VM reads and writes K/V through the cache's format (kv/pages.py): over an fp8 cache (e4m3, a bf16 scale
    per token and head) it computes what the reference decoder computes over its own fp8 cache."""
    spec, w = model("tiny-qwen3")
    layout = KVLayout.for_spec(spec, 16, 8, torch.float8_e4m3fn)
    ref_cache, vm_cache = PagedKVCache(layout), PagedKVCache(layout)
    tables = [(3, 1, 6), (0, 5)]
    ref = ReferenceDecoder(w)
    g = torch.Generator().manual_seed(2)
    ref.forward(torch.randint(0, spec.vocab_size, (40,), generator=g), [Segment(tables[0], 0, 30),
                                                                        Segment(tables[1], 0, 10)], ref_cache)
    for a, b in zip(ref_cache.page_tensors(), vm_cache.page_tensors()):
        b.copy_(a)
    dec = VMDecoder(spec, w, vm_cache, 7, StepShape((1, 1)))
    for step in range(3):
        toks = torch.randint(0, spec.vocab_size, (2,), generator=g)
        want = ref.forward(toks, [Segment(tables[0], 30 + step, 1), Segment(tables[1], 10 + step, 1)], ref_cache)
        got = dec.step(toks.tolist(), [30 + step, 10 + step], tables, random.Random(step))
        assert rel_err(got, want) <= 1e-5
    assert all(torch.equal(a, b) for a, b in zip(ref_cache.page_tensors(), vm_cache.page_tensors()))


# --- decode batches as the GPU kernel plans them (plan.plan, M = 2..16) -----------------------------------------

BATCH_CASES = [  # (preset, num_sms, page_size, contexts: one segment of one token each)
    ("smollm2-135m", 132, 16, (14, 31)),
    ("smollm2-135m", 1, 64, (62, 1, 127, 30, 5)),
    ("smollm2-135m", 132, 64, (62, 1, 127, 30, 5, 64, 17, 2)),
    ("smollm2-wide", 132, 16, (14, 31, 3, 47, 9)),  # DOWN_PROJ in ticketed column parts
    ("smollm2-135m", 132, 16, (14, 31, 3, 47, 9, 1, 2, 60, 15, 16, 17, 33, 8, 5, 70, 22)),  # sixteen: MB = 16
    ("smollm2-135m", 132, 16, tuple(range(3, 99, 3))),  # thirty-two: MB = 32
]


@pytest.mark.parametrize("name,num_sms,page_size,contexts", BATCH_CASES,
                         ids=[f"{c[0]}-sm{c[1]}-ps{c[2]}-B{len(c[3])}" for c in BATCH_CASES])
def test_vm_proves_the_decode_batch_programs_the_plan_builds(name, num_sms, page_size, contexts):
    spec, _ = model(name)
    seg_lens = (1,) * len(contexts)
    p = plan(spec, num_sms, StepShape(seg_lens), page_size)
    prog = _vm_against_reference(name, num_sms, page_size, seg_lens, contexts, p.program.config)
    assert not any(i.flags & isa.CLUSTER_PAIR for i in prog.instructions())
    assert prog.down_parts == p.program.down_parts == 2


VERIFY_CASES = [  # (num_sms, segment lengths, padded, query blocks)
    (132, (4, 3, 1), False, False),
    (7, (4, 3, 1), False, False),
    (132, (4, 2, 1), True, False),  # 7 tokens run as the bucket of 8, a padding row last
    (132, (4, 3, 1), False, True),
    (7, (4, 3, 1), False, True),
    (132, (4, 2, 1), True, True),  # the padding row a block of one
    (132, (16,), False, True),  # T = 16 at contexts not a multiple of the GPU's blocks
    (132, (1, 5, 1, 6), True, True),  # two verify blocks and decode tokens, 13 padded by a block of 3
    (1, (5, 4, 1), False, True),  # every split on one SM
    (132, (1, 20), True, True),  # a segment past one query block: blocks of 16 and 4 (the second continues the
    # first: its rows of this step are the first block's), the padding a block of 11
    (132, (1, 1, 1, 1, 1), True, False),  # a decode batch of 5: three padding rows, each at position 0 of one page
    (7, (1, 1, 1, 1, 1), True, False),
]


@pytest.mark.parametrize("num_sms,lens,padded,blocks", VERIFY_CASES,
                         ids=[f"sm{c[0]}-{'x'.join(map(str, c[1]))}{'-pad' if c[2] else ''}{'-qb' if c[3] else ''}"
                              for c in VERIFY_CASES])
def test_the_vm_runs_verify_blocks_as_one_token_segments_as_the_reference_runs_the_blocks(num_sms, lens, padded,
                                                                                            blocks):
    """Verify blocks and decode tokens as one-token segments (the plan of a decode batch of their bucket), their
    attention per token or (``blocks``) in query blocks (StepShape.attn_blocks: one instruction per block, KV head
    and split), two steps in a row, each in several random interleavings: every token's logits and the cache equal
    the reference's over the real segments."""
    contexts = (37, 15, 60, 23, 9)[: len(lens)]
    spec, w, ref, ref_cache, vm_cache, tables, g = prefilled("smollm2-135m", 16, contexts, 2 * max(lens), 11)
    pad_page = min(set(range(vm_cache.layout.num_pages)) - {p for t in tables for p in t}) if padded else None
    least = 2 if blocks else MIN_QUERY_BLOCK  # the query-block path at any block length
    one0 = split_segments([Segment(t, s, n, n) for t, s, n in zip(tables, contexts, lens)], pad_page, least=least)
    n = one0.num_tokens
    shape = StepShape((1,) * n, 1024, one0.blocks if blocks else ())
    assert not blocks or shape.attn_blocks  # every case with query blocks has a block past one token
    p = plan(spec, num_sms, shape)
    dec = VMDecoder(spec, w, vm_cache, num_sms, shape, p.program.config)
    if blocks:  # one instruction per (query block, KV head, split); where one block is alone, M = 1's splits
        # (the SMs a KV head) capped by the 1024-position hint in 256-position splits and by the combine's stages
        # (plan.query_block: SmolLM2's staging buffer holds 16)
        attn = [i for i in dec.program.instructions() if i.OP == isa.Op.ATTN_PARTIAL and i.layer == 0]
        assert sorted({(i.seg, i.tokens) for i in attn}) == list(shape.attn_groups)
        if len(shape.attn_groups) == 1:
            m1 = plan(spec, num_sms, StepShape((1,), 1024)).program.n_splits[0]
            assert dec.program.n_splits == (min(m1, 1024 // 256, p.program.config.max_splits),)
    pad_rows = (vm_cache.k[:, pad_page].clone(), vm_cache.v[:, pad_page].clone()) if padded else None
    starts = list(contexts)
    for step in range(2):
        segs = [Segment(t, s, n, n) for t, s, n in zip(tables, starts, lens)]
        tokens = torch.randint(0, spec.vocab_size, (sum(lens),), generator=g)
        want = ref.forward(tokens, segs, ref_cache)
        one = split_segments(segs, pad_page, least=least)
        for rep in range(3):
            dec.state.fill(tokens.tolist() + [0] * one.padding, one.positions, one.block_tables,
                           dec.program.shape.seg_lens, one.firsts)
            dec.vm.run_step(dec.state, dec.scratch, random.Random(10 * step + rep))
            got = dec.scratch.logits[list(one.logit_rows)]
            assert rel_err(got, want) <= 1e-5, f"step {step}, interleaving {rep}: {rel_err(got, want):.2e}"
        assert dec.state.seg_new.tolist() == list(one.firsts)
        starts = [s + n for s, n in zip(starts, lens)]
    if padded:  # the padding wrote its page and nothing else: put the reference's bytes back before comparing
        assert not torch.equal(vm_cache.k[:, pad_page], pad_rows[0])
        vm_cache.k[:, pad_page], vm_cache.v[:, pad_page] = ref_cache.k[:, pad_page], ref_cache.v[:, pad_page]
    assert rel_err(vm_cache.k, ref_cache.k) <= 1e-5 and rel_err(vm_cache.v, ref_cache.v) <= 1e-5


def test_the_fp8_verify_program_matches_the_reference_over_the_same_fp8_cache():
    """Verify blocks and a decode token (8 one-token segments, the blocks as attention query blocks) with the
    program plan.plan builds for an fp8 cache: every token's logits and the rows appended (e4m3 bytes and scales)
    are the reference's over its own fp8 cache, whose past the VM's copy shares."""
    lens = (4, 3, 1)
    spec, w, ref, ref_cache, vm_cache, tables, g = prefilled("smollm2-135m", 16, (37, 15, 60), 2 * max(lens), 5,
                                                            fp8.FP8)
    blocks = split_segments([Segment(t, s, n, n) for t, s, n in zip(tables, (37, 15, 60), lens)], least=2).blocks
    shape = StepShape((1,) * sum(lens), 64, blocks)
    p = plan(spec, 132, shape, kv_dtype=fp8.FP8)
    assert p.constants.FP8 and p.constants.M == 8 and p.constants.QT > 1 and blocks == lens
    dec = VMDecoder(spec, w, vm_cache, 132, shape, p.program.config)
    starts = [37, 15, 60]
    for step in range(2):
        segs = [Segment(t, s, n, n) for t, s, n in zip(tables, starts, lens)]
        tokens = torch.randint(0, spec.vocab_size, (sum(lens),), generator=g)
        want = ref.forward(tokens, segs, ref_cache)
        one = split_segments(segs, least=2)
        dec.state.fill(tokens.tolist(), one.positions, one.block_tables, dec.program.shape.seg_lens, one.firsts)
        dec.vm.run_step(dec.state, dec.scratch, random.Random(step))
        assert rel_err(dec.scratch.logits[list(one.logit_rows)], want) <= 1e-5
        starts = [s + n for s, n in zip(starts, lens)]
    assert all(torch.equal(a, b) for a, b in zip(ref_cache.page_tensors(), vm_cache.page_tensors()))


@pytest.mark.parametrize("parts,num_sms", [(2, 7), (3, 132), (4, 1)])
def test_vm_with_ticketed_down_proj_parts_matches_reference(parts, num_sms):
    spec, _ = model("tiny-llama")
    prog = _vm_against_reference("tiny-llama", num_sms, 16, (1, 1, 1), (14, 3, 40),
                                 shipping(spec, tile_k=16, clusters=False, down_parts=parts))
    downs = [i for i in prog.instructions() if i.OP == isa.Op.DOWN_PROJ]
    assert {i.n_parts for i in downs} == {parts} and all(i.ticket != isa.NO_COUNTER for i in downs)
    assert sum(1 for c in prog.counters if ".down_ticket." in c.name) == len(downs) // parts


def test_a_down_proj_part_that_skips_its_ticket_is_caught():
    spec, w, _, _, cache, tables, g = prefilled("tiny-llama", 16, (14, 5), 4, 7)
    prog = build_program(spec, StepShape((1, 1)), 7, shipping(spec, tile_k=16, clusters=False, down_parts=3))
    words, lengths = prog.encode()
    s, i = _find(prog, words, lengths, isa.Op.DOWN_PROJ, lambda ins: ins.layer == 0 and ins.part == 0)
    words[s, i, isa.Word.E] = isa.NO_COUNTER  # part 0 now believes it is alone: it finishes the rows at once
    vm = VM(prog, w, cache, (words, lengths))
    for e in _dependency_errors(vm, prog, cache, ([3, 9], [14, 5], tables, (1, 1)), 20):
        # caught by data readiness: it summed parts not yet written, or its extra signal let the next layer read x
        # before the rows' real finisher wrote them
        if "column parts" in e or "reads x at version" in e:
            return
        assert "counters off" in e  # it finished last: its missing ticket leaves the ticket short
    pytest.fail("a DOWN_PROJ part finishing without its ticket went unnoticed in 20 interleavings")


def test_the_fp8_program_planned_for_128k_matches_the_reference_at_a_long_context():
    """The program the GPU runs for an fp8 cache at context 131072 (plan.plan with the cache's dtype: 66 splits a KV
    head for tiny-qwen3's 2 KV heads on 132 SMs) over a 40000-position fp8 cache of random rows, two steps in the
    VM against the reference decoder over a copy of the same cache: the splits cover the whole context, and the
    appended rows are the reference's bytes."""
    from mimw.kv import fp8
    from mimw.megakernel.plan import plan

    spec, w = model("tiny-qwen3")
    ctx, ps = 40000, 16
    p = plan(spec, 132, StepShape((1,), 131072), ps, kv_dtype=fp8.FP8)
    assert p.constants.FP8 and p.program.max_splits == 66
    layout = KVLayout.for_spec(spec, ps, ctx // ps + 4, fp8.FP8)
    ref_cache, vm_cache = PagedKVCache(layout), PagedKVCache(layout)
    table = tuple(random.Random(0).sample(range(layout.num_pages), layout.num_pages))
    g = torch.Generator().manual_seed(3)
    pos = torch.arange(ctx)
    for layer in range(spec.num_layers):
        k, v = (torch.randn(ctx, spec.num_kv_heads, spec.head_dim, generator=g) for _ in range(2))
        ref_cache.write(layer, table, pos, k, v)
    for a, b in zip(ref_cache.page_tensors(), vm_cache.page_tensors()):
        b.copy_(a)
    ref, vm = ReferenceDecoder(w), VM(p.program, w, vm_cache)
    state, scratch = alloc_state(p.program, max_pages=layout.num_pages), alloc_scratch(p.program)
    for step in range(2):
        tok = torch.randint(0, spec.vocab_size, (1,), generator=g)
        want = ref.forward(tok, [Segment(table, ctx + step, 1)], ref_cache)
        state.fill(tok.tolist(), [ctx + step], [table], (1,))
        vm.run_step(state, scratch, random.Random(step))
        assert rel_err(scratch.logits, want) <= 1e-5
    assert all(torch.equal(a, b) for a, b in zip(ref_cache.page_tensors(), vm_cache.page_tensors()))
