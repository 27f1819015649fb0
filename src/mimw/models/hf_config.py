"""A Hugging Face ``config.json`` -> ``ModelSpec``, field by field: what mimw computes, what it refuses.

Every field of transformers' ``LlamaConfig``, ``Qwen2Config`` and ``Qwen3Config`` was checked against the
modeling code that reads it. A field that changes the model's math is either read into the spec or refused with a
``SpecError`` naming it; none is ignored silently.

  read        vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
              num_key_value_heads, head_dim, rms_norm_eps, rope_theta, rope_scaling / rope_parameters of type
              default, linear or llama3, max_position_embeddings, tie_word_embeddings, bos/eos_token_id
  refused     hidden_act other than silu (swish is the same function); attention_bias (Llama: q/k/v/o biases;
              Qwen3: the same); mlp_bias (Llama); rope types dynamic, yarn, longrope and any other;
              partial_rotary_factor other than 1; sliding-window attention on a layer where the window is shorter
              than the context; layer types other than full and sliding attention; quantization_config
  no effect   pretraining_tp (transformers 5 ignores it; older versions split each matmul into slices whose sum
              is the same product), attention_dropout (training only), initializer_range, use_cache,
              pad_token_id, torch_dtype / dtype, max_window_layers without a sliding window

Qwen2 always has q/k/v biases and no o_proj bias (its config has no bias field). Fields absent from the file take
transformers' defaults for the architecture (its dataclass defaults), e.g. Qwen3's head_dim is 128 and Qwen2/Qwen3
default to 32 KV heads: a hand-written config then means what it means to transformers.
"""
from __future__ import annotations

from typing import Any, Mapping

from .spec import ARCHS, HF_ARCHS, Llama3RopeScaling, LinearRopeScaling, ModelSpec, SpecError

_SILU = ("silu", "swish")  # transformers' ACT2FN maps both to SiLU
# transformers' defaults for absent fields, per architecture
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"num_key_value_heads": None, "head_dim": None, "max_position_embeddings": 2048},
    "qwen2": {"num_key_value_heads": 32, "head_dim": None, "max_position_embeddings": 32768},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768},
}
_DEFAULT_THETA = 10000.0


def spec_from_hf_config(cfg: Mapping[str, Any], name: str | None = None) -> ModelSpec:
    arch = _arch(cfg)
    defaults = _DEFAULTS[arch]

    def req(key: str) -> Any:
        if key not in cfg:
            raise SpecError(f"config.json: missing required field {key!r}")
        return cfg[key]

    _refuse_unsupported(cfg, arch)
    n_heads = int(req("num_attention_heads"))
    d = int(req("hidden_size"))
    head_dim = cfg.get("head_dim", defaults["head_dim"]) or d // n_heads
    n_kv = cfg.get("num_key_value_heads", defaults["num_key_value_heads"]) or n_heads
    max_pos = int(cfg.get("max_position_embeddings", defaults["max_position_embeddings"]))
    n_layers = int(req("num_hidden_layers"))
    _refuse_sliding_window(cfg, arch, n_layers, max_pos)
    theta, scaling = _rope(cfg)
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    return ModelSpec(
        name=name or cfg.get("_name_or_path") or arch,
        arch=arch,
        vocab_size=int(req("vocab_size")),
        hidden_size=d,
        intermediate_size=int(req("intermediate_size")),
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=int(n_kv),
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(int(e) for e in eos_ids),
    )


def _arch(cfg: Mapping[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    for a in archs:
        if a in HF_ARCHS:
            return HF_ARCHS[a]
    mt = cfg.get("model_type")
    if not archs and mt in ARCHS:
        return mt
    raise SpecError(f"architectures: unsupported {archs or mt!r}; mimw supports {', '.join(HF_ARCHS)}")


def _refuse_unsupported(cfg: Mapping[str, Any], arch: str) -> None:
    act = cfg.get("hidden_act", "silu")
    if act not in _SILU:
        raise SpecError(f"hidden_act: {act!r} is not supported (mimw's MLP is SwiGLU with silu)")
    if arch in ("llama", "qwen3") and cfg.get("attention_bias"):
        raise SpecError(f"attention_bias: {arch} checkpoints with q/k/v/o projection biases are not supported")
    if arch == "llama" and cfg.get("mlp_bias"):
        raise SpecError("mlp_bias: Llama checkpoints with MLP biases are not supported")
    q = cfg.get("quantization_config")
    if q:
        method = q.get("quant_method", "unknown") if isinstance(q, Mapping) else q
        raise SpecError(f"quantization_config: quantized checkpoints ({method}) are not supported; mimw reads "
                        "bf16/fp16/fp32 safetensors or GGUF files")


def _refuse_sliding_window(cfg: Mapping[str, Any], arch: str, n_layers: int, max_pos: int) -> None:
    """Qwen2/Qwen3 as transformers builds them: the window applies only with use_sliding_window, on the layers
    whose layer_types entry says so (by default the layers from max_window_layers on)."""
    types = cfg.get("layer_types")
    if types is not None:
        other = sorted(set(types) - {"full_attention", "sliding_attention"})
        if other:
            raise SpecError(f"layer_types: {other[0]!r} layers are not supported (mimw runs full attention)")
    if arch == "llama" or not cfg.get("use_sliding_window", False):
        return
    window = cfg.get("sliding_window", 4096)
    if window is None or int(window) >= max_pos:  # a window as long as the context never masks anything
        return
    if types is None:
        first = int(cfg.get("max_window_layers", 28))
        sliding = list(range(first, n_layers))
    else:
        sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if sliding:
        raise SpecError(f"use_sliding_window: sliding-window attention (window {window} tokens, shorter than the "
                        f"{max_pos}-token context, on layers {sliding[0]}..{sliding[-1]}) is not supported")


def _rope(cfg: Mapping[str, Any]) -> tuple[float, Llama3RopeScaling | LinearRopeScaling | None]:
    """rope_theta and scaling from the transformers 4 fields (rope_theta, rope_scaling with "type" or "rope_type")
    or transformers 5's rope_parameters."""
    rp = cfg.get("rope_parameters") or {}
    rs = cfg.get("rope_scaling") or {}
    if not isinstance(rp, Mapping) or not isinstance(rs, Mapping):
        raise SpecError("rope_parameters/rope_scaling: expected a JSON object")
    if any(isinstance(v, Mapping) for v in rp.values()):
        raise SpecError("rope_parameters: per-layer-type RoPE parameters are not supported")
    params = {**rp, **rs}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", _DEFAULT_THETA)))
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise SpecError(f"partial_rotary_factor: {partial} is not supported (mimw rotates the whole head)")
    kind = params.get("rope_type") or params.get("type") or "default"
    try:
        if kind == "default":
            return theta, None
        if kind == "linear":
            return theta, LinearRopeScaling(float(params["factor"]))
        if kind == "llama3":
            return theta, Llama3RopeScaling(
                factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
                original_max_position_embeddings=int(params["original_max_position_embeddings"]))
    except KeyError as e:
        raise SpecError(f"rope_scaling: missing field {e.args[0]!r} for rope_type {kind!r}") from None
    raise SpecError(f"rope_scaling.rope_type: unsupported {kind!r} (mimw supports 'default', 'linear' and 'llama3')")
