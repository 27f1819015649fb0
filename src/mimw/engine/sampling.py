"""Sampling: per-request parameters, the logits processors, and the pure functions that turn rows of logits into
the sampling distribution and into token ids.

API (all the serving engine and the speculative decoder need):
  ``SamplingParams``          frozen, validated at construction (``ValueError`` naming the field).
  ``TokenContext``            what the processors read about a row: its prompt, its outputs so far, its grammar's
                              packed allowed-token bitmask.
  ``distribution(x, ps, cs)`` logits [B, V] -> the final per-token sampling distribution [B, V] (fp32, on the
                              logits' device) after every processor: THE definition of what a row samples from.
  ``sample_ids(x, ps, us, cs, argmax)``    logits [B, V] -> token ids [B] on the logits' device (u: one uniform a
                              row; ``argmax``: the greedy rows' pick, default torch.argmax; the engine's is
                              ``argmax.DeviceArgmax``, one kernel launch).
  ``sample_batch(x, ps, gs, cs)``  the same, with uniforms from the generators, read back: B token ids.
  ``draw_uniforms(ps, gs)``   the uniforms ``sample_ids`` takes, one from each non-greedy row's generator.
  ``make_generator(p)``       the request's own ``torch.Generator`` (CPU), seeded from ``p.seed``; ``None`` if greedy.
  ``sample(logits, p, g)``    one row without context (``mimw generate``).

Processors, in order (vLLM's order), all applied per row on the logits' device in fp32, batched over the rows
that use them:
  1. the grammar mask (tokens outside the allowed set get -inf);
  2. ``logit_bias`` (added to the logits);
  3. ``repetition_penalty`` over prompt + output tokens (positive logits divided by it, negative multiplied),
     then ``frequency_penalty`` x count and ``presence_penalty`` x (count > 0) over output tokens, subtracted;
  4. temperature; greedy rows (temperature 0) stop here: their distribution is one-hot at the argmax;
  5. ``min_p`` (drop tokens whose probability is below min_p x the top probability), ``top_k``, ``top_p``
     (keep the smallest most-likely-first prefix whose mass reaches top_p; the most likely token always stays);
     renormalise.

Invariants:
  * temperature == 0 is greedy: ``argmax`` of the processed logits (lowest id on ties); no generator is used.
  * Each sampled token takes one uniform from the request's own CPU generator (advanced once per sampled token)
    and is drawn on the logits' device by the inverse CDF (``sample_ids``), so concurrent requests never share
    random state and a (seed, distribution) pair always gives the same tokens on a given device; each row's
    distribution depends only on that row's logits, params and context, never on its batch.
"""
from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from ..pinned import to_device
from .argmax import argmax_torch

MAX_LOGPROBS = 20  # alternatives per position that a request may ask for (OpenAI's chat limit)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request, what to report about them, and when to stop.

    temperature: >= 0; 0 means greedy.           top_p: in (0, 1]; 1 disables nucleus filtering.
    top_k: >= 0; 0 disables top-k filtering.      min_p: in [0, 1]; 0 disables it.
    seed: None draws a fresh random seed per request.
    presence_penalty, frequency_penalty: in [-2, 2] (OpenAI's range), over the generated tokens.
    repetition_penalty: > 0 (1 disables it), over prompt and generated tokens.
    logit_bias: (token id, bias in [-100, 100]) pairs; a mapping is accepted and stored sorted by id.
    logprobs: None, or how many most likely alternatives (0..20) to report with each generated token's logprob.
    prompt_logprobs: None, or the same for every prompt token after the first (forces the prompt to be computed,
    no prefix reuse).
    grammar: a compiled grammar (``mimw.engine.grammar.Grammar``) the output must match, or None.
    max_tokens: new tokens at most; 0 computes the prompt only (prompt logprobs).   stop: strings that end generation (not included in the output).
    stop_token_ids: extra token ids that end generation (the model's EOS ids are added by the engine unless
    ``ignore_eos``).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: Any = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Accept lists / a single string / a mapping at the edge, store tuples (hashable, immutable).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        bias = self.logit_bias or ()
        items = bias.items() if isinstance(bias, Mapping) else bias
        try:
            object.__setattr__(self, "logit_bias", tuple(sorted((k, v) for k, v in items)))
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}") from None

        _number(self.temperature, "temperature", lo=0.0)
        p = self.top_p
        if not _is_num(p) or not (0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        _number(self.min_p, "min_p", lo=0.0, hi=1.0)
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        _number(self.presence_penalty, "presence_penalty", lo=-2.0, hi=2.0)
        _number(self.frequency_penalty, "frequency_penalty", lo=-2.0, hi=2.0)
        rp = self.repetition_penalty
        if not _is_num(rp) or not math.isfinite(rp) or rp <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 disables it), got {rp!r}")
        for k, v in self.logit_bias:
            if not _is_int(k) or k < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {k!r}")
            _number(v, "logit_bias values", lo=-100.0, hi=100.0)
        if len({k for k, _ in self.logit_bias}) != len(self.logit_bias):
            raise ValueError("logit_bias names a token id twice")
        for f in ("logprobs", "prompt_logprobs"):
            n = getattr(self, f)
            if n is not None and (not _is_int(n) or not 0 <= n <= MAX_LOGPROBS):
                raise ValueError(f"{f} must be None or an integer in [0, {MAX_LOGPROBS}], got {n!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            raise ValueError(f"max_tokens must be an integer >= 1 (0: compute the prompt only), got "
                             f"{self.max_tokens!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        for i in self.stop_token_ids:
            if not _is_int(i) or i < 0:
                raise ValueError(f"stop_token_ids must be integers >= 0, got {i!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def has_processors(self) -> bool:
        """Whether anything but temperature / top-k / top-p / min-p shapes this request's distribution."""
        return self.has_penalties or bool(self.logit_bias) or self.grammar is not None


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _number(x: object, name: str, lo: float, hi: float | None = None) -> None:
    if not _is_num(x) or not math.isfinite(x) or x < lo or (hi is not None and x > hi):
        rng = f"in [{lo:g}, {hi:g}]" if hi is not None else f">= {lo:g}"
        raise ValueError(f"{name} must be a finite number {rng}, got {x!r}")


@dataclass(frozen=True)
class TokenContext:
    """What the processors read about one row: the request's prompt and generated tokens (penalties) and the
    packed bitmask of the tokens its grammar allows next (int32 [ceil(V / 32)], bit i of word w = token
    32 w + i; None: no grammar)."""

    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    allowed: torch.Tensor | None = None


_NO_CONTEXT = TokenContext()


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """The request's private CPU generator (None when greedy). Seeded from ``params.seed``, else randomly."""
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    return torch.Generator(device="cpu").manual_seed(seed % (2**64))


# --- processors -----------------------------------------------------------------------------------------------
def process_logits(logits: torch.Tensor, params: Sequence[SamplingParams],
                   contexts: Sequence[TokenContext]) -> torch.Tensor:
    """Steps 1-3 of the module docstring: logits [B, V] -> fp32 [B, V] on the same device (a new tensor)."""
    x = logits.detach().float().clone()
    B, V = x.shape
    dev = x.device
    masked = [b for b in range(B) if contexts[b].allowed is not None]
    if masked:
        words = torch.stack([contexts[b].allowed for b in masked]).to(dev, torch.int32)  # [M, W]
        ids = torch.arange(V, device=dev)
        allowed = (words[:, ids >> 5] >> (ids & 31)) & 1  # [M, V]
        rows = on_device(masked, torch.long, dev)
        x[rows] = x[rows].masked_fill(allowed == 0, float("-inf"))
    biased = [(b, t, v) for b, p in enumerate(params) for t, v in p.logit_bias if t < V]
    if biased:
        r, t, v = zip(*biased)
        x.index_put_((on_device(r, torch.long, dev), on_device(t, torch.long, dev)), on_device(v, x.dtype, dev),
                     accumulate=True)
    pen = [b for b, p in enumerate(params) if p.has_penalties]
    if pen:
        _apply_penalties(x, pen, params, contexts)
    return x


def _apply_penalties(x: torch.Tensor, rows: Sequence[int], params: Sequence[SamplingParams],
                     contexts: Sequence[TokenContext]) -> None:
    """Step 3 in place on x [B, V], touching only the ids in each row's history (sparse: O(history), not O(V))."""
    V, dev = x.shape[1], x.device
    seen_r, seen_c, seen_p = [], [], []  # repetition penalty: ids in prompt or output
    out_r, out_c, out_n, out_f, out_p = [], [], [], [], []  # frequency / presence: ids in output, with counts
    for b in rows:
        p, ctx = params[b], contexts[b]
        out = torch.as_tensor(list(ctx.output_ids), dtype=torch.long)
        ids, counts = torch.unique(out[out < V], return_counts=True)
        if p.frequency_penalty != 0 or p.presence_penalty != 0:
            out_r.append(torch.full_like(ids, b))
            out_c.append(ids)
            out_n.append(counts)
            out_f.append(torch.full(ids.shape, float(p.frequency_penalty)))
            out_p.append(torch.full(ids.shape, float(p.presence_penalty)))
        if p.repetition_penalty != 1:
            prompt = torch.as_tensor(list(ctx.prompt_ids), dtype=torch.long)
            seen = torch.unique(torch.cat([prompt[prompt < V], ids]))
            seen_r.append(torch.full_like(seen, b))
            seen_c.append(seen)
            seen_p.append(torch.full(seen.shape, float(p.repetition_penalty)))
    if seen_r:
        r, c = torch.cat(seen_r).to(dev), torch.cat(seen_c).to(dev)
        rep = torch.cat(seen_p).to(dev, x.dtype)
        v = x[r, c]
        x[r, c] = torch.where(v > 0, v / rep, v * rep)
    if out_r:
        r, c = torch.cat(out_r).to(dev), torch.cat(out_c).to(dev)
        n = torch.cat(out_n).to(dev, x.dtype)
        x[r, c] -= torch.cat(out_f).to(dev, x.dtype) * n + torch.cat(out_p).to(dev, x.dtype)


def _filter(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Steps 4-5 for non-greedy rows: processed logits [B, V] -> probabilities [B, V] (zeros outside the kept
    set), on the logits' device."""
    dev = x.device
    # Each row's top logit becomes 0 before the division, so a tiny temperature sends the others to -inf, never the
    # top one to inf (inf - inf = NaN); below fp32's smallest normal the temperature is that number (same argmax set).
    x = x - x.max(dim=-1, keepdim=True).values
    tiny = torch.finfo(torch.float32).tiny
    # every decision below is taken from the params on the host: no value is read back from the device
    temp = on_device([max(p.temperature, tiny) for p in params], x.dtype, dev)[:, None]
    probs = torch.softmax(x / temp, dim=-1)
    if any(p.min_p > 0 for p in params):
        min_p = on_device([p.min_p for p in params], x.dtype, dev)[:, None]
        probs = torch.where(probs >= min_p * probs.max(dim=-1, keepdim=True).values, probs, 0.0)
    V = x.shape[1]
    top_k = [p.top_k if 0 < p.top_k < V else V for p in params]
    if min(top_k) < V or any(p.top_p < 1 for p in params):
        top_p = on_device([p.top_p for p in params], x.dtype, dev)[:, None]
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)  # ties keep the lower id first
        rank = torch.arange(V, device=dev)[None, :]
        keep = rank < on_device(top_k, torch.long, dev)[:, None]
        # keep token j iff the mass strictly before it is < top_p (so the most likely token always stays)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        keep &= (before < top_p) | (top_p >= 1)
        keep[:, 0] = True
        probs = torch.zeros_like(probs).scatter_(1, order, torch.where(keep, sorted_p, 0.0))
    return probs / probs.sum(dim=-1, keepdim=True)


def _needs_processing(params: Sequence[SamplingParams], contexts: Sequence[TokenContext]) -> bool:
    return any(p.has_processors for p in params) or any(c.allowed is not None for c in contexts)


def _check(logits: torch.Tensor, params: Sequence[SamplingParams], others: Sequence[Any], what: str) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(others):
        raise ValueError(f"sampling: logits {tuple(logits.shape)} vs {len(params)} params, {len(others)} {what}")


def distribution(logits: torch.Tensor, params: Sequence[SamplingParams],
                 contexts: Sequence[TokenContext] | None = None) -> torch.Tensor:
    """THE per-token sampling distribution: logits [B, V] -> fp32 probabilities [B, V] on the logits' device,
    after every processor; one-hot at the argmax for greedy rows. ``sample_batch`` draws from exactly this.

    For positions inside a speculative draft block, row j's context must hold the draft tokens before j in
    ``output_ids`` (penalties) and the grammar's mask after them; ``grammar.GrammarMatcher`` cannot roll back, so
    a request with a grammar is not speculated unless the matcher learns to."""
    contexts = contexts if contexts is not None else [_NO_CONTEXT] * len(params)
    _check(logits, params, contexts, "contexts")
    x = process_logits(logits, params, contexts) if _needs_processing(params, contexts) else logits.float()
    out = torch.zeros_like(x)
    hot = [b for b, p in enumerate(params) if p.greedy]
    if hot:
        out[hot] = torch.nn.functional.one_hot(torch.argmax(x[hot], dim=-1), x.shape[1]).to(out.dtype)
    rest = [b for b, p in enumerate(params) if not p.greedy]
    if rest:
        out[rest] = _filter(x[rest], [params[b] for b in rest])
    return out


def draw_uniforms(params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]) -> list[float]:
    """One uniform in [0, 1) per non-greedy row from its request's generator (advanced once), 0.0 for greedy
    rows. The draw does not depend on the logits, so the overlapped engine takes it before the step has run."""
    if any(generators[b] is None for b, p in enumerate(params) if not p.greedy):
        raise ValueError("non-greedy sampling needs the request's generator (make_generator(params))")
    return [0.0 if p.greedy else float(torch.rand((), generator=g)) for p, g in zip(params, generators)]


def sample_ids(logits: torch.Tensor, params: Sequence[SamplingParams], uniforms: Sequence[float],
               contexts: Sequence[TokenContext] | None = None,
               argmax: Callable[[torch.Tensor], torch.Tensor] = argmax_torch) -> torch.Tensor:
    """logits [B, V] -> int64 token ids [B] on the logits' device, without reading anything back to the host.

    Greedy rows: ``argmax`` of the processed logits (torch.argmax's pick). The others: the inverse CDF of their
    ``distribution`` row at ``uniforms[b]`` (the first token whose cumulative probability exceeds u x total, so a
    token of probability 0 is never drawn); -1 where that row has no valid distribution (NaN or infinite logits,
    nothing allowed)."""
    contexts = contexts if contexts is not None else [_NO_CONTEXT] * len(params)
    _check(logits, params, contexts, "contexts")
    _check(logits, params, uniforms, "uniforms")
    x = process_logits(logits, params, contexts) if _needs_processing(params, contexts) else logits
    rest = [b for b, p in enumerate(params) if not p.greedy]
    ids = argmax(x) if len(rest) < len(params) else None
    if rest:
        dev, V = x.device, x.shape[1]
        whole = len(rest) == len(params)
        index = None if whole else on_device(rest, torch.long, dev)
        probs = _filter((x if whole else x.index_select(0, index)).float(), [params[b] for b in rest])
        cdf = torch.cumsum(probs, dim=-1)
        total = cdf[:, -1:]
        target = on_device([uniforms[b] for b in rest], cdf.dtype, dev)[:, None] * total
        pick = torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=V - 1)
        pick = torch.where(torch.isfinite(total[:, 0]) & (total[:, 0] > 0), pick, -1)
        if ids is None:
            ids = pick
        else:
            ids.index_copy_(0, index, pick)
    assert ids is not None
    return ids


def sample_batch(logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None],
                 contexts: Sequence[TokenContext] | None = None) -> list[int]:
    """logits [B, V] -> B token ids; row b uses ``params[b]``, ``generators[b]`` and ``contexts[b]``:
    ``sample_ids`` with a uniform from each generator, read back (one host sync for the batch). A row without a
    valid distribution raises ``ValueError``."""
    _check(logits, params, generators, "generators")
    out = sample_ids(logits, params, draw_uniforms(params, generators), contexts).tolist()
    bad = [b for b, t in enumerate(out) if t < 0]
    if bad:
        raise ValueError(f"row {bad[0]} has no valid sampling distribution (NaN or infinite logits, or no token "
                         "allowed)")
    return out


def on_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on ``device`` (on a GPU without waiting for the work already queued:
    ``pinned.to_device``)."""
    return to_device(torch.tensor(list(values), dtype=dtype), device)


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [V] -> fp32 CPU probabilities [V] after temperature, min-p, top-k and top-p (no context)."""
    return distribution(logits[None], [params])[0].cpu()


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from logits [V] without context. ``generator`` comes from ``make_generator(params)``."""
    if logits.dim() != 1:
        raise ValueError(f"sample expects logits of shape [vocab], got {tuple(logits.shape)}")
    return sample_batch(logits[None], [params], [generator])[0]
