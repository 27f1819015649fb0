"""``load_model``: the one entry point from a user's ``--model`` argument to a spec, weights and tokenizer.

Accepted:
  None                      the embedded default model (SmolLM2-135M-Instruct GGUF, see ``default_model``)
  a preset name             e.g. ``tiny-llama`` or ``llama-3.1-8b``: random weights (seeded), no tokenizer
  a directory               a Hugging Face checkpoint (config.json + safetensors), its tokenizer if present
  a ``.gguf`` file          a llama.cpp checkpoint, dequantized; its tokenizer if the file has one
Anything else raises ``CheckpointError`` listing these forms.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .default_model import default_gguf_path
from .errors import CheckpointError
from .safetensors_dir import load_hf_dir, spec_from_hf_dir
from .spec import PRESETS, ModelSpec
from .tokenizer import Tokenizer
from .weights import ModelWeights, random_weights

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(frozen=True)
class LoadedModel:
    """spec == weights.spec; ``tokenizer`` is None for presets (random weights) and tokenizer-less checkpoints;
    ``source`` says where it came from, for logs ("preset tiny-llama", a path)."""

    spec: ModelSpec
    weights: ModelWeights
    tokenizer: Tokenizer | None
    source: str


def load_model(name_or_path: str | Path | None = None, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", progress: bool = True, seed: int = 0) -> LoadedModel:
    """Load what ``name_or_path`` names (see the module docstring) in ``dtype`` on ``device``.

    ``seed`` only matters for presets (random weights)."""
    if name_or_path is None:
        return _load_gguf(default_gguf_path(), dtype, device, progress)
    key = str(name_or_path)
    if key in PRESETS:
        spec = PRESETS[key]
        return LoadedModel(spec, random_weights(spec, seed=seed, dtype=dtype, device=device), None,
                           f"preset {key} (random weights, seed {seed})")
    path = Path(key).expanduser()
    if path.is_dir():
        weights = load_hf_dir(path, dtype=dtype, device=device, progress=progress)
        tok = None
        if any((path / f).is_file() for f in _TOKENIZER_FILES):
            tok = Tokenizer.from_hf_dir(path, weights.spec.eos_token_ids)
        return LoadedModel(weights.spec, weights, tok, str(path))
    if path.suffix.lower() == ".gguf":
        return _load_gguf(path, dtype, device, progress)
    raise _not_a_model(key, path)


def _not_a_model(key: str, path: Path) -> CheckpointError:
    what = "does not exist" if not path.exists() else "is neither a directory nor a .gguf file"
    return CheckpointError(
        f"model {key!r} {what}. --model accepts: a Hugging Face checkpoint directory (config.json + "
        f"*.safetensors), a .gguf file, or a preset name for random weights ({', '.join(sorted(PRESETS))}); "
        "leave it out for the embedded default model (SmolLM2-135M-Instruct)")


def load_tokenizer(name_or_path: str | Path | None = None) -> tuple[Tokenizer | None, ModelSpec]:
    """The tokenizer (None where there is none: presets, tokenizer-less checkpoints) and the spec of what
    ``load_model`` would load, without reading the weights (benchmark clients need only these)."""
    if name_or_path is None:
        name_or_path = default_gguf_path()
    key = str(name_or_path)
    if key in PRESETS:
        return None, PRESETS[key]
    path = Path(key).expanduser()
    if path.is_dir():
        spec = spec_from_hf_dir(path)
        has = any((path / f).is_file() for f in _TOKENIZER_FILES)
        return (Tokenizer.from_hf_dir(path, spec.eos_token_ids) if has else None), spec
    if path.suffix.lower() == ".gguf":
        from .gguf_file import open_gguf, spec_from_gguf  # the gguf package only when a .gguf file is opened

        reader = open_gguf(path)
        spec = spec_from_gguf(reader)
        has = "tokenizer.ggml.tokens" in reader.fields
        return (Tokenizer.from_gguf(path, spec.eos_token_ids) if has else None), spec
    raise _not_a_model(key, path)


def _load_gguf(path: Path, dtype: torch.dtype, device: torch.device | str, progress: bool) -> LoadedModel:
    from .gguf_file import load_gguf, open_gguf  # the gguf package only when a .gguf file is opened

    reader = open_gguf(path)
    weights = load_gguf(path, dtype=dtype, device=device, progress=progress, reader=reader)
    tok = None
    if "tokenizer.ggml.tokens" in reader.fields:
        tok = Tokenizer.from_gguf(path, weights.spec.eos_token_ids)
    return LoadedModel(weights.spec, weights, tok, str(path))
