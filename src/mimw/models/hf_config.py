"""A Hugging Face ``config.json`` -> ``ModelSpec``, field by field: what mimw computes, what it refuses.

Every field of transformers' ``LlamaConfig``, ``Qwen2Config``, ``Qwen3Config`` and ``Qwen3MoeConfig`` was checked
against the modeling code that reads it. A field that changes the model's math is either read into the spec or refused with a
``SpecError`` naming it; none is ignored silently.

  read        vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
              num_key_value_heads, head_dim, rms_norm_eps, rope_theta, rope_scaling / rope_parameters of type
              default, linear or llama3, max_position_embeddings, tie_word_embeddings, bos/eos_token_id
  read (MoE)  num_experts (or num_local_experts, as transformers 5 saves it), num_experts_per_tok,
              moe_intermediate_size, norm_topk_prob, decoder_sparse_step and mlp_only_layers (which layers keep a
              dense MLP of intermediate_size: transformers' rule, see ``_moe``)
  refused     Qwen2-MoE (shared experts) and every other MoE architecture; num_experts 0;
              shared_expert_intermediate_size; decoder_sparse_step below 1;
              hidden_act other than silu (swish is the same function); attention_bias (Llama: q/k/v/o biases;
              Qwen3: the same); mlp_bias (Llama); rope types dynamic, yarn, longrope and any other;
              partial_rotary_factor other than 1; sliding-window attention on a layer where the window is shorter
              than the context; layer types other than full and sliding attention; quantization_config
  no effect   output_router_logits and router_aux_loss_coef (training only),
              pretraining_tp (transformers 5 ignores it; older versions split each matmul into slices whose sum
              is the same product), attention_dropout (training only), initializer_range, use_cache,
              pad_token_id, torch_dtype / dtype, max_window_layers without a sliding window

Qwen2 always has q/k/v biases and no o_proj bias (its config has no bias field). Fields absent from the file take
transformers' defaults for the architecture (its dataclass defaults), e.g. Qwen3's head_dim is 128 and Qwen2/Qwen3
default to 32 KV heads, while Qwen3-MoE's head_dim defaults to hidden_size / num_attention_heads and its KV heads to
4: a hand-written config then means what it means to transformers.
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
    "qwen3_moe": {"num_key_value_heads": 4, "head_dim": None, "max_position_embeddings": 32768,
                  "intermediate_size": 6144, "num_experts": 128, "num_experts_per_tok": 8,
                  "moe_intermediate_size": 768},
}
# MoE architectures mimw does not compute, with what they would need
_REFUSED_MOE = {
    "Qwen2MoeForCausalLM": "Qwen2-MoE: shared experts behind a sigmoid gate",
    "DeepseekV2ForCausalLM": "DeepSeek-V2: multi-head latent attention, grouped routing, shared experts",
    "DeepseekV3ForCausalLM": "DeepSeek-V3: multi-head latent attention, grouped routing, shared experts",
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
    moe = _moe(cfg, n_layers) if arch == "qwen3_moe" else {}
    inter = cfg.get("intermediate_size", defaults.get("intermediate_size"))  # only Qwen3-MoE has a default
    theta, scaling = _rope(cfg)
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    return ModelSpec(
        name=name or cfg.get("_name_or_path") or arch,
        arch=arch,
        vocab_size=int(req("vocab_size")),
        hidden_size=d,
        intermediate_size=int(req("intermediate_size") if inter is None else inter),
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
        **moe,
    )


def _moe(cfg: Mapping[str, Any], n_layers: int) -> dict[str, Any]:
    """The ModelSpec fields of a Qwen3-MoE config. As transformers' Qwen3MoeDecoderLayer decides: layer l has a
    sparse MoE block unless l is in mlp_only_layers or (l + 1) is not a multiple of decoder_sparse_step."""
    d = _DEFAULTS["qwen3_moe"]
    n = cfg.get("num_experts", cfg.get("num_local_experts", d["num_experts"]))
    if not isinstance(n, int) or n <= 0:
        raise SpecError(f"num_experts: {n!r}; a Qwen3-MoE config needs a positive number of experts (0 makes "
                        "every layer dense, which mimw does not load as Qwen3-MoE)")
    shared = cfg.get("shared_expert_intermediate_size")
    if shared:
        raise SpecError(f"shared_expert_intermediate_size: shared experts ({shared}) are not supported")
    step = cfg.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise SpecError(f"decoder_sparse_step: must be a positive integer, got {step!r}")
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, (list, tuple)) or any(not isinstance(l, int) for l in only):
        raise SpecError(f"mlp_only_layers: expected a list of layer indices, got {only!r}")
    return dict(num_experts=n, num_experts_per_tok=int(cfg.get("num_experts_per_tok", d["num_experts_per_tok"])),
                moe_intermediate_size=int(cfg.get("moe_intermediate_size", d["moe_intermediate_size"])),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                dense_layers=tuple(l for l in range(n_layers) if l in only or (l + 1) % step))


def _arch(cfg: Mapping[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    for a in archs:
        if a in HF_ARCHS:
            return HF_ARCHS[a]
        if a in _REFUSED_MOE:
            raise SpecError(f"architectures: {a} ({_REFUSED_MOE[a]}) is not supported; the one mixture-of-experts "
                            "architecture mimw computes is Qwen3MoeForCausalLM")
    mt = cfg.get("model_type")
    if not archs and mt in ARCHS:
        return mt
    raise SpecError(f"architectures: unsupported {archs or mt!r}; mimw supports {', '.join(HF_ARCHS)}")


def _refuse_unsupported(cfg: Mapping[str, Any], arch: str) -> None:
    act = cfg.get("hidden_act", "silu")
    if act not in _SILU:
        raise SpecError(f"hidden_act: {act!r} is not supported (mimw's MLP is SwiGLU with silu)")
    if arch in ("llama", "qwen3", "qwen3_moe") and cfg.get("attention_bias"):
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
    whose layer_types entry says so (by default the layers from max_window_layers on); Qwen3-MoE's on every layer."""
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
        first = 0 if arch == "qwen3_moe" else int(cfg.get("max_window_layers", 28))
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
