"""The Gluon megakernel on a Hopper GPU against the fp32 reference decoder (marker `gpu`; skipped without CUDA)."""
import pytest
import torch

from mimw.models.spec import get_preset

pytestmark = pytest.mark.gpu

MODELS = ["smollm2-135m", "llama-3.2-1b", "llama-3.1-8b", "qwen3-8b"]


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


# the default tensor-core consumer at every context; the CUDA-core one (opt-in since session 11) at the two ends
CONSUMERS = [("mma", c) for c in (1, 17, 1000, 8191)] + [("fma", c) for c in (1, 8191)]


@pytest.mark.skipif(not _hopper(), reason="the megakernel needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("consumer,context", CONSUMERS)
@pytest.mark.parametrize("model", MODELS)
def test_megakernel_matches_reference_over_64_steps(model, context, consumer):
    """Both matvec consumers (matvec.py): tensor-core mma.sync (the default) and CUDA-core FMAs."""
    import dataclasses

    from mimw.megakernel.gpu.check import check_decode
    from mimw.megakernel.gpu.config import KernelConfig

    spec = get_preset(model)
    kcfg = dataclasses.replace(KernelConfig.for_spec(spec), mma=1 if consumer == "mma" else 0)
    r = check_decode(spec, context, steps=64, kcfg=kcfg)
    assert r.finite, r
    assert r.bit_identical, f"repeated launches differ (race): {r}"
    assert r.max_rel_err <= 2e-2, r
    # exact agreement, or a near-tie: the oracle's top two closer than 2x the bf16 (transformers-numerics)
    # reference's own error on the same run (check.py)
    assert r.argmax_agree_or_tie >= 0.99, r
    # exact agreement against the fp32 oracle: bf16 itself flips near-ties (H200, 2026-12-02: 61/64 at 8B, ctx 17,
    # gaps 0.04-0.6% of max|logit| at a step error of 1.1-1.2%)
    assert r.argmax_agree >= 0.9, r


def _matches_reference_over_64_steps(model, context, **overrides):
    """KernelConfig.for_spec with ``overrides``, 64 steps against the reference: finite, bit-identical repeats,
    within bf16 error, argmax as test_megakernel_matches_reference_over_64_steps asks."""
    import dataclasses

    from mimw.megakernel.gpu.check import check_decode
    from mimw.megakernel.gpu.config import KernelConfig

    spec = get_preset(model)
    r = check_decode(spec, context, steps=64, kcfg=dataclasses.replace(KernelConfig.for_spec(spec), **overrides))
    assert r.finite and r.bit_identical, r
    assert r.max_rel_err <= 2e-2 and r.argmax_agree_or_tie >= 0.99 and r.argmax_agree >= 0.9, r


@pytest.mark.skipif(not _hopper(), reason="the megakernel needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("context", [1, 17, 1000])
@pytest.mark.parametrize("model", MODELS)
def test_qkv_finished_by_the_attention_splits_matches_reference_over_64_steps(model, context):
    """KernelConfig(qkv_in_attn=True): ATTN_IN's parts signal, every ATTN_PARTIAL finishes its heads from them and
    the split holding the step's position stores its K/V row (context 1: the only position; the 64 steps then
    read every row the splits stored)."""
    _matches_reference_over_64_steps(model, context, qkv_in_attn=True)


@pytest.mark.skipif(not _hopper(), reason="the megakernel needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("context", [1000, 8191])
@pytest.mark.parametrize("model", MODELS)
def test_kv_pipeline_matches_reference_over_64_steps(model, context):
    """KernelConfig(kv_pipeline=True): an attention split's later blocks through two cp.async stages in shared
    memory (contexts where splits have several blocks; the newest row patched into whichever block holds it)."""
    _matches_reference_over_64_steps(model, context, kv_pipeline=True, ring=0)


@pytest.mark.skipif(not _hopper(), reason="the megakernel needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("model", MODELS)
def test_merged_releases_match_reference_over_64_steps(model):
    """KernelConfig(merge_signals=True) with 256 KB blocks (runs of same-stage blocks on every shape): a run
    releases once, adding its length; a run whose earlier blocks' stores were not covered would differ between
    repeats or from the reference."""
    _matches_reference_over_64_steps(model, 17, merge_signals=True, max_block_kb=256)


@pytest.mark.skipif(not _hopper(), reason="the megakernel needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("context", [17, 1000])
@pytest.mark.parametrize("model", MODELS)
def test_fold_shuffle_epilogue_matches_reference_over_64_steps(model, context):
    """KernelConfig(fold_shuffle=True): the tensor-core epilogue sums the folds by warp shuffles in the layout the
    reshape gives (matvec.dot_tile_mma); a wrong lane mapping would put another row's fold into a row."""
    _matches_reference_over_64_steps(model, context, fold_shuffle=True)


@pytest.mark.skipif(not _hopper(), reason="the megakernel needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("context", [1, 1000, 8191])
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("mode", [0, 1])
def test_cluster_pairs_match_reference_over_64_steps(mode, model, context):
    """KernelConfig(cluster_qkv=0 | 1), beside the default 2 (asynchronous stores counted on the mate's barrier,
    which the default kernel's tests run): 0, ATTN_IN's parts join with tickets, no clusters; 1, launched in clusters of
    two, the parts swap their sums with remote stores and release arrivals and part 0 finishes the head
    (gpu/cluster.py); every launch runs one exchange a layer on each pair of CTAs holding a head, so both slots and
    both barrier phases turn over many times in 64 steps."""
    _matches_reference_over_64_steps(model, context, cluster_qkv=mode)


QUIET_CASES = [(m, 0, 1000) for m in MODELS] + [("llama-3.2-1b", 4, 8191), ("llama-3.1-8b", -1, 17)]


@pytest.mark.skipif(not _hopper(), reason="the megakernel needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("model,quiet,context", QUIET_CASES)
def test_release_hold_matches_reference_over_64_steps(model, quiet, context):
    """KernelConfig(quiet=N) beside the default 2 (which the default kernel's tests run): the loader holds a new
    stage's tiles past the N-th until compute's previous release (orchestration.py); a hold that let a tile overtake
    its slot's barriers, or that never ended, would differ or hang. -1: no hold (the previous default)."""
    _matches_reference_over_64_steps(model, context, quiet=quiet)


@pytest.mark.skipif(not _hopper(), reason="the megakernel needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("model,context", [("llama-3.2-1b", 1), ("llama-3.2-1b", 8191), ("smollm2-135m", 17)])
def test_whole_hbuf_matches_reference_over_64_steps(model, context):
    """KernelConfig(half_hbuf=False), beside the default (which the default kernel's tests run): the staging buffer
    sized for a whole DOWN_PROJ on models whose DOWN_PROJ runs in halves (the default before session 22; the 8B
    and Qwen3-8B stage whole DOWN_PROJs by default, KernelConfig.for_launch)."""
    _matches_reference_over_64_steps(model, context, half_hbuf=False)


@pytest.mark.skipif(not _hopper(), reason="the megakernel needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("model,context", [("llama-3.2-1b", 1), ("llama-3.2-1b", 1000), ("llama-3.2-1b", 8191),
                                           ("llama-3.1-8b", 17), ("qwen3-8b", 1000), ("smollm2-135m", 17)])
@pytest.mark.parametrize("merge", [True, False])
def test_attn_smem_merge_matches_reference_over_64_steps(model, context, merge):
    """KernelConfig.attn_smem_merge (the default since session 22; its six cases passed at d3137a7 as an opt-in):
    ATTN_PARTIAL's warps merge their online-softmax states through the staging buffer with one barrier
    (attention._merge_smem); a merge that read a state before its warp wrote it, or a staging that overwrote the
    states before they were read, would differ or not repeat. SmolLM2's 2 KB buffer does not hold the states: the
    kernel keeps Triton's merge there (KernelConfig.smem_merge). False: Triton's reductions over the warp axis
    (the default before)."""
    _matches_reference_over_64_steps(model, context, attn_smem_merge=merge)


@pytest.mark.skipif(not _hopper(), reason="the megakernel needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("model,context", [("smollm2-135m", 1000), ("llama-3.1-8b", 17)])
def test_release_hold_unmarked_matches_reference_over_64_steps(model, context):
    """KernelConfig(hold_marks=False): compute announces every signalling streaming release and the loader applies
    the hold's rule itself (sessions 17-20), beside the default's marks on the words (gpu/hold.py), which the default
    kernel's tests run."""
    _matches_reference_over_64_steps(model, context, hold_marks=False)


@pytest.mark.skipif(not _hopper(), reason="the megakernel needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("model,context,extra", [("smollm2-135m", 17, {"cluster_qkv": 0}), ("llama-3.2-1b", 1000, {}),
                                                 ("llama-3.1-8b", 8191, {}), ("qwen3-8b", 1000, {"quiet": 0}),
                                                 ("llama-3.2-1b", 17, {"warp_release": True})])
def test_hold_count_matches_reference_over_64_steps(model, context, extra):
    """KernelConfig(hold_count=True): the release hold waits for compute's count of its releases (a shared-memory
    word past Triton's: alone without clusters, before the per-warp releases' barriers with them) instead of an
    mbarrier's phase; only the timing may change, and a count that never reached its target would hang."""
    _matches_reference_over_64_steps(model, context, hold_count=True, **extra)


@pytest.mark.skipif(not _hopper(), reason="the megakernel needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("model,context", [("smollm2-135m", 1000), ("llama-3.2-1b", 8191), ("llama-3.1-8b", 17),
                                           ("qwen3-8b", 1000)])
def test_release_hold_ended_before_the_fence_matches_reference_over_64_steps(model, context):
    """KernelConfig(quiet_early=True): compute ends the hold once its outputs are stored, before the release's
    fence; the loader's requests then overlap the fence (only the timing may change, never a result)."""
    _matches_reference_over_64_steps(model, context, quiet_early=True)


@pytest.mark.skipif(not _hopper(), reason="the megakernel needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("model", ["llama-3.2-1b", "qwen3-8b"])
def test_release_hold_at_some_boundaries_matches_reference_over_64_steps(model):
    """KernelConfig(quiet_ops=...): the hold only into MLP_IN and DOWN_PROJ instructions."""
    _matches_reference_over_64_steps(model, 1000, quiet_ops=("MLP_IN", "DOWN_PROJ"))


@pytest.mark.skipif(not _hopper(), reason="the megakernel needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("model,context", [("smollm2-135m", 17), ("llama-3.2-1b", 1000), ("llama-3.1-8b", 8191)])
def test_deeper_in_flight_cap_for_some_ops_matches_reference_over_64_steps(model, context):
    """KernelConfig(inflight_deep=8, deep_ops=...): more tiles in flight for ATTN_IN, O_PROJ and DOWN_PROJ than for
    the other ops; the loader switches caps between instructions (only the timing may change, never a result)."""
    _matches_reference_over_64_steps(model, context, deep_ops=("ATTN_IN", "O_PROJ", "DOWN_PROJ"), inflight_deep=8)


@pytest.mark.skipif(not _hopper(), reason="the megakernel needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("model,context,clusters", [("smollm2-135m", 17, 2), ("llama-3.2-1b", 1000, 2),
                                                    ("llama-3.1-8b", 8191, 2), ("qwen3-8b", 1000, 2),
                                                    ("llama-3.2-1b", 1000, 0)])
def test_per_warp_releases_match_reference_over_64_steps(model, context, clusters):
    """KernelConfig(warp_release=True): each consumer warp hands a ring slot back on its own, on barriers in the
    dynamic shared memory past Triton's (with the cluster exchange region after them, or alone: cluster_qkv 0)."""
    _matches_reference_over_64_steps(model, context, warp_release=True, cluster_qkv=clusters)


@pytest.mark.skipif(not _hopper(), reason="the megakernel needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("model,context,extra", [("llama-3.2-1b", 1000, {"cluster_down": False}),
                                                 ("smollm2-135m", 17, {"cluster_down": False}),
                                                 ("llama-3.2-1b", 8191, {"cluster_qkv": 1}),
                                                 ("llama-3.2-1b", 17, {"warp_release": True})])
def test_down_proj_pairs_match_reference_over_64_steps(model, context, extra):
    """DOWN_PROJ's column halves of a row block on cluster mates (KernelConfig.cluster_down, the default: the
    reference tests run them on the 1B and SmolLM2) beside the kernels without them: the whole row blocks of the
    default until session 19, and cluster_qkv's mode 1, whose pairs keep DOWN_PROJ whole; and with the per-warp
    releases."""
    _matches_reference_over_64_steps(model, context, **extra)


@pytest.mark.skipif(not _hopper(), reason="the megakernel needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("model,context,extra", [("llama-3.2-1b", 1, {}), ("llama-3.2-1b", 1000, {"attn_row": False}),
                                                 ("llama-3.1-8b", 8191, {"attn_row": False}), ("qwen3-8b", 17, {}),
                                                 ("llama-3.2-1b", 17, {"qkv_in_attn": True}),
                                                 ("llama-3.2-1b", 17, {"qkv_in_attn": True, "attn_row": False}),
                                                 ("llama-3.2-1b", 17, {"flag_q": True, "flag_x": True})])
def test_attention_row_as_one_position_matches_reference_over_64_steps(model, context, extra):
    """KernelConfig.attn_row (the default since session 20): the split holding the step's row adds it as a block
    one position wide (at context 1 the only position); with the row from the cache, from the finished parts and
    from versioned words; and off (attn_row=False): the row as a masked 64-position block."""
    _matches_reference_over_64_steps(model, context, **extra)


@pytest.mark.skipif(not _hopper(), reason="the megakernel needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("model,context,extra", [("llama-3.2-1b", 1000, {"down_half_stage": False}),
                                                 ("llama-3.2-1b", 8191, {}), ("smollm2-135m", 17, {}),
                                                 ("llama-3.1-8b", 17, {}),
                                                 ("llama-3.2-1b", 17, {"attn_row": False, "down_half_stage": False})])
def test_down_half_stage_matches_reference_over_64_steps(model, context, extra):
    """KernelConfig.down_half_stage (the default since session 20): a DOWN_PROJ half stages only the act column
    tiles it multiplies (the 1B: one staging group of two; SmolLM2: both halves in one group; the 8B: no pairs,
    every group); and off: each half stages all of act (the default until session 20)."""
    _matches_reference_over_64_steps(model, context, **extra)


@pytest.mark.skipif(not _hopper(), reason="the megakernel needs a Hopper (sm_90) GPU")
def test_decoder_falls_back_to_tickets_where_the_clusters_do_not_all_fit(monkeypatch):
    """A GPU on which fewer clusters of two fit than the persistent kernel needs resident (patched here: none fit)
    gets the ticketed program with a warning, and decodes what the reference decodes; the cluster kernel, which would
    wait forever for CTAs that never start, is never launched."""
    from mimw.kv.pages import KVLayout, PagedKVCache
    from mimw.megakernel import isa
    from mimw.megakernel.gpu import cluster
    from mimw.megakernel.gpu.config import KernelConfig
    from mimw.megakernel.gpu.decoder import MegakernelDecoder
    from mimw.models.weights import random_weights

    spec = get_preset("smollm2-135m")
    assert KernelConfig.for_spec(spec).clusters() == 2  # the default would run in clusters
    monkeypatch.setattr(cluster, "max_active_clusters", lambda *a, **k: 0)
    cache = PagedKVCache(KVLayout.for_spec(spec, KernelConfig.for_spec(spec).page_size, 8, torch.bfloat16), "cuda")
    with pytest.warns(RuntimeWarning, match="0 clusters of two fit"):
        dec = MegakernelDecoder(random_weights(spec, 0, dtype=torch.bfloat16, device="cuda"), cache)
    assert dec.cluster_fallback and dec.kcfg.cluster_qkv == 0 and dec.ce["XB"] == 0
    assert not any(i.flags & isa.CLUSTER_PAIR for i in dec.program.instructions())
    with pytest.warns(RuntimeWarning, match="runs with tickets"):
        _matches_reference_over_64_steps("smollm2-135m", 1000)


O_PARTS = [("llama-3.2-1b", 8), ("llama-3.2-1b", 2), ("llama-3.1-8b", 8), ("qwen3-8b", 4)]


@pytest.mark.skipif(not _hopper(), reason="the megakernel needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("context", [1, 1000])
@pytest.mark.parametrize("model,parts", O_PARTS, ids=[f"{m}-p{p}" for m, p in O_PARTS])
def test_o_proj_in_column_parts_matches_reference_over_64_steps(model, parts, context):
    """KernelConfig(o_parts=N): no combining split; every O_PROJ block combines its KV groups' splits (one group a
    part, or several: a static loop) and stores its x part, part 0 with the residual; MLP_IN and DOWN_PROJ sum the
    parts (SmolLM2's 3-head groups are not a power of two: not served)."""
    _matches_reference_over_64_steps(model, context, o_parts=parts)


@pytest.mark.skipif(not _hopper(), reason="the megakernel needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("model", ["llama-3.2-1b", "qwen3-8b"])
def test_o_proj_in_column_parts_with_the_heads_finished_in_attention_matches_reference(model):
    """o_parts with qkv_in_attn (variant tr32-op8-qkvattn): a layer without a ticket."""
    _matches_reference_over_64_steps(model, 17, o_parts=8 if model == "llama-3.2-1b" else 4, qkv_in_attn=True)


@pytest.mark.skipif(not _hopper(), reason="the megakernel needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("versioned", ["act", "all", "probe"])
@pytest.mark.parametrize("context", [17, 1000])
@pytest.mark.parametrize("model", MODELS)
def test_versioned_words_match_reference_over_64_steps(model, context, versioned):
    """KernelConfig(flag_act=True[, flag_x, flag_attn, flag_q]): hops through versioned words (versioned.py);
    "probe": act, x and attn with the stagings probed one word in 16 (vprobe). Every launch starts from poisoned
    words (-1), so a reader that ran before its writer would spin forever, and one that took a stale word would
    differ from the reference or between repeats."""
    every, probe = versioned == "all", versioned == "probe"
    _matches_reference_over_64_steps(model, context, flag_act=True, flag_x=every or probe, flag_attn=every or probe,
                                     flag_q=every, vprobe=16 if probe else 1)


@pytest.mark.skipif(not _hopper(), reason="the megakernel needs a Hopper (sm_90) GPU")
def test_versioned_words_hold_their_last_writers_version_after_each_step():
    """After a step every versioned word carries the version of its buffer's last writer in that step (x: the last
    DOWN_PROJ, 2L; act, attn, q and the new K/V rows: layer L-1), read with the format's PyTorch reference
    (versioned.unpack): no word was skipped, none is stale, and every payload is finite."""
    import dataclasses

    from mimw.megakernel.gpu.check import random_cache
    from mimw.megakernel.gpu.config import KernelConfig
    from mimw.megakernel.gpu.decoder import MegakernelDecoder
    from mimw.megakernel.gpu.versioned import step_version, unpack
    from mimw.models.weights import random_weights

    spec = get_preset("smollm2-135m")
    kcfg = dataclasses.replace(KernelConfig.for_spec(spec), flag_act=True, flag_x=True, flag_attn=True, flag_q=True)
    cache, table = random_cache(spec, 40, 4, kcfg.page_size, 1)
    dec = MegakernelDecoder(random_weights(spec, 0, dtype=torch.bfloat16, device="cuda"), cache,
                            max_pages_per_seq=len(table), kcfg=kcfg, context_hint=40)
    L = spec.num_layers
    for i in range(3):
        dec.scratch.poison()  # every word back to -1, "never written"
        dec.step(5, 40 + i, table)
        torch.cuda.synchronize()
        epoch = int(dec.state.counters[-1]) - 1  # EPOCH moved on at the end of the step
        x = dec.scratch
        for name, words, n in (("x", x.x_words, 2 * L), ("act", x.act_words, L - 1), ("attn", x.attn_words, L - 1),
                               ("q", x.q_words, L - 1)):
            versions, values = unpack(words.cpu())
            assert (versions == step_version(epoch, n)).all(), (name, i, versions.unique())
            assert torch.isfinite(values).all(), (name, i)


@pytest.mark.skipif(not _hopper(), reason="the megakernel needs a Hopper (sm_90) GPU")
def test_traced_launch_stamps_every_tile_in_order_and_computes_the_same_logits():
    # the tile trace's host mirror (trace.tile_counts) must match the loader exactly, or stamps land out of bounds
    import dataclasses

    from mimw.megakernel.gpu.check import random_cache
    from mimw.megakernel.gpu.config import KernelConfig
    from mimw.megakernel.gpu.decoder import MegakernelDecoder
    from mimw.megakernel.gpu.trace import tile_counts
    from mimw.models.weights import random_weights

    spec = get_preset("llama-3.2-1b")
    w = random_weights(spec, 3, dtype=torch.bfloat16, device="cuda")
    kcfg = KernelConfig.for_spec(spec)
    logits = []
    for cfg in (kcfg, dataclasses.replace(kcfg, trace=True, trace_tiles=True)):
        cache, table = random_cache(spec, 100, 1, cfg.page_size, 4)
        dec = MegakernelDecoder(w, cache, max_pages_per_seq=len(table), kcfg=cfg, context_hint=100)
        logits.append(dec.step(7, 100, table).clone())
    assert torch.equal(logits[0], logits[1])  # tracing changes timing, never results
    t = dec.tiles.cpu()
    counts = [sum(c) for c in tile_counts(dec.program, kcfg.tile_rows, kcfg.tile_k)]
    for s, n in enumerate(counts):
        want, issued, c_want, c_has = t[s, :n].unbind(1)
        assert bool((want > 0).all()) and bool((want <= issued).all()) and bool((issued <= c_has).all())
        assert bool((c_want <= c_has).all())
        assert bool((t[s, n:] == 0).all())  # nothing stamped past this SM's tiles
    from mimw.megakernel import isa

    full = dec.trace.cpu()
    ins = full[..., :4]  # per instruction: start <= dependency met <= outputs stored <= signalled
    words = dec.words.cpu()
    for s, n in enumerate(dec.lens.cpu().tolist()):
        assert bool((ins[s, :n, 0] > 0).all()) and bool((ins[s, :n, :-1] <= ins[s, :n, 1:]).all())
        for i in range(n):  # ATTN_PARTIAL's phases: met <= block 0 <= later blocks <= partial stored <= stored
            if int(words[s, i, isa.Word.OP]) == isa.Op.ATTN_PARTIAL:
                ready, stored = int(full[s, i, 1]), int(full[s, i, 2])
                first, rest, part, ticket = full[s, i, 4:8].tolist()
                assert ready <= first <= rest <= part <= stored
                assert ticket == 0 or part <= ticket <= stored
