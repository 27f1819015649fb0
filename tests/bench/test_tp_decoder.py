"""The tensor-parallel PyTorch peer (bench/peers/tp_decoder.py): N gloo ranks on the CPU, each holding its shard,
give the whole model's logits (the reference decoder's, fp32) on every rank, bit-identical across ranks."""
import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp


def _rank(rank: int, size: int, name: str, init: str, out: str) -> None:
    import torch.distributed as dist

    from mimw.bench.inputs import decode_inputs
    from mimw.bench.peers.tp_decoder import TPFusedDecoder
    from mimw.megakernel.tensor_parallel import TensorParallel
    from mimw.models.spec import get_preset
    from mimw.models.weights import random_weights

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    try:
        spec = get_preset(name)
        w = random_weights(spec, seed=3)  # the same on every rank
        inputs = decode_inputs(spec, 21, seed=3, dtype=torch.float32, device="cpu")
        m = TPFusedDecoder(w, TensorParallel(spec, rank, size, 16), cache_len=32)
        m.load_prefix(inputs)
        with torch.no_grad():
            logits = m(torch.tensor([inputs.token]), torch.tensor([inputs.context]))
        torch.save(logits, f"{out}.{rank}")
        # no rank tears its group down while another is still inside a collective with it (gloo's threads then
        # abort the process: "terminate called without an active exception")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name,size", [("tiny-llama", 2), ("tiny-qwen3", 2)])
def test_ranks_give_the_whole_models_logits(name, size):
    from mimw.bench.inputs import decode_inputs, reference_logits
    from mimw.models.spec import get_preset
    from mimw.models.weights import random_weights

    spec = get_preset(name)
    with tempfile.TemporaryDirectory() as d:
        init, out = f"file://{os.path.join(d, 'rdzv')}", os.path.join(d, "logits")
        mp.spawn(_rank, args=(size, name, init, out), nprocs=size, join=True)
        got = [torch.load(f"{out}.{r}") for r in range(size)]
    inputs = decode_inputs(spec, 21, seed=3, dtype=torch.float32, device="cpu")
    ref = reference_logits(random_weights(spec, seed=3), inputs)
    assert got[0].shape == (1, spec.vocab_size)
    torch.testing.assert_close(got[0][0], ref, rtol=1e-4, atol=1e-4)
    assert all(torch.equal(got[0], g) for g in got[1:])  # every rank gathers the same logits
