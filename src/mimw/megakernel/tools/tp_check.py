"""Tensor-parallel ranks of the megakernel against the whole model's fp32 reference (tools/check.py), and their
step time beside the one-GPU kernel's.

On one GPU (a plain process): for each model and rank count N, N ranks share the GPU (launch/tp.SharedGPUGroup,
each on num_sms / N SMs); their step time there says what the peer paths cost, not what N GPUs gain. Under torchrun
(one process a GPU, ``--ranks`` taken from the world size): every process runs its rank (launch/tp.DistributedRank),
rank 0 reports, and the step time is the tensor-parallel step against the one-GPU step on rank 0's GPU and against
the tensor-parallel PyTorch peer (bench/peers/tp_decoder.py: NCCL all-reduces, one CUDA graph a step). Each row:
the check's verdict and numbers, the median ms a step (every rank's step replayed from CUDA graphs, the host not
waiting between steps, as the one-GPU step's graph is), a table at the end, JSON to ``$OUT/tp_check.json`` when
$OUT is set.

    PYTHONPATH=src python -m mimw.megakernel.tools.tp_check --models llama-3.2-1b,llama-3.1-8b --ranks 2,4 --layers 4
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --nproc-per-node 2 -m mimw.megakernel.tools.tp_check --models llama-3.1-8b
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from ...bench.config import preset_spec
from ...bench.timing import time_steps
from ..launch.decoder import MegakernelDecoder
from ..launch.tp import DistributedRank, SharedGPUGroup
from ..tensor_parallel import TensorParallel, shard_cache
from .check import check_decode, random_cache


def step_ms(run) -> float:
    """Median ms of ``run()`` (one step), by bench.timing's CUDA events, after 5 warm-up steps."""
    return time_steps(run, torch.device("cuda"), max_steps=50, warmup=5).median_ms


def time_ranks(spec, ranks: int, context: int, distributed: bool) -> tuple[float, float, float]:
    """(one-GPU step ms, ``ranks``-rank step ms, the tensor-parallel PyTorch peer's step ms: NaN on one GPU) of one
    decode step at ``context``, random weights."""
    from ...bench.inputs import decode_inputs
    from ...bench.peers.graph import capture
    from ...bench.peers.tp_decoder import TPFusedDecoder
    from ...models.weights import random_weights

    w = random_weights(spec, 0, dtype=torch.bfloat16, device="cuda")
    cache, table = random_cache(spec, context, 8, 16, 1)
    one = MegakernelDecoder(w, cache, max_pages_per_seq=len(table), context_hint=context, use_graph=True)
    one_ms = step_ms(lambda: one.step(1, context, table))
    peer_ms = float("nan")
    if distributed:
        rank = torch.distributed.get_rank()
        tp = TensorParallel(spec, rank, ranks, one.plan.tuning.tile_rows)
        group = DistributedRank(w, shard_cache(cache, tp), max_pages_per_seq=len(table), context_hint=context)
        inputs = decode_inputs(spec, context, dtype=torch.bfloat16, device="cuda")
        peer = TPFusedDecoder(w, tp, cache_len=context + 1)
        peer.load_prefix(inputs)
        tok, pos = torch.tensor([inputs.token], device="cuda"), torch.tensor([context], device="cuda")
        graph, _ = capture(lambda: peer(tok, pos))
        peer_ms = step_ms(graph.replay)
    else:
        group = SharedGPUGroup(w, cache, ranks, max_pages_per_seq=len(table), context_hint=context)
    group.step(1, context, table)  # the inputs every timed step replays (its host wait and comparison untimed)
    return one_ms, step_ms(group.replay), peer_ms


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama-3.2-1b,llama-3.1-8b")
    ap.add_argument("--ranks", default="2", help="rank counts on one GPU (under torchrun: the world size)")
    ap.add_argument("--layers", type=int, default=4, help="the preset's first N layers (0: all)")
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args(argv)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.distributed.init_process_group("nccl")
        counts = [torch.distributed.get_world_size()]
    else:
        counts = [int(n) for n in args.ranks.split(",")]
    lead = not distributed or torch.distributed.get_rank() == 0
    rows = []
    for model in args.models.split(","):
        spec = preset_spec(model, args.layers)
        for n in counts:
            r = check_decode(spec, args.context, steps=args.steps, tp=n)
            one_ms, tp_ms, peer_ms = time_ranks(spec, n, args.context, distributed)
            row = dict(model=spec.name, ranks=n, where="gpus" if distributed else "one gpu", ok=r.ok(),
                       max_rel_err=r.max_rel_err, argmax_agree_or_tie=r.argmax_agree_or_tie,
                       bit_identical=r.bit_identical, tp_disagreements=r.tp_disagreements,
                       kv_rel_err=r.kv_rel_err, one_gpu_ms=one_ms, tp_ms=tp_ms, torch_tp_ms=peer_ms,
                       check=r.as_dict())
            rows.append(row)
            if lead:
                print(f"{spec.name} x{n} ({row['where']}): ok={row['ok']} err={r.max_rel_err:.2e} "
                      f"agree={r.argmax_agree_or_tie:.3f} same={r.bit_identical} ranks_differ={r.tp_disagreements} "
                      f"kv={r.kv_rel_err:.2e}  step {tp_ms:.3f} ms vs one GPU {one_ms:.3f} ms, "
                      f"torch TP {peer_ms:.3f} ms", flush=True)
    if lead:
        print("\n| model | ranks | where | ok | max err | argmax | ms a step | one GPU ms | ratio | torch TP ms |")
        print("|---|---:|---|---|---:|---:|---:|---:|---:|---:|")
        for x in rows:
            print(f"| {x['model']} | {x['ranks']} | {x['where']} | {x['ok']} | {x['max_rel_err']:.2e} | "
                  f"{x['argmax_agree_or_tie']:.3f} | {x['tp_ms']:.3f} | {x['one_gpu_ms']:.3f} | "
                  f"{x['tp_ms'] / x['one_gpu_ms']:.2f} | {x['torch_tp_ms']:.3f} |")
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "tp_check.json"), "w") as f:
                json.dump(rows, f, indent=1, default=str)
    if distributed:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
