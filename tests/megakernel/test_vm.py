"""The VM proves the program: every interleaving the counters allow computes the reference decoder's logits.

Each case plans one program (model preset x SM count x step shape), prefills a context with the reference decoder,
then runs several consecutive steps through ``VMDecoder`` without resetting the counters (so every step waits on
step-numbered targets), each step under several random interleavings, and diffs the logits against
``ReferenceDecoder`` (fp32: max|a - b| / max|b| <= 1e-5). Block tables are shuffled page ids and the contexts cross
page boundaries during the steps. The cases are a covering selection, not the full product, so that the file
runs in well under two minutes on two CPU cores: every preset meets M = 1, a verify block StepShape((4,)) and a
batch StepShape((1, 1, 1, 1)); SM counts 1, 7, 132 and page sizes 16, 64 are spread over them. SmolLM2-135M runs
at its real shape but with 2 of its 30 layers (random weights) to keep CPU time low; with 7 SMs its matvecs split
into ~3,200 one-tile instructions, so it runs at 1 and 132 SMs only.
"""
from __future__ import annotations

import functools
import random

import pytest
import torch

from mimw.kv.pages import KVLayout, PagedKVCache
from mimw.megakernel import isa
from mimw.megakernel.program import ProgramConfig, StepShape, build_program
from mimw.megakernel.state import alloc_scratch, alloc_state
from mimw.megakernel.vm import VM, DeadlockError, DependencyError, VMDecoder, i32
from mimw.models.reference import ReferenceDecoder, Segment
from mimw.models.spec import get_preset
from mimw.models.weights import random_weights

STEPS, INTERLEAVINGS_PER_STEP = 4, 5  # 20 random interleavings per case, over 4 consecutive steps


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/megakernel/conftest.py


@functools.lru_cache(maxsize=None)
def model(name: str):
    spec = get_preset(name)
    if name == "smollm2-135m":
        spec = spec.with_(num_layers=2)  # the real shape, fewer layers: CPU time
    return spec, random_weights(spec, seed=1)


def prefilled(name: str, page_size: int, contexts: tuple[int, ...], new_tokens: int, seed: int):
    """Reference decoder + its cache holding each sequence's first ``contexts[s]`` tokens, a copy of that cache
    for the VM, and each sequence's block table (shuffled pages, enough for ``new_tokens`` more)."""
    spec, w = model(name)
    per_seq = [-(-(c + new_tokens) // page_size) for c in contexts]
    layout = KVLayout.for_spec(spec, page_size, sum(per_seq) + 3, torch.float32)
    pages = list(range(layout.num_pages))
    random.Random(seed).shuffle(pages)
    tables, i = [], 0
    for n in per_seq:
        tables.append(tuple(pages[i: i + n]))
        i += n
    ref, ref_cache = ReferenceDecoder(w), PagedKVCache(layout)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, spec.vocab_size, (sum(contexts),), generator=g)
    ref.forward(prompt, [Segment(t, 0, c) for t, c in zip(tables, contexts)], ref_cache)
    vm_cache = PagedKVCache(layout)
    vm_cache.k.copy_(ref_cache.k)
    vm_cache.v.copy_(ref_cache.v)
    return spec, w, ref, ref_cache, vm_cache, tables, g


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


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
]


@pytest.mark.parametrize("name,num_sms,page_size,seg_lens,contexts", CASES,
                         ids=[f"{c[0]}-sm{c[1]}-ps{c[2]}-M{'x'.join(map(str, c[3]))}" for c in CASES])
def test_vm_matches_reference_over_random_interleavings(name, num_sms, page_size, seg_lens, contexts):
    _vm_against_reference(name, num_sms, page_size, seg_lens, contexts, ProgramConfig())


TICKET_CASES = [  # ATTN_IN split in column parts with tickets: (preset, num_sms, seg_lens, contexts, parts)
    ("tiny-llama", 7, (1,), (14,), 3),
    ("tiny-qwen3", 132, (4,), (30,), 4),  # q/k norms in the finisher; every part on its own SM
    ("tiny-qwen2", 1, (1, 1), (5, 20), 2),  # one SM: the parts run back to back, the last one finishes
]


@pytest.mark.parametrize("name,num_sms,seg_lens,contexts,parts", TICKET_CASES)
def test_vm_with_attn_in_column_parts_matches_reference(name, num_sms, seg_lens, contexts, parts):
    prog = _vm_against_reference(name, num_sms, 16, seg_lens, contexts, ProgramConfig(tile_k=16, qkv_parts=parts))
    assert prog.qkv_parts == parts
    assert sum(1 for c in prog.counters if ".qkv_ticket." in c.name) == prog.spec.num_layers * (
        prog.spec.num_heads + 2 * prog.spec.num_kv_heads)


SEPARATE_REDUCE_CASES = [  # programs with an ATTN_REDUCE stage instead of combining splits
    ("tiny-llama", 7, 16, (1, 1, 1, 1), (14, 31, 3, 47)),
    ("tiny-qwen3", 132, 64, (4,), (63,)),
]


@pytest.mark.parametrize("name,num_sms,page_size,seg_lens,contexts", SEPARATE_REDUCE_CASES)
def test_vm_with_a_separate_reduce_stage_matches_reference(name, num_sms, page_size, seg_lens, contexts):
    prog = _vm_against_reference(name, num_sms, page_size, seg_lens, contexts, ProgramConfig(combine_splits=False))
    assert any(i.OP == isa.Op.ATTN_REDUCE for i in prog.instructions())


def test_combining_splits_replace_the_reduce_stage():
    spec = get_preset("tiny-llama")
    prog = build_program(spec, StepShape((1, 1)), 132)
    parts = [i for i in prog.instructions() if i.OP == isa.Op.ATTN_PARTIAL]
    assert not any(i.OP == isa.Op.ATTN_REDUCE for i in prog.instructions())
    assert all(i.combine for i in parts)
    for layer in range(spec.num_layers):  # every split of a layer signals the layer's attention-output counter
        assert len({i.signal for i in parts if i.layer == layer}) == 1
    assert all((i.ticket == isa.NO_COUNTER) == (i.n_splits == 1) for i in parts)
    assert max(i.n_splits for i in parts) > 1  # the case exercises tickets


def _vm_against_reference(name, num_sms, page_size, seg_lens, contexts, config):
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
    assert c[:-2] == [runs * k.count for k in dec.program.counters]
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

def _setup(name="tiny-qwen3", num_sms=7, seg_lens=(1, 1), contexts=(40, 21), config=ProgramConfig()):
    spec, w, _, _, vm_cache, tables, g = prefilled(name, 16, contexts, 1, 5)
    prog = build_program(spec, StepShape(seg_lens), num_sms, config)
    state, scratch = alloc_state(prog, vm_cache.layout.num_pages), alloc_scratch(prog)
    tokens = torch.randint(0, spec.vocab_size, (sum(seg_lens),), generator=g).tolist()
    state.fill(tokens, contexts, tables, seg_lens)
    return prog, w, vm_cache, state, scratch


def _find(prog, words, lengths, op, pred=lambda ins: True):
    """(sm, index) of the first instruction with opcode ``op`` (and ``pred``) that is not first in its queue."""
    for s in range(prog.num_sms):
        for i in range(1, int(lengths[s])):
            ins = isa.decode(words[s, i].tolist())
            if ins.OP == op and pred(ins):
                return s, i
    raise AssertionError(f"no {op.name} instruction found")


REMOVALS = [  # (opcode whose wait is removed, which instruction); ATTN_REDUCE: a program without combining splits
    (isa.Op.ATTN_IN, lambda ins: ins.layer == 1),
    (isa.Op.ATTN_PARTIAL, lambda ins: ins.layer == 1 and ins.split == 0),
    (isa.Op.ATTN_REDUCE, lambda ins: ins.layer == 1),
    (isa.Op.O_PROJ, lambda ins: ins.layer == 1),
    (isa.Op.MLP_IN, lambda ins: ins.layer == 1),
    (isa.Op.DOWN_PROJ, lambda ins: ins.layer == 1),
    (isa.Op.LM_HEAD, lambda ins: True),
]


@pytest.mark.parametrize("op,pred", REMOVALS, ids=[r[0].name for r in REMOVALS])
def test_a_removed_dependency_is_caught_by_some_random_interleaving(op, pred):
    prog, w, cache, state, scratch = _setup(config=ProgramConfig(combine_splits=op != isa.Op.ATTN_REDUCE))
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
    pytest.fail(f"removing the wait of {isa.decode(words[s, i].tolist())} went unnoticed in 20 interleavings")


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


def test_a_part_that_skips_its_ticket_is_caught_finishing_before_the_other_parts():
    spec, w, _, _, cache, tables, g = prefilled("tiny-llama", 16, (14,), 4, 7)
    prog = build_program(spec, StepShape((1,)), 7, ProgramConfig(tile_k=16, qkv_parts=3))
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
    prog = build_program(spec, StepShape((1, 1)), 132)  # enough SMs for several splits per segment
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
        return [s for s in range(prog.num_sms) if run.head(s) is not None and not run.may_run(run.head(s))]

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


def test_a_missing_signal_is_caught():
    prog, w, cache, state, scratch = _setup()
    words, lengths = prog.encode()
    s, i = _find(prog, words, lengths, isa.Op.LM_HEAD)
    words[s, i, isa.Word.SIGNAL] = isa.NO_COUNTER  # nobody waits on lm_head: only the end-of-step check sees it
    with pytest.raises(DependencyError, match="lm_head"):
        VM(prog, w, cache, (words, lengths)).run_step(state, scratch)


def test_readiness_catches_a_later_layer_overwriting_what_an_earlier_one_still_reads():
    # write-after-read: layer 1's ATTN_IN stores q head 0 while layer 0's ATTN_PARTIAL has not read it yet
    prog, w, cache, state, scratch = _setup()
    run = VM(prog, w, cache).start(state, scratch)
    part = isa.AttnPartial(layer=0, kv_head=0, seg=0, split=0, n_splits=prog.n_splits[0])
    for h in range(prog.spec.num_heads + 2 * prog.spec.num_kv_heads):
        run.readiness.after_finish(isa.AttnIn(layer=0, head=h))
    run.readiness.before(part)  # layer 0's q and K/V are in place
    run.readiness.after_finish(isa.AttnIn(layer=1, head=0))
    with pytest.raises(DependencyError, match=r"q heads at version \[1\], needs version 0"):
        run.readiness.before(part)


def test_counters_wrap_around_int32_without_a_reset():
    # start at an epoch where the largest per-step count's target crosses 2^31 during the next steps
    spec, w, ref, ref_cache, vm_cache, tables, g = prefilled("tiny-llama", 16, (9,), 3, 11)
    dec = VMDecoder(spec, w, vm_cache, 7, StepShape((1,)))
    counts = [c.count for c in dec.program.counters] + [dec.program.num_sms]
    epoch = 2**31 // max(i.wait_count for i in dec.program.instructions()) - 1  # a waited target wraps in step 1
    dec.state.counters.copy_(torch.tensor([i32(epoch * n) for n in counts] + [epoch], dtype=torch.int32))
    for step in range(3):
        tokens = torch.randint(0, spec.vocab_size, (1,), generator=g)
        want = ref.forward(tokens, [Segment(tables[0], 9 + step, 1)], ref_cache)
        assert rel_err(dec.step(tokens.tolist(), [9 + step], tables, random.Random(step)), want) <= 1e-5
    assert dec.state.counters.tolist() == [i32((epoch + 3) * n) for n in counts] + [epoch + 3]
    assert min(dec.state.counters.tolist()) < 0  # some counter did wrap


def test_vm_with_fewer_larger_matvec_blocks_matches_reference():
    """The default KernelConfig (fixed_cost_kb=96, max_block_kb=1024, measured at a4a86e4) prices an instruction at
    its measured fixed cost and builds fewer, larger blocks than session 11's 16 KB / 256 KB; the program still
    computes the reference."""
    from mimw.megakernel.gpu.config import KernelConfig

    old = dict(fixed_cost_kb=16, max_block_kb=256)
    big = KernelConfig().program_config()  # with the default's cluster pairs (an even SM count)
    prog = _vm_against_reference("smollm2-135m", 4, 16, (1,), (14,), big)  # the real widths, two layers
    assert big.cluster_qkv and any(i.flags & isa.CLUSTER_PAIR for i in prog.instructions())
    small = build_program(prog.spec, StepShape((1,), 14), 4, KernelConfig(**old).program_config())
    assert len(list(prog.instructions())) < 0.7 * len(list(small.instructions()))
    llama = get_preset("llama-3.2-1b")
    before = build_program(llama, StepShape((1,), 1024), 132, KernelConfig(**old).program_config())
    fewer = build_program(llama, StepShape((1,), 1024), 132, KernelConfig().program_config())
    lm = lambda p: [i for i in p.instructions() if i.OP == isa.Op.LM_HEAD]  # noqa: E731
    assert sum(i.nrows for i in lm(fewer)) == llama.vocab_size and len(lm(fewer)) < len(lm(before)) // 2


def test_lm_head_blocks_need_not_signal_a_counter_nobody_waits_on():
    prog = _vm_against_reference("tiny-llama", 3, 16, (1,), (14,), ProgramConfig(tile_k=16, signal_logits=False))
    assert all(i.signal == isa.NO_COUNTER for i in prog.instructions() if i.OP == isa.Op.LM_HEAD)
    assert not any(c.name == "lm_head" for c in prog.counters)


VERSIONED = [("tiny-llama", 5, (1,), (14,)), ("tiny-qwen3", 7, (1, 1), (20, 9)), ("smollm2-135m", 3, (1,), (14,))]


MODES = {"act": dict(flag_act=True), "act+x": dict(flag_act=True, flag_x=True),
         "act+x+attn": dict(flag_act=True, flag_x=True, flag_attn=True),
         "act+x+attn, reduce stage": dict(flag_act=True, flag_x=True, flag_attn=True, combine_splits=False),
         "q": dict(flag_q=True),
         "all": dict(flag_act=True, flag_x=True, flag_attn=True, flag_q=True),
         "all, reduce stage": dict(flag_act=True, flag_x=True, flag_attn=True, flag_q=True, combine_splits=False)}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name,num_sms,seg_lens,contexts", VERSIONED, ids=[v[0] for v in VERSIONED])
def test_vm_with_versioned_words_matches_reference(name, num_sms, seg_lens, contexts, mode):
    """ProgramConfig(flag_act, flag_x, flag_attn): hops through versioned words: the readers wait on the words'
    versions, the writers signal nothing."""
    kw = MODES[mode]
    tk = 256 if name == "smollm2-135m" else 16
    prog = _vm_against_reference(name, num_sms, 16, seg_lens, contexts, ProgramConfig(tile_k=tk, **kw))
    by = lambda op: [i for i in prog.instructions() if i.OP == op]  # noqa: E731
    if kw.get("flag_q"):  # ATTN_IN -> ATTN_PARTIAL without a counter
        assert all(i.signal == isa.NO_COUNTER and i.flags & isa.WRITES_VERSIONED for i in by(isa.Op.ATTN_IN))
        assert all(i.wait == isa.NO_COUNTER and i.flags & isa.READS_Q for i in by(isa.Op.ATTN_PARTIAL))
        assert not any(".qkv.kv" in c.name for c in prog.counters)
    if not kw.get("flag_act"):
        return
    flag_x, flag_attn = kw.get("flag_x", False), kw.get("flag_attn", False)
    vx = isa.READS_X if flag_x else 0
    assert all(i.signal == isa.NO_COUNTER and i.flags == vx | isa.WRITES_VERSIONED for i in by(isa.Op.MLP_IN))
    down_flags = isa.READS_ACT | (vx | isa.WRITES_VERSIONED if flag_x else 0)
    assert all(i.flags == down_flags for i in by(isa.Op.DOWN_PROJ))
    assert not any("mlp_in" in c.name for c in prog.counters)
    if flag_x:  # no counter left between the attention window and the next one
        assert not any(k in c.name for c in prog.counters for k in ("o_proj", "down_proj"))
        for op in (isa.Op.O_PROJ, isa.Op.MLP_IN, isa.Op.DOWN_PROJ):
            assert all(i.signal == isa.NO_COUNTER for i in by(op))
        assert all(i.wait == isa.NO_COUNTER for i in by(isa.Op.ATTN_IN) + by(isa.Op.MLP_IN) + by(isa.Op.LM_HEAD))
        if flag_attn:  # nor between the attention splits and O_PROJ
            assert all(i.wait == isa.NO_COUNTER and i.flags & isa.READS_ATTN for i in by(isa.Op.O_PROJ))
            writers = by(isa.Op.ATTN_REDUCE) or by(isa.Op.ATTN_PARTIAL)
            assert all(i.signal == isa.NO_COUNTER and i.flags & isa.WRITES_VERSIONED for i in writers)
            assert not any("attn_out" in c.name for c in prog.counters)
        else:
            assert {prog.counters[i.wait].name.split(".")[1] for i in by(isa.Op.O_PROJ)} == {"attn_out"}
    else:
        assert {prog.counters[i.wait].name.split(".")[1] for i in by(isa.Op.DOWN_PROJ)} == {"o_proj"}


def test_versioned_attn_needs_versioned_x():
    spec = get_preset("tiny-llama")
    with pytest.raises(ValueError, match="flag_attn needs flag_x"):
        build_program(spec, StepShape((1,)), 3, ProgramConfig(tile_k=16, flag_attn=True))


# (flag_x (and flag_attn), opcode whose versioned-read bit is cleared, the bit, what readiness reports). O_PROJ's and DOWN_PROJ's
# residual rows are not here: their versions are implied by the other waits (O_PROJ's attn counter comes after every
# ATTN_IN of its layer read all of x; DOWN_PROJ's act words after every MLP_IN did), so the VM never blocks on them.
# The GPU still reads them as versioned words: relaxed loads, which only the word's own version makes safe.
BREAKS = [
    (False, isa.Op.DOWN_PROJ, isa.READS_ACT, "reads act"),
    (True, isa.Op.O_PROJ, isa.READS_ATTN, "reads attn"),
    (True, isa.Op.ATTN_PARTIAL, isa.READS_Q, "q heads"),
    (True, isa.Op.DOWN_PROJ, isa.READS_ACT, "reads act"),
    (True, isa.Op.ATTN_IN, isa.READS_X, "reads x"),
    (True, isa.Op.MLP_IN, isa.READS_X, "reads x"),
    (True, isa.Op.LM_HEAD, isa.READS_X, "reads x"),
]


@pytest.mark.parametrize("flag_x,op,bit,what", BREAKS, ids=[f"{b[1].name}-{b[3]}" for b in BREAKS])
def test_a_versioned_reader_that_stops_waiting_for_its_words_is_caught(flag_x, op, bit, what):
    """Clearing a reader's versioned-read bit leaves it no wait on that input: some interleaving runs it before
    the words were written, and data readiness catches the read."""
    spec, w, _, _, cache, tables, g = prefilled("tiny-llama", 16, (14,), 4, 7)
    prog = build_program(spec, StepShape((1,)), 5, ProgramConfig(tile_k=16, flag_act=True, flag_x=flag_x,
                                                                 flag_attn=flag_x, flag_q=flag_x))
    words, lengths = prog.encode()
    s, i = _find(prog, words, lengths, op, lambda ins: ins.layer == 1 or op == isa.Op.LM_HEAD)
    words[s, i, isa.Word.FLAGS] &= ~bit
    vm = VM(prog, w, cache, (words, lengths))
    for e in _dependency_errors(vm, prog, cache, ([3], [14], tables, (1,)), 40):
        assert what in e
        return
    pytest.fail(f"a {op.name} that does not wait for its versioned words went unnoticed in 40 interleavings")


def test_a_versioned_word_that_is_never_written_is_a_deadlock():
    spec, w, _, _, cache, tables, g = prefilled("tiny-llama", 16, (14,), 4, 7)
    prog = build_program(spec, StepShape((1,)), 3, ProgramConfig(tile_k=16, flag_act=True, flag_x=True,
                                                                 flag_attn=True))
    words, lengths = prog.encode()
    s, i = _find(prog, words, lengths, isa.Op.MLP_IN, lambda ins: ins.layer == 0)
    words[s, i] = torch.tensor(isa.Nop().encode())  # one block of act is never written
    vm = VM(prog, w, cache, (words, lengths))
    state, scratch = alloc_state(prog, cache.layout.num_pages), alloc_scratch(prog)
    state.fill([3], [14], tables, (1,))
    with pytest.raises(DeadlockError, match="versioned words"):
        vm.run_step(state, scratch)


LATE_QKV = [  # ProgramConfig(qkv_in_attn): (preset, num_sms, seg_lens, contexts, parts, combine_splits)
    ("tiny-llama", 7, (1,), (14,), 3, True),
    ("tiny-qwen3", 132, (4,), (30,), 4, True),  # q/k norms; a verify block: this step's rows over several splits
    ("tiny-qwen2", 5, (1, 1), (5, 20), 2, False),  # bias; a batch of two; the ATTN_REDUCE stage
    ("tiny-llama3", 132, (1, 1, 1, 1), (13, 16, 33, 2), 1, True),  # one part: nothing to sum
]


@pytest.mark.parametrize("name,num_sms,seg_lens,contexts,parts,combine", LATE_QKV, ids=[c[0] for c in LATE_QKV])
def test_vm_with_qkv_finished_by_the_attention_splits_matches_reference(name, num_sms, seg_lens, contexts, parts,
                                                                          combine):
    """ProgramConfig(qkv_in_attn): ATTN_IN's parts signal the group's counter directly (no tickets, no finisher);
    each ATTN_PARTIAL finishes its q heads and its K/V rows from the parts and stores the rows in its split."""
    prog = _vm_against_reference(name, num_sms, 16, seg_lens, contexts,
                                 ProgramConfig(tile_k=16, qkv_parts=parts, qkv_in_attn=True, combine_splits=combine))
    spec = prog.spec
    by = lambda op: [i for i in prog.instructions() if i.OP == op]  # noqa: E731
    assert all(i.ticket == isa.NO_COUNTER and not i.has_finisher and i.flags & isa.QKV_IN_ATTN
               for i in by(isa.Op.ATTN_IN))
    assert all(i.flags & isa.QKV_IN_ATTN and i.n_parts == parts for i in by(isa.Op.ATTN_PARTIAL))
    assert not any(".qkv_ticket." in c.name for c in prog.counters)
    assert {c.count for c in prog.counters if ".qkv.kv" in c.name} == {(spec.group_size + 2) * parts}


def test_qkv_in_attn_excludes_versioned_q():
    with pytest.raises(ValueError, match="qkv_in_attn and flag_q"):
        build_program(get_preset("tiny-llama"), StepShape((1,)), 3, ProgramConfig(tile_k=16, qkv_in_attn=True,
                                                                                   flag_q=True))


def test_a_split_that_finishes_its_heads_without_waiting_for_the_parts_is_caught():
    spec, w, _, _, cache, tables, g = prefilled("tiny-llama", 16, (14,), 4, 7)
    prog = build_program(spec, StepShape((1,)), 7, ProgramConfig(tile_k=16, qkv_parts=3, qkv_in_attn=True))
    words, lengths = prog.encode()
    s, i = _find(prog, words, lengths, isa.Op.ATTN_PARTIAL, lambda ins: ins.layer == 1 and ins.split == 0)
    words[s, i, isa.Word.WAIT] = isa.NO_COUNTER
    vm = VM(prog, w, cache, (words, lengths))
    for e in _dependency_errors(vm, prog, cache, ([3], [14], tables, (1,)), 20):
        assert "qkv parts of its heads" in e
        return
    pytest.fail("an ATTN_PARTIAL summing parts it did not wait for went unnoticed in 20 interleavings")


def test_merged_releases_match_reference_and_signal_each_counter_its_count():
    """ProgramConfig(merge_signals): a run of same-counter instructions on one SM releases once, by the run's length,
    at its end; every interleaving still computes the reference's logits and every counter still gets its count."""
    cfg = ProgramConfig(tile_k=16, max_block_bytes=2048, merge_signals=True)  # small blocks: runs of several
    prog = _vm_against_reference("tiny-llama", 3, 16, (1,), (14,), cfg)
    ins = list(prog.instructions())
    merged = [i for i in ins if i.signal != isa.NO_COUNTER and i.signal_n == 0]
    assert merged and any(i.signal_n > 1 for i in ins)
    assert all(not i.has_finisher for i in merged)
    for q in prog.queues:  # every run ends in the release that adds its length
        run = 0
        for a in q:
            run += 1 if a.signal != isa.NO_COUNTER and not a.has_finisher else 0
            if a.signal_n > 0:
                assert a.signal == isa.NO_COUNTER or a.has_finisher or a.signal_n == run
                run = 0


def test_a_merged_run_that_drops_its_release_is_a_deadlock():
    spec, w, _, _, cache, tables, g = prefilled("tiny-llama", 16, (14,), 4, 7)
    cfg = ProgramConfig(tile_k=16, max_block_bytes=2048, merge_signals=True)
    prog = build_program(spec, StepShape((1,)), 3, cfg)
    words, lengths = prog.encode()
    s, i = _find(prog, words, lengths, isa.Op.MLP_IN, lambda ins: ins.layer == 0 and ins.signal_n > 1)
    words[s, i, isa.Word.SIGNAL_N] = 0  # the run's one release is gone: DOWN_PROJ waits forever
    vm = VM(prog, w, cache, (words, lengths))
    state, scratch = alloc_state(prog, cache.layout.num_pages), alloc_scratch(prog)
    state.fill([3], [14], tables, (1,))
    with pytest.raises(DeadlockError, match="mlp_in"):
        vm.run_step(state, scratch)


def test_qkv_finished_in_attention_with_merged_releases_matches_reference():
    """The two opt-ins together (variant tr32-qkvattn-merge): ATTN_IN's parts of one group that run back to back on
    an SM merge their releases too."""
    cfg = ProgramConfig(tile_k=16, qkv_parts=3, max_block_bytes=2048, qkv_in_attn=True, merge_signals=True)
    prog = _vm_against_reference("tiny-qwen3", 3, 16, (1, 1), (20, 9), cfg)
    assert any(i.OP == isa.Op.ATTN_IN and i.signal_n > 1 for i in prog.instructions())


O_PARTS = [  # ProgramConfig(o_parts): (preset, num_sms, seg_lens, contexts, o_parts, extra options)
    ("tiny-llama", 7, (1,), (14,), 2, {}),  # one KV group a part
    ("tiny-llama", 3, (1,), (30,), 1, {}),  # one part: it combines every group, x_part[0] is x
    ("tiny-qwen3", 132, (4,), (30,), 2, dict(qkv_parts=3, qkv_in_attn=True)),  # a verify block; heads finished late
    ("tiny-qwen2", 5, (1, 1), (5, 20), 1, dict(merge_signals=True, max_block_bytes=2048)),  # bias; a batch; runs
    ("tiny-llama3", 132, (1, 1, 1, 1), (13, 16, 33, 2), 2, dict(flag_act=True)),  # versioned act beside the parts
]


@pytest.mark.parametrize("name,num_sms,seg_lens,contexts,o_parts,extra", O_PARTS,
                         ids=[f"{c[0]}-sm{c[1]}-p{c[4]}" for c in O_PARTS])
def test_vm_with_o_proj_in_column_parts_matches_reference(name, num_sms, seg_lens, contexts, o_parts, extra):
    """ProgramConfig(o_parts): the attention splits signal their part's counter (no tickets, no combine, no
    ATTN_REDUCE); each O_PROJ instruction combines its groups' splits, multiplies its columns of W_o and stores
    x_part (part 0 with the residual); MLP_IN and DOWN_PROJ sum the parts."""
    prog = _vm_against_reference(name, num_sms, 16, seg_lens, contexts,
                                 ProgramConfig(tile_k=16, o_parts=o_parts, **extra))
    spec = prog.spec
    by = lambda op: [i for i in prog.instructions() if i.OP == op]  # noqa: E731
    assert not by(isa.Op.ATTN_REDUCE)
    assert all(not i.combine and i.ticket == isa.NO_COUNTER for i in by(isa.Op.ATTN_PARTIAL))
    o = by(isa.Op.O_PROJ)
    assert {(i.part, i.n_parts) for i in o} == {(p, o_parts) for p in range(o_parts)}
    for layer in range(spec.num_layers):  # every part covers every row once
        for p in range(o_parts):
            rows = sorted((i.row0, i.nrows) for i in o if i.layer == layer and i.part == p)
            assert sum(n for _, n in rows) == spec.hidden_size and rows[0][0] == 0
    assert not any("ticket" in c.name for c in prog.counters if ".attn" in c.name)


def test_o_parts_must_fit_the_model():
    spec = get_preset("tiny-llama")  # 2 KV heads, 64 query columns
    with pytest.raises(ValueError, match="must divide the 2 KV heads"):
        build_program(spec, StepShape((1,)), 3, ProgramConfig(tile_k=16, o_parts=3))
    with pytest.raises(ValueError, match="not whole 64-column tiles"):
        build_program(spec, StepShape((1,)), 3, ProgramConfig(tile_k=64, o_parts=2))
    with pytest.raises(ValueError, match="o_parts excludes flag_x"):
        build_program(spec, StepShape((1,)), 3, ProgramConfig(tile_k=16, o_parts=2, flag_x=True))


@pytest.mark.parametrize("op,what", [(isa.Op.O_PROJ, "partials of its groups"), (isa.Op.MLP_IN, "x parts")])
def test_o_parts_a_removed_dependency_is_caught(op, what):
    """An O_PROJ part that does not wait for its groups' splits, an MLP_IN that does not wait for every part: data
    readiness sees the read of what was not yet written."""
    spec, w, _, _, cache, tables, g = prefilled("tiny-llama", 16, (14,), 4, 7)
    prog = build_program(spec, StepShape((1,)), 7, ProgramConfig(tile_k=16, o_parts=2))
    words, lengths = prog.encode()
    s, i = _find(prog, words, lengths, op, lambda ins: ins.layer == 1)
    words[s, i, isa.Word.WAIT] = isa.NO_COUNTER
    vm = VM(prog, w, cache, (words, lengths))
    for e in _dependency_errors(vm, prog, cache, ([3], [14], tables, (1,)), 30):
        if what in e:
            return
    pytest.fail(f"removing the wait of {isa.decode(words[s, i].tolist())} went unnoticed in 30 interleavings")


def test_o_parts_readiness_catches_the_next_layer_overwriting_x_parts_down_proj_still_reads():
    prog, w, cache, state, scratch = _setup("tiny-llama", 7, (1,), (14,), ProgramConfig(tile_k=16, o_parts=2))
    run = VM(prog, w, cache).start(state, scratch)
    d = prog.spec.hidden_size
    for p in range(2):
        run.readiness.after(isa.OProj(layer=0, row0=0, nrows=d, part=p, n_parts=2))
    run.readiness.after(isa.MlpIn(layer=0, row0=0, nrows=prog.spec.intermediate_size))
    down = isa.DownProj(layer=0, row0=0, nrows=d)
    run.readiness.before(down)  # layer 0's parts and act are in place
    run.readiness.after(isa.OProj(layer=1, row0=0, nrows=d, part=1, n_parts=2))
    with pytest.raises(DependencyError, match=r"x parts' rows at version \[1\], needs version 0"):
        run.readiness.before(down)


CLUSTER_CASES = [  # ProgramConfig(cluster_qkv): (preset, num_sms, seg_lens, contexts)
    ("tiny-llama", 132, (1,), (14,)),  # every head on its own cluster
    ("tiny-qwen3", 8, (4,), (30,)),  # q/k norms in part 0's finish; several pairs a layer on each cluster
    ("tiny-qwen2", 2, (1, 1), (5, 20)),  # one cluster: every pair on SMs 0 and 1, back to back; bias
]


@pytest.mark.parametrize("name,num_sms,seg_lens,contexts", CLUSTER_CASES, ids=[c[0] for c in CLUSTER_CASES])
def test_vm_with_cluster_pairs_matches_reference(name, num_sms, seg_lens, contexts):
    """ProgramConfig(cluster_qkv): ATTN_IN's two parts of a head on SMs 2c and 2c + 1, no ticket; part 0 finishes
    and signals."""
    prog = _vm_against_reference(name, num_sms, 16, seg_lens, contexts, ProgramConfig(tile_k=16, cluster_qkv=True))
    assert prog.qkv_parts == 2 and not any(".qkv_ticket." in c.name for c in prog.counters)
    for s, q in enumerate(prog.queues):
        for ins in q:
            if ins.OP == isa.Op.ATTN_IN:
                assert ins.flags & isa.CLUSTER_PAIR and ins.ticket == isa.NO_COUNTER and ins.part == s % 2
                assert ins.has_finisher == (ins.part == 0) and (ins.signal == isa.NO_COUNTER) == (ins.part == 1)


@pytest.mark.parametrize("name,num_sms,seg_lens,contexts", CLUSTER_CASES, ids=[c[0] for c in CLUSTER_CASES])
def test_vm_with_down_proj_pairs_matches_reference(name, num_sms, seg_lens, contexts):
    """ProgramConfig(cluster_down): where DOWN_PROJ's row blocks are at most half the SMs, their two column halves
    run on SMs 2c and 2c + 1; part 0 adds part 1's sums and the residual, and alone signals."""
    prog = _vm_against_reference(name, num_sms, 16, seg_lens, contexts,
                                 ProgramConfig(tile_k=16, cluster_qkv=True, cluster_down=True))
    downs = [(s, ins) for s, q in enumerate(prog.queues) for ins in q if ins.OP == isa.Op.DOWN_PROJ]
    blocks = {(ins.layer, ins.row0) for _, ins in downs}
    paired = 2 * len(blocks) // prog.spec.num_layers <= num_sms
    assert all(bool(ins.flags & isa.CLUSTER_PAIR) == paired for _, ins in downs) and downs
    if paired:
        assert len(downs) == 2 * len(blocks)
        for s, ins in downs:
            assert ins.part == s % 2 and ins.n_parts == 2 and ins.has_finisher == (ins.part == 0)
            assert (ins.signal == isa.NO_COUNTER) == (ins.part == 1)
    from mimw.megakernel.program import cluster_mate_errors
    assert cluster_mate_errors(prog.queues) == []


def test_down_proj_pairs_need_the_cluster_launch_and_no_versioned_x():
    spec, _ = model("tiny-llama")
    with pytest.raises(ValueError, match="cluster_down needs cluster_qkv"):
        build_program(spec, StepShape((1,)), 8, ProgramConfig(tile_k=16, cluster_down=True))
    with pytest.raises(ValueError, match="cluster_down excludes"):
        build_program(spec, StepShape((1,)), 8, ProgramConfig(tile_k=16, cluster_qkv=True, cluster_down=True,
                                                                 o_parts=2))


def test_cluster_pairs_need_two_parts_an_even_sm_count_and_a_finisher():
    spec, _ = model("tiny-llama")
    with pytest.raises(ValueError, match="odd"):
        build_program(spec, StepShape((1,)), 7, ProgramConfig(tile_k=16, cluster_qkv=True))
    with pytest.raises(ValueError, match="qkv_parts=3"):
        build_program(spec, StepShape((1,)), 8, ProgramConfig(tile_k=16, cluster_qkv=True, qkv_parts=3))
    with pytest.raises(ValueError, match="qkv_in_attn"):
        build_program(spec, StepShape((1,)), 8, ProgramConfig(tile_k=16, cluster_qkv=True, qkv_in_attn=True))


def _swapped_mates(name="tiny-qwen3", num_sms=8):
    """A cluster_qkv program whose SM 1 holds its first two pair instructions in the other order (different heads
    of one layer): SM 0 and SM 1 meet at different heads."""
    spec, w, _, _, cache, tables, g = prefilled(name, 16, (40,), 1, 5)
    prog = build_program(spec, StepShape((1,)), num_sms, ProgramConfig(tile_k=16, cluster_qkv=True))
    words, lengths = prog.encode()
    idx = [i for i in range(int(lengths[1])) if isa.decode(words[1, i].tolist()).OP == isa.Op.ATTN_IN][:2]
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
    from mimw.megakernel.program import cluster_mate_errors
    queues = [[isa.decode(x) for x in words[s, : int(lengths[s])].tolist()] for s in range(prog.num_sms)]
    assert any("does not pair" in e for e in cluster_mate_errors(queues))
    assert cluster_mate_errors(prog.queues) == []


def test_a_cluster_pair_whose_part_1_also_signals_is_caught():
    prog, w, cache, state, scratch = _setup(num_sms=8, seg_lens=(1,), contexts=(40,),
                                            config=ProgramConfig(tile_k=16, cluster_qkv=True))
    words, lengths = prog.encode()
    s, i = _find(prog, words, lengths, isa.Op.ATTN_IN, lambda ins: ins.part == 0)
    mate = [j for j in range(int(lengths[s ^ 1])) if isa.decode(words[s ^ 1, j].tolist()).OP == isa.Op.ATTN_IN]
    k = [j for j in range(int(lengths[s])) if isa.decode(words[s, j].tolist()).OP == isa.Op.ATTN_IN].index(i)
    words[s ^ 1, mate[k], isa.Word.SIGNAL] = words[s, i, isa.Word.SIGNAL]  # part 1 signals the group too
    with pytest.raises(DependencyError, match="counters off|waits for"):
        VM(prog, w, cache, (words, lengths)).run_step(state, scratch, random.Random(0))
