"""What ``mimw bench serve`` sends: a ``Dataset`` turns into a list of ``BenchRequest``.

A dataset is anything with a ``name`` and ``requests(num, rng) -> list[BenchRequest]``; ``DATASETS`` maps a
``--dataset-name`` to a factory ``(args, tokenizer) -> Dataset``, so a new source (an agent-trace reader) plugs in
with one entry. A request may carry its own send time (``arrival_s``, a trace's timestamp): the load generator then
replays those times instead of drawing a request rate.

  random    synthetic: token-id prompts of ``--random-input-len`` tokens (uniform within
            ``--random-range-ratio`` of it), ``--random-output-len`` new tokens each (same spread), after a shared
            prefix of ``--random-prefix-len`` tokens; exact lengths, since the prompt goes to the server as ids.
  sharegpt  a ShareGPT-format JSON file (``--dataset-path``): a list of ``{"conversations": [{"from": "human",
            "value": ...}, {"from": "gpt", "value": ...}, ...]}``; each conversation's first human turn is a
            prompt and the reply's length in tokens its output length (or ``--sharegpt-output-len``). Too short (< 4
            tokens) or too long (prompt + output over ``--sharegpt-max-len``) pairs are skipped, as vLLM does.

Requests are generated with ``ignore_eos`` so that each produces exactly its output length.
"""
from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

MIN_LEN = 4  # ShareGPT pairs shorter than this (prompt or reply, in tokens) are skipped


@dataclass(frozen=True)
class BenchRequest:
    """One request: ``prompt`` is text or token ids; ``prompt_len`` its length in tokens as the dataset counted
    them; ``output_len`` the ``max_tokens`` sent; ``arrival_s`` the send time from the start of the run, or None
    to leave it to the request rate."""

    prompt: str | tuple[int, ...]
    prompt_len: int
    output_len: int
    arrival_s: float | None = None
    ignore_eos: bool = True


class Dataset(Protocol):
    name: str

    def requests(self, num: int, rng: random.Random) -> list[BenchRequest]: ...


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class RandomDataset:
    vocab_size: int
    input_len: int
    output_len: int
    range_ratio: float = 0.0
    prefix_len: int = 0
    name: str = "random"

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 1 or self.prefix_len < 0:
            raise ValueError("--random-input-len and --random-output-len must be >= 1, --random-prefix-len >= 0")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"--random-range-ratio must be in [0, 1), got {self.range_ratio}")

    def _len(self, mean: int, rng: random.Random) -> int:
        lo, hi = max(1, round(mean * (1 - self.range_ratio))), max(1, round(mean * (1 + self.range_ratio)))
        return rng.randint(lo, hi)

    def requests(self, num: int, rng: random.Random) -> list[BenchRequest]:
        prefix = tuple(rng.randrange(self.vocab_size) for _ in range(self.prefix_len))
        out = []
        for _ in range(num):
            n = self._len(self.input_len, rng)
            ids = prefix + tuple(rng.randrange(self.vocab_size) for _ in range(n))
            out.append(BenchRequest(ids, len(ids), self._len(self.output_len, rng)))
        return out


@dataclass(frozen=True)
class ShareGPTDataset:
    path: Path
    tokenizer: Any
    output_len: int | None = None
    max_len: int = 2048
    name: str = "sharegpt"

    def _pairs(self) -> list[tuple[str, str]]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"--dataset-path {self.path}: not a readable JSON file ({e})") from None
        if not isinstance(data, list):
            raise ValueError(f"--dataset-path {self.path}: expected a JSON list of conversations (ShareGPT format)")
        pairs = []
        for conv in data:
            turns = conv.get("conversations") if isinstance(conv, dict) else None
            if not isinstance(turns, list) or len(turns) < 2:
                continue
            first, reply = turns[0], turns[1]
            if not all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in (first, reply)):
                continue
            if first.get("from") in ("human", "user"):
                pairs.append((first["value"], reply["value"]))
        if not pairs:
            raise ValueError(f"--dataset-path {self.path}: no conversation with a human turn and a reply")
        return pairs

    def requests(self, num: int, rng: random.Random) -> list[BenchRequest]:
        pairs = self._pairs()
        rng.shuffle(pairs)
        out = []
        for prompt, reply in pairs:
            p = len(self.tokenizer.encode(prompt))
            o = self.output_len or len(self.tokenizer.encode(reply))
            if p < MIN_LEN or o < MIN_LEN or p + o > self.max_len:
                continue
            out.append(BenchRequest(prompt, p, o))
            if len(out) == num:
                break
        if len(out) < num:
            raise ValueError(f"--dataset-path {self.path}: only {len(out)} usable conversations for --num-prompts "
                             f"{num} (prompt and reply >= {MIN_LEN} tokens, together <= {self.max_len})")
        return out


def _random(args: argparse.Namespace, tok: Any, vocab_size: int) -> Dataset:
    return RandomDataset(vocab_size, args.random_input_len, args.random_output_len, args.random_range_ratio,
                         args.random_prefix_len)


def _sharegpt(args: argparse.Namespace, tok: Any, vocab_size: int) -> Dataset:
    if not args.dataset_path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path FILE.json")
    path = Path(args.dataset_path).expanduser()
    if not path.is_file():
        raise ValueError(f"--dataset-path {path}: no such file")
    return ShareGPTDataset(path, tok, args.sharegpt_output_len, args.sharegpt_max_len)


DATASETS: dict[str, Callable[[argparse.Namespace, Any, int], Dataset]] = {"random": _random, "sharegpt": _sharegpt}


def load_tokenizer(model: str | None) -> tuple[Any, int]:
    """The tokenizer and vocabulary size of what ``mimw serve --model MODEL`` serves, without loading weights:
    the checkpoint's tokenizer, or where it has none (presets) the server's UTF-8 byte fallback with the model's
    vocabulary."""
    from ..models.checkpoint import load_tokenizer as checkpoint_tokenizer

    tok, spec = checkpoint_tokenizer(model)
    if tok is None:
        from ..server.main import ByteTokenizer

        return ByteTokenizer(), spec.vocab_size
    return tok, spec.vocab_size
