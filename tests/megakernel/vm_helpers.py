"""What the VM tests (single-rank and tensor-parallel) share: a reference decoder with a prefilled paged cache, and
the relative error they bound."""
import random

import torch

from mimw.kv.pages import KVLayout, PagedKVCache
from mimw.models.reference import ReferenceDecoder, Segment


def prefill(spec, w, page_size: int, contexts: tuple[int, ...], new_tokens: int, seed: int,
            kv_dtype: torch.dtype = torch.float32):
    """Reference decoder + its cache holding each sequence's first ``contexts[s]`` tokens (random), a copy of that
    cache for the VM, each sequence's block table (shuffled pages, enough for ``new_tokens`` more) and the token
    generator: (spec, w, ref, ref_cache, cache, tables, generator). ``kv_dtype``: the caches' element type (fp8:
    the copy takes the scales too)."""
    per_seq = [-(-(c + new_tokens) // page_size) for c in contexts]
    layout = KVLayout.for_spec(spec, page_size, sum(per_seq) + 3, kv_dtype)
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
    cache = PagedKVCache(layout)
    for src, dst in zip(ref_cache.page_tensors(), cache.page_tensors()):
        dst.copy_(src)
    return spec, w, ref, ref_cache, cache, tables, g


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())
