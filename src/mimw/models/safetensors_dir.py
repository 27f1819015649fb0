"""Hugging Face checkpoint directories: ``config.json`` + ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``) <-> ``ModelWeights``.

Name map (layer ``N``; roles as in ``mimw.models.weights``):
  model.embed_tokens.weight -> embed            model.norm.weight -> final_norm
  lm_head.weight -> lm_head (absent, or ignored, when ``tie_word_embeddings``: lm_head *is* embed)
  model.layers.N.input_layernorm.weight -> attn_norm      model.layers.N.post_attention_layernorm.weight -> mlp_norm
  model.layers.N.self_attn.{q,k,v,o}_proj.weight -> wq, wk, wv, wo   (.bias -> bq, bk, bv for qwen2)
  model.layers.N.self_attn.{q,k}_norm.weight -> q_norm, k_norm (qwen3)
  model.layers.N.mlp.{gate,up,down}_proj.weight -> w_gate, w_up, w_down  (a dense MLP)
  model.layers.N.mlp.gate.weight -> router                              (an MoE layer, qwen3_moe)
  model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight -> e_gate[E], e_up[E], e_down[E]  (stacked over E)
The experts are stored one tensor per expert, as the Qwen3-MoE checkpoints on the Hub hold them and as transformers'
``save_pretrained`` writes them.

Invariants: every tensor the spec needs is present with exactly the shape ``expected_layer_shapes`` gives;
every tensor in the checkpoint is used (an unknown one means a feature mimw would silently drop, e.g. an
``o_proj.bias``), except buffers listed in ``_IGNORED``. Violations raise ``CheckpointError`` naming the tensor.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from .errors import CheckpointError, check_finite
from .spec import ModelSpec, SpecError
from .weights import LayerWeights, ModelWeights, expected_layer_shapes

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
LOADABLE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

LAYER_KEYS = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight",
    "router": "mlp.gate.weight",
}
EXPERT_KEYS = {"e_gate": "gate_proj.weight", "e_up": "up_proj.weight", "e_down": "down_proj.weight"}
_IGNORED = ("rotary_emb.inv_freq",)


@contextlib.contextmanager
def _open(file: Path) -> Iterator:
    """``safe_open`` with a truncated, corrupt or unreadable file reported as a ``CheckpointError`` naming it."""
    try:
        with safe_open(file, framework="pt") as f:
            yield f
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file (truncated or corrupt?): {e}") from None


def layer_tensor_names(spec: ModelSpec, layer: int) -> dict[str, list[str]]:
    """Role -> the HF tensor names that hold it in ``layer`` (one, or an expert role's one name per expert)."""
    out = {}
    for role in expected_layer_shapes(spec, layer):
        if role in EXPERT_KEYS:
            out[role] = [f"model.layers.{layer}.mlp.experts.{e}.{EXPERT_KEYS[role]}" for e in range(spec.num_experts)]
        else:
            out[role] = [f"model.layers.{layer}.{LAYER_KEYS[role]}"]
    return out


def hf_tensor_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name a checkpoint of ``spec`` must hold -> its shape."""
    v, d = spec.vocab_size, spec.hidden_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = (v, d)
    for n in range(spec.num_layers):
        shapes = expected_layer_shapes(spec, n)
        for role, names in layer_tensor_names(spec, n).items():
            for name in names:  # an expert role's tensor is one expert's: its stacked shape without the E axis
                out[name] = shapes[role][1:] if role in EXPERT_KEYS else shapes[role]
    return out


def spec_from_hf_dir(path: str | Path) -> ModelSpec:
    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf")) if path.is_dir() else []
        hint = f"; to load {ggufs[0]}, pass the .gguf file itself" if ggufs else ""
        raise CheckpointError(f"{path}: not a Hugging Face checkpoint directory (no config.json){hint}")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: invalid JSON ({e})") from None
    try:
        return ModelSpec.from_hf_config(cfg, name=path.resolve().name)
    except SpecError as e:
        raise CheckpointError(f"{cfg_path}: {e}") from None


def _tensor_files(path: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file that holds it."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a safetensors index (needs a 'weight_map'): {e}") from None
        files = {name: path / f for name, f in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise CheckpointError(f"{index}: lists shard {f.name}, which is missing from {path}")
        return files
    single = path / SINGLE_FILE
    if single.is_file():
        with _open(single) as f:
            return {name: single for name in f.keys()}
    other = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.gguf"))
    hint = f" (found {', '.join(other)}: only safetensors are read from a directory; pass a .gguf file directly)" \
        if other else ""
    raise CheckpointError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE}{hint}")


def load_hf_dir(path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                progress: bool = True) -> ModelWeights:
    """Read a checkpoint directory into ``ModelWeights`` in ``dtype`` on ``device``."""
    path = Path(path)
    spec = spec_from_hf_dir(path)
    files = _tensor_files(path)
    needed = hf_tensor_shapes(spec)
    for name in needed:
        if name not in files:
            raise CheckpointError(f"{path}: missing tensor {name!r} (required by {spec.arch} with "
                                  f"{spec.num_layers} layers per config.json)")
    unknown = [n for n in files if n not in needed and not n.endswith(_IGNORED)
               and not (n == "lm_head.weight" and spec.tie_word_embeddings)]
    if unknown:
        raise CheckpointError(f"{path}: unexpected tensor {unknown[0]!r} ({len(unknown)} unexpected in all); "
                              f"mimw's {spec.arch} has no such weight")

    tensors: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name in needed:
        by_file.setdefault(files[name], []).append(name)
    bar = tqdm(total=len(needed), desc=f"loading {path.name}", unit="tensor", disable=not progress, leave=False)
    for file, names in by_file.items():
        with _open(file) as f:
            held = set(f.keys())
            for name in names:
                if name not in held:
                    raise CheckpointError(f"{file}: does not hold tensor {name!r}, which {INDEX_FILE} places there")
                sl = f.get_slice(name)
                shape = tuple(sl.get_shape())
                if shape != needed[name]:
                    raise CheckpointError(f"{file}: tensor {name!r} has shape {list(shape)}, expected "
                                          f"{list(needed[name])} from config.json")
                t = f.get_tensor(name)
                if t.dtype not in LOADABLE_DTYPES:
                    raise CheckpointError(f"{file}: tensor {name!r} has dtype {t.dtype}; mimw reads bf16, fp16 "
                                          "and fp32 checkpoints (quantized safetensors are not supported)")
                check_finite(t, name, file)
                tensors[name] = t.to(device=device, dtype=dtype)
                bar.update()
    bar.close()

    layers = []
    for n in range(spec.num_layers):  # experts stacked layer by layer, their single tensors dropped as they go
        roles = layer_tensor_names(spec, n).items()
        layers.append(LayerWeights(**{role: torch.stack([tensors.pop(k) for k in names]) if role in EXPERT_KEYS
                                      else tensors[names[0]] for role, names in roles}))
    embed = tensors["model.embed_tokens.weight"]
    lm_head = embed if spec.tie_word_embeddings else tensors["lm_head.weight"]
    return ModelWeights(spec, embed, layers, tensors["model.norm.weight"], lm_head)


def save_hf_dir(weights: ModelWeights, path: str | Path, max_shard_bytes: int | None = None) -> Path:
    """Write ``weights`` as a HF checkpoint directory (config.json from ``spec.to_hf_config()``).

    One ``model.safetensors``, or shards of at most ``max_shard_bytes`` each plus ``model.safetensors.index.json``.
    Tied embeddings are written once (no ``lm_head.weight``), as transformers does."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    spec = weights.spec
    (path / "config.json").write_text(json.dumps(spec.to_hf_config(), indent=2))
    named = {"model.embed_tokens.weight": weights.embed, "model.norm.weight": weights.final_norm}
    if not spec.tie_word_embeddings:
        named["lm_head.weight"] = weights.lm_head
    for n, lw in enumerate(weights.layers):
        for role, names in layer_tensor_names(spec, n).items():
            t = getattr(lw, role)
            # one tensor per expert, each its own storage (safetensors refuses tensors that share memory)
            named.update(zip(names, [u.clone() for u in t.unbind(0)]) if role in EXPERT_KEYS else [(names[0], t)])
    named = {k: v.detach().cpu().contiguous() for k, v in named.items()}
    if max_shard_bytes is None:
        save_file(named, path / SINGLE_FILE, metadata={"format": "pt"})
        return path
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, t in named.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path / fname, metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in named.values())
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return path
