"""DecodeBenchConfig: everything one ``mimw bench decode`` run needs, built once from the command line."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..models.spec import PRESETS, SpecError


@dataclass(frozen=True)
class DecodeBenchConfig:
    models: tuple[str, ...]           # preset names or checkpoint paths
    contexts: tuple[int, ...]         # KV positions already in the cache when the step runs
    backends: tuple[str, ...]         # names from mimw.bench.peers.BACKENDS, in run order
    out_dir: str = "bench/results"
    iters: int = 100                  # at most this many timed steps per backend (median reported)
    warmup: int = 3
    budget_s: float = 2.0             # timed steps are cut down to fit this many seconds per backend
    seed: int = 0
    dtype: str = "bfloat16"
    device: str = "cuda"
    backend_timeout_s: float = 300.0  # a backend silent this long (compile hang, deadlock) is killed, run continues
    in_process: bool = False          # run backends in this process (no crash isolation; for debugging and tests)
    megakernel: str = ""              # tuning overrides for mimw-megakernel, "NAME=VALUE,..." (megakernel/plan.py)
    kv_dtype: str = "bf16"            # mimw's KV cache: "bf16" (the run's dtype) or "fp8" (e4m3 + scales, mimw.kv)
    layers: int = 0                   # 0: each preset whole; N: its first N layers (real layer shapes, fewer layers)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def kv_torch_dtype(self) -> torch.dtype | None:
        """fp8's element type, or None: the cache holds the run's dtype (bf16, or fp32 in CPU tests)."""
        from ..kv.pages import parse_kv_dtype

        return parse_kv_dtype(self.kv_dtype) if self.kv_dtype == "fp8" else None

    def kv_bytes_per_token(self, spec) -> int | None:
        """KV bytes a position costs in the floor: fp8's (scales included), or None for the floor's default (bf16,
        whatever dtype a CPU test runs in)."""
        from ..kv.pages import KVLayout

        dt = self.kv_torch_dtype
        return None if dt is None else KVLayout.for_spec(spec, 16, 1, dt).bytes_per_token()

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "DecodeBenchConfig":
        d = json.loads(text)
        for k in ("models", "contexts", "backends"):
            d[k] = tuple(d[k])
        return cls(**d)


def parse_contexts(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise ValueError(f"--context: expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 0 for v in vals):
        raise ValueError(f"--context: expected non-negative integers, got {text!r}")
    return vals


def check_model(model: str) -> None:
    """Raise SpecError unless ``model`` is a preset name or an existing checkpoint path."""
    if model not in PRESETS and not Path(model).expanduser().exists():
        raise SpecError(f"--model {model!r}: not a preset ({', '.join(sorted(PRESETS))}) nor an existing path")


def model_label(model: str, layers: int = 0) -> str:
    """A file-name-safe name for a --model value (``layers``: cut to its first N layers, ``preset_spec``)."""
    name = model if model in PRESETS else (Path(model).expanduser().name or "model")
    if layers:
        name = f"{name}-first{layers}"
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name)


def preset_spec(model: str, layers: int = 0):
    """A preset's spec, or (``layers`` > 0) its first ``layers`` layers under the name ``<preset>-first<N>``: every
    layer at the real shape, the floor and the peers over the same layers (how a model whose weights and the
    megakernel's tile-major copy exceed one GPU's memory is measured, e.g. the 30B-A3B on an 80 GB H100)."""
    spec = PRESETS[model]
    if not layers:
        return spec
    if not 1 <= layers <= spec.num_layers:
        raise SpecError(f"--layers {layers}: {model} has {spec.num_layers} layers")
    return spec.with_(name=f"{spec.name}-first{layers}", num_layers=layers)
