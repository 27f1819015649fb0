"""Tokenizer + chat template: a thin wrapper over a Hugging Face fast tokenizer, built offline.

Sources: a HF checkpoint directory (``tokenizer.json`` & co.) or a GGUF file's ``tokenizer.ggml.*`` metadata
(transformers converts it to a fast tokenizer). Both are read with ``local_files_only=True``: building a tokenizer
never touches the model hub.

Streaming detokenisation (text deltas that never split a multi-byte character) is ``mimw.engine.detokenize``.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Sequence

from .errors import CheckpointError


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's table (GPT-2's): the printable character each byte is written as -> that byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in printable}
    extra = 256
    for b in range(256):
        if b not in chars:
            chars[b] = extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


class Tokenizer:
    """encode / decode / chat template over a HF tokenizer. ``eos_token_ids``: every id that ends a turn
    (the tokenizer's EOS plus the model's, e.g. Llama 3's <|eot_id|> from generation_config.json)."""

    def __init__(self, hf: Any, eos_token_ids: Sequence[int] = (), source: str = ""):
        self.hf = hf
        ids = [i for i in (*eos_token_ids, hf.eos_token_id) if i is not None]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in ids))
        self.source = source

    @classmethod
    def from_hf_dir(cls, path: str | Path, eos_token_ids: Sequence[int] = ()) -> "Tokenizer":
        from transformers import AutoTokenizer

        path = Path(path)
        try:
            hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as e:  # transformers raises OSError/ValueError/... depending on what is missing
            raise CheckpointError(f"{path}: cannot build a tokenizer ({type(e).__name__}: {e})") from None
        gen = path / "generation_config.json"
        extra: list[int] = []
        if gen.is_file():
            try:
                eos = json.loads(gen.read_text()).get("eos_token_id")
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
                raise CheckpointError(f"{gen}: not a JSON object ({e})") from None
            extra = list(eos) if isinstance(eos, list) else ([eos] if eos is not None else [])
        return cls(hf, [*eos_token_ids, *extra], source=str(path))

    @classmethod
    def from_gguf(cls, path: str | Path, eos_token_ids: Sequence[int] = ()) -> "Tokenizer":
        # PreTrainedTokenizerFast reads only the tokenizer metadata; AutoTokenizer would also parse the model
        # config from the GGUF (several seconds more for the same tokenizer).
        from transformers import PreTrainedTokenizerFast

        path = Path(path)
        try:
            hf = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name,
                                                         local_files_only=True)
        except Exception as e:
            raise CheckpointError(f"{path}: cannot build a tokenizer from the GGUF metadata "
                                  f"({type(e).__name__}: {e})") from None
        return cls(hf, eos_token_ids, source=str(path))

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (base vocabulary plus added tokens)."""
        return len(self.hf)

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        """The exact bytes each token stands for (byte-level BPE pieces mapped back to bytes; special tokens
        and other vocabularies: the UTF-8 of the token decoded alone)."""
        pieces = self.hf.convert_ids_to_tokens(list(ids))
        table = _byte_decoder()
        special = frozenset(self.hf.all_special_ids)
        out = []
        for i, piece in zip(ids, pieces):
            if piece is None:  # an id past the tokenizer's vocabulary (padding rows of the model's)
                out.append(b"")
            elif i not in special and all(c in table for c in piece):
                out.append(bytes(table[c] for c in piece))
            else:
                out.append(self.hf.decode([i]).encode())
        return out

    @property
    def chat_template(self) -> str:
        """The chat template's source ("" without one): what tool-call format the model was taught."""
        t = getattr(self.hf, "chat_template", None)
        return t if isinstance(t, str) else ""

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of ``messages`` ([{"role": ..., "content": ...}, ...]) rendered by the model's chat template,
        ending with the assistant prompt when ``add_generation_prompt``; ``tools`` (OpenAI tool definitions) are
        handed to the template, which lists them the way the model was trained to read them."""
        if not self.has_chat_template:
            raise ValueError(f"{self.source or 'this tokenizer'} has no chat template; use a plain prompt")
        text = self.hf.apply_chat_template(list(messages), tokenize=False, tools=list(tools) if tools else None,
                                           add_generation_prompt=add_generation_prompt)
        # The template writes any BOS itself, so no special tokens are added here.
        return self.encode(text, add_special_tokens=False)
