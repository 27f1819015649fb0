"""A step's segments as the multi-token kernel runs them: one-token segments.

The GPU kernel's multi-token program (plan.plan) runs M one-token segments, each with its own position, context and
block table. A verify block (K consecutive tokens of one sequence, every one's logits wanted) runs as K such
segments that share the sequence's block table: token i sits at position p0 + i with context p0 + i + 1, and its
attention reads the rows of tokens 0..i-1, which their own segments' ATTN_IN finishers store in this same step
before attention's dependency is met. Each of them carries p0, the first position the step writes in the sequence
(state.seg_new), so that attention's prefetch, issued before that dependency, never reads those rows. A decode
token is the case K = 1. Per token, this computes exactly what decoding the block's tokens one after another does.

Attention's query blocks (program.StepShape.attn_blocks): the tokens of a segment of at least ``MIN_QUERY_BLOCK``
tokens run as one attention instruction per (block, KV head, split) in blocks of at most ``MAX_QUERY_BLOCK``
consecutive tokens (the padding too), each K/V block read once for all of the block's tokens
(ops/attn_partial.py); a decode token is a block of one, and so is each token of a shorter segment.

Buckets: a step of M tokens may be padded to N > M (the power of two at or above M) on a page no sequence owns
(``pad_page``); the padding stores its rows there, reads only there, and its logits are never asked for. A step
without query blocks (a decode batch, short verify blocks) pads with N - M one-token rows, each at position 0 of
that page, so that one program, one compiled kernel and one CUDA graph serve every such step of the bucket
(``MegakernelBackend.prepare`` captures it before serving); a step with query blocks pads with one more block at
positions 0 .. N - M - 1 (its layout of blocks is its own anyway).

Pure host logic (CPU-tested): ``split_segments`` maps segments to the kernel's per-token inputs and says which
logit rows the caller wants.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ...models.reference import Segment
from ..plan import MAX_QUERY_BLOCK, MIN_QUERY_BLOCK


@dataclass(frozen=True)
class OneTokenStep:
    positions: tuple[int, ...]  # each token's position (its one-token segment's start)
    block_tables: tuple[tuple[int, ...], ...]  # each token's sequence's block table
    firsts: tuple[int, ...]  # the first position the step writes in each token's sequence (state.seg_new)
    logit_rows: tuple[int, ...]  # the tokens whose logits the segments want, in segment order (Backend.forward)
    padding: int = 0  # tokens past the segments' (the last ones): their ids are the caller's to add (any id)
    blocks: tuple[int, ...] = ()  # attention's query blocks (StepShape.attn_blocks); () where every one is a token

    @property
    def num_tokens(self) -> int:
        return len(self.positions)


def query_blocks(lengths: Sequence[int], most: int = MAX_QUERY_BLOCK,
                 least: int = MIN_QUERY_BLOCK) -> tuple[int, ...]:
    """Runs of tokens ``lengths`` (segments', the padding's) cut into query blocks of at most ``most``, a run of
    fewer than ``least`` into blocks of one token; () where every block is one token (the program of a decode
    batch)."""
    out = tuple(b for n in lengths for b in ((1,) * n if n < least else
                                             (min(most, n - i) for i in range(0, n, most))))
    return out if any(b > 1 for b in out) else ()


def bucket_of(m: int) -> int:
    """The power of two at or above ``m``: the tokens of a padded step."""
    return 1 << (m - 1).bit_length()


def split_segments(segments: Sequence[Segment], pad_page: int | None = None, page_size: int = 16,
                   least: int = MIN_QUERY_BLOCK) -> OneTokenStep:
    """Segments (any lengths; tokens concatenated in segment order, as ``Backend.forward`` takes them) -> the
    one-token segments the kernel runs, token for token; with ``pad_page``, padded to ``bucket_of`` their tokens on
    that page. ``least`` (default ``MIN_QUERY_BLOCK``; the tests and tools pass 2 to run short blocks as blocks) is
    the fewest tokens of a query block. A step whose segments are all shorter (a decode batch, short verify blocks)
    pads with one-token rows, each at position 0 of the page (they write, and read, only its first row; what one
    reads another may have written: padding's logits are never read), so every such step of a bucket is one layout,
    the bucket's decode program (one plan, one CUDA graph); a step with a longer segment pads with rows at
    consecutive positions of the page, a sequence of its own (at most ``page_size`` of them; a query block where
    they are ``least`` or more), its layout its own anyway. Two segments must not write one sequence (a block table
    appears once): a sequence's block of this step is one segment."""
    positions, tables, firsts, rows = [], [], [], []
    seen = set()
    for s in segments:
        if s.length < 1 or not 0 <= s.num_logits <= s.length:
            raise ValueError(f"segment at {s.start}: length {s.length}, num_logits {s.num_logits}")
        table = tuple(s.block_table)
        if table in seen:
            raise ValueError("two segments of one step write the same sequence: give its tokens as one segment")
        seen.add(table)
        t0 = len(positions)
        positions.extend(range(s.start, s.start + s.length))
        tables.extend([table] * s.length)
        firsts.extend([s.start] * s.length)
        rows.extend(range(t0 + s.length - s.num_logits, t0 + s.length))
    pad = bucket_of(len(positions)) - len(positions) if pad_page is not None else 0
    single = all(s.length < least for s in segments)  # no query block: padding rows, not a block
    if pad > page_size and not single:
        raise ValueError(f"{len(positions)} tokens pad by {pad}, more than one page of {page_size} rows")
    if pad and (pad_page,) in seen:
        raise ValueError(f"page {pad_page} is the padding's, not a sequence's")
    positions.extend([0] * pad if single else range(pad))
    tables.extend([(pad_page,)] * pad)
    firsts.extend([0] * pad)
    blocks = query_blocks([s.length for s in segments] + ([1] * pad if single else [pad] if pad else []),
                          least=least)
    return OneTokenStep(tuple(positions), tuple(tables), tuple(firsts), tuple(rows), pad, blocks)


__all__ = ["MAX_QUERY_BLOCK", "OneTokenStep", "bucket_of", "query_blocks", "split_segments"]
