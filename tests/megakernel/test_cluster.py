"""The cluster probe (tools/cluster_probe.py): compiles for sm_90a on the CPU; on a Hopper GPU, the pair exchange through
distributed shared memory matches its reference and both join rounds are timed."""
import pytest
import torch

from mimw.megakernel.tools.cluster_probe import exchange_reference


def test_exchange_reference_swaps_pair_mates():
    ref = exchange_reference(4, 3)
    assert ref.tolist() == [[1000.0, 1001.0, 1002.0], [0.0, 1.0, 2.0], [3000.0, 3001.0, 3002.0],
                            [2000.0, 2001.0, 2002.0]]


def test_probe_compiles_to_distributed_shared_memory_and_cluster_barriers():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from mimw.megakernel.launch.compile import ptxas_report
    from mimw.megakernel.tools.cluster_probe import probe

    sig = {"out_ptr": "*fp32", "ns_ptr": "*i64", "cnt_ptr": "*i32", "region": "i32", "ITERS": "constexpr",
           "num_warps": "constexpr"}
    k = triton.compile(GluonASTSource(probe, sig, {"ITERS": 100, "num_warps": 4}), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4})
    ptx = k.asm["ptx"]
    assert "mapa.shared::cluster.u32" in ptx and "st.shared::cluster.f32" in ptx
    assert "barrier.cluster.arrive.release.aligned" in ptx and "barrier.cluster.wait.acquire.aligned" in ptx
    assert ".extern .shared .align 16 .b8 global_smem[]" in ptx  # the symbol the exchange region is addressed by
    assert k.metadata.shared > 0  # Triton's own shared memory: the region starts past it
    assert ptxas_report(ptx)["spill_stores"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                    reason="needs a Hopper (sm_90) GPU")
def test_pairs_exchange_through_distributed_shared_memory():
    from mimw.megakernel.tools.cluster_probe import run_probe

    r = run_probe(n_ctas=132, iters=200)
    assert r["exchange_ok"], r
    assert r["cluster_round_ns"] > 0 and r["ticket_round_ns"] > 0, r
    for c in (2, 4, 8):  # 220 KB: one CTA an SM, so at most sms / c clusters; fewer where a GPC's SMs do not divide
        assert 1 <= r[f"clusters_of_{c}_at_220kb"] <= r[f"clusters_of_{c}_at_213kb"] <= r[f"clusters_of_{c}_at_16kb"]
        assert c * r[f"clusters_of_{c}_at_220kb"] <= r["sms"], r
