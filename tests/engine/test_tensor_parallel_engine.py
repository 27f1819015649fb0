"""Tensor-parallel serving on the reference backend (engine/backends/tensor_parallel.py): two gloo ranks on the
CPU, rank 0's engine leading, rank 1 following every step, give exactly the greedy tokens of the one-process
engine over the same weights, with prefix caching, chunked prefill and a batch of requests."""
import os
import tempfile

import torch
import torch.multiprocessing as mp

PROMPTS = [list(b"the tensor-parallel ranks"), list(b"the tensor-parallel ranks agree"), list(b"x" * 70)]


def _engine(backend):
    from engine_helpers import ByteTokenizer

    from mimw.engine.engine import Engine, EngineConfig

    return Engine(backend, ByteTokenizer(), EngineConfig(num_pages=64, page_size=8, max_batch=4, max_step_tokens=32))


def _generate(engine) -> dict[str, list[int]]:
    from engine_helpers import run_all

    from mimw.engine.sampling import SamplingParams

    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    events = run_all(engine)
    return {rid: [t for ev in evs for t in ev.token_ids] for rid, evs in events.items()}


def _rank(rank: int, size: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from mimw.engine.backends.tensor_parallel import Leader, TPReferenceBackend, control_group, follow
    from mimw.models.spec import get_preset
    from mimw.models.weights import random_weights

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    try:
        control = control_group()
        backend = TPReferenceBackend(random_weights(get_preset("tiny-llama"), seed=0))
        if rank == 0:
            leader = Leader(backend, control)
            tokens = _generate(_engine(leader))
            leader.close()
            torch.save(tokens, out)
        else:
            assert follow(backend, control) > 0
        dist.barrier()  # no rank tears its group down while another is still inside a collective with it
    finally:
        dist.destroy_process_group()


def test_two_ranks_give_the_one_process_engines_tokens(tiny_weights):
    from mimw.engine.backends.reference import ReferenceBackend

    want = _generate(_engine(ReferenceBackend(tiny_weights)))
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "tokens")
        mp.spawn(_rank, args=(2, f"file://{os.path.join(d, 'rdzv')}", out), nprocs=2, join=True)
        got = torch.load(out)
    assert got == want and all(len(t) == 12 for t in want.values())
