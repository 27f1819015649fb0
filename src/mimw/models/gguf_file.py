"""GGUF files (llama.cpp) -> ``ModelSpec`` + ``ModelWeights``; quantized tensors are dequantized on load.

Spec: from ``{arch}.*`` metadata (arch = ``general.architecture`` in llama / qwen2 / qwen3 / qwen3moe); the
vocabulary size is the length of ``tokenizer.ggml.tokens``; Llama 3 RoPE scaling is recovered from the
``rope_freqs.weight`` tensor (llama.cpp stores the per-frequency divisors there, not the HF parameters, see ``_llama3_from_factors``).

Weights: ``token_embd`` -> embed, ``output_norm`` -> final_norm, ``output`` -> lm_head (absent: tied),
``blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output, attn_q_norm, attn_k_norm, ffn_norm, ffn_gate, ffn_up,
ffn_down}`` -> the per-layer roles. GGUF shapes are listed innermost first ([cols, rows]); torch's are [rows, cols].

Qwen3-MoE (``qwen3moe``, as llama.cpp runs it): every layer is an MoE layer; ``blk.N.ffn_gate_inp`` -> router [E, D],
``blk.N.ffn_{gate,up,down}_exps`` -> e_gate, e_up [E, F, D], e_down [E, D, F] (the experts stacked, as llama.cpp's
converter writes them); ``expert_count``, ``expert_used_count`` and ``expert_feed_forward_length`` (absent:
feed_forward_length / expert_used_count, llama.cpp's rule). llama.cpp always renormalises a qwen3moe token's top-k
weights, so the spec has ``norm_topk_prob``; a file that says ``expert_weights_norm = false``, a shared expert, a
gating function other than softmax or an expert weight scale is refused.

Llama Q/K rows: llama.cpp's converter permutes each head's rows of ``attn_q`` / ``attn_k`` from HF's
"rotate_half" layout (pairs (i, i + hd/2)) to GPT-J's interleaved layout (pairs (2i, 2i + 1)):
    gguf = hf.reshape(H, 2, hd/2, D).swapaxes(1, 2).reshape(H*hd, D)
We undo it (as transformers' GGUF loader does) so that the weights match the reference decoder's HF layout.
Qwen2/Qwen3 are stored unpermuted (llama.cpp runs them with NEOX-style RoPE, which is HF's).
"""
from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import torch
from tqdm import tqdm

from . import rope
from .errors import CheckpointError, check_finite
from .spec import Llama3RopeScaling, LinearRopeScaling, ModelSpec, SpecError
from .weights import LayerWeights, ModelWeights, expected_layer_shapes

LAYER_NAMES = {
    "attn_norm": "attn_norm.weight", "wq": "attn_q.weight", "wk": "attn_k.weight", "wv": "attn_v.weight",
    "wo": "attn_output.weight", "bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias",
    "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight", "mlp_norm": "ffn_norm.weight",
    "w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight", "w_down": "ffn_down.weight",
    "router": "ffn_gate_inp.weight", "e_gate": "ffn_gate_exps.weight", "e_up": "ffn_up_exps.weight",
    "e_down": "ffn_down_exps.weight",
}
ROPE_FREQS = "rope_freqs.weight"
# general.architecture -> ModelSpec.arch
GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}
_REFUSED_ARCHS = {"qwen2moe": "Qwen2-MoE: shared experts behind a sigmoid gate"}


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such GGUF file")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/struct.error/... on a malformed file
        raise CheckpointError(f"{path}: not a readable GGUF file (truncated or corrupt?): {type(e).__name__}: {e}") \
            from None


def _field(reader: gguf.GGUFReader, key: str, default=None, required: bool = False):
    f = reader.fields.get(key)
    if f is None:
        if required:
            raise CheckpointError(f"{reader.data.filename}: missing GGUF metadata field {key!r}")
        return default
    v = f.contents()
    if isinstance(v, (float, np.floating)):
        return float(str(np.float32(v)))  # stored as f32: 9.9999997e-06 -> 1e-05
    return v


def spec_from_gguf(reader: gguf.GGUFReader, name: str | None = None) -> ModelSpec:
    where = reader.data.filename
    arch = _field(reader, "general.architecture", required=True)  # the metadata keys' prefix
    if arch not in GGUF_ARCHS:
        what = f" ({_REFUSED_ARCHS[arch]})" if arch in _REFUSED_ARCHS else ""
        raise CheckpointError(f"{where}: general.architecture: unsupported {arch!r}{what} (mimw supports "
                              f"{', '.join(GGUF_ARCHS)})")
    tensors = {t.name: t for t in reader.tensors}

    def meta(key, default=None, required=True):
        v = _field(reader, f"{arch}.{key}", default, required and default is None)
        if isinstance(v, list):  # e.g. per-layer head counts (OpenELM-style models)
            raise CheckpointError(f"{where}: {arch}.{key}: per-layer values are not supported, got {v[:4]}...")
        return v

    if "tokenizer.ggml.tokens" in reader.fields:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    elif "token_embd.weight" in tensors:
        vocab = int(tensors["token_embd.weight"].shape[-1])
    else:
        vocab = meta("vocab_size")
    hidden, heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    head_dim = meta("attention.key_length", required=False) or hidden // heads  # llama.cpp's rule
    _refuse_unsupported(reader, arch, int(head_dim), int(meta("context_length", 4096)))
    scaling = None
    scaling_type = meta("rope.scaling.type", required=False)
    if scaling_type == "linear":
        scaling = LinearRopeScaling(float(meta("rope.scaling.factor")))
    elif scaling_type not in (None, "none"):
        raise CheckpointError(f"{where}: {arch}.rope.scaling.type: unsupported {scaling_type!r} "
                              "(mimw supports linear scaling and Llama 3 scaling, stored as rope_freqs.weight)")
    moe = _moe(reader, arch, int(meta("feed_forward_length"))) if GGUF_ARCHS[arch] == "qwen3_moe" else {}
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    try:
        spec = ModelSpec(
            name=name or Path(where).stem, arch=GGUF_ARCHS[arch], vocab_size=int(vocab), hidden_size=hidden,
            intermediate_size=int(meta("feed_forward_length")), num_layers=int(meta("block_count")),
            num_heads=heads, num_kv_heads=int(meta("attention.head_count_kv", heads)), head_dim=int(head_dim),
            rms_norm_eps=meta("attention.layer_norm_rms_epsilon"), rope_theta=meta("rope.freq_base", 10000.0),
            max_position_embeddings=int(meta("context_length", 4096)),
            tie_word_embeddings="output.weight" not in tensors, rope_scaling=scaling,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)), **moe,
        )
    except SpecError as e:
        raise CheckpointError(f"{where}: {e}") from None
    if ROPE_FREQS in tensors:
        if scaling is not None:
            raise CheckpointError(f"{where}: both {arch}.rope.scaling.type linear and {ROPE_FREQS} (two scalings)")
        factors = torch.from_numpy(np.array(gguf.quants.dequantize(tensors[ROPE_FREQS].data,
                                                             tensors[ROPE_FREQS].tensor_type), dtype=np.float64))
        spec = spec.with_(rope_scaling=_llama3_from_factors(spec, factors.flatten(), where))
    return spec


def _moe(reader: gguf.GGUFReader, arch: str, ff: int) -> dict:
    """The ModelSpec MoE fields of a qwen3moe file (see the module doc)."""
    where = reader.data.filename

    def meta(key, default=None):
        return _field(reader, f"{arch}.{key}", default, default is None)

    n, k = int(meta("expert_count")), int(meta("expert_used_count"))
    for key, v in (("expert_count", n), ("expert_used_count", k)):
        if v <= 0:
            raise CheckpointError(f"{where}: {arch}.{key} = {v}: must be positive")
    for key, neutral, what in (("expert_shared_count", (None, 0), "shared experts"),
                               ("expert_weights_scale", (None, 0.0, 1.0), "scaled expert weights"),
                               ("expert_gating_func", (None, int(gguf.ExpertGatingFuncType.SOFTMAX)),
                                "a gating function other than softmax"),
                               ("expert_weights_norm", (None, True), "top-k weights left unnormalised, which "
                                "llama.cpp's qwen3moe does not compute either"),
                               ("expert_group_count", (None, 0, 1), "grouped routing")):
        v = _field(reader, f"{arch}.{key}")
        if v not in neutral:
            raise CheckpointError(f"{where}: {arch}.{key} = {v!r}: not supported ({what})")
    return dict(num_experts=n, num_experts_per_tok=k, norm_topk_prob=True,
                moe_intermediate_size=int(meta("expert_feed_forward_length", ff // k)))


# GGUF metadata (after "{arch}.") that llama.cpp reads to change a model's math in ways mimw does not compute: any
# of these present with a value other than the neutral one refuses the file.
_UNSUPPORTED_META = {
    "expert_count": (None, 0, "mixture-of-experts layers"),
    "attention.layer_norm_epsilon": (None, "LayerNorm (mimw runs RMSNorm)"),
    "attention.scale": (None, "a custom attention scale"),
    "attention.clamp_kqv": (None, "clamped q/k/v"),
    "attention.max_alibi_bias": (None, 0.0, "ALiBi position biases"),
    "attention.causal": (None, True, "non-causal attention"),
    "attn_logit_softcapping": (None, 0.0, "attention logit soft-capping"),
    "final_logit_softcapping": (None, 0.0, "final logit soft-capping"),
    "logit_scale": (None, 1.0, "scaled logits"),
    "embedding_scale": (None, 1.0, "scaled embeddings"),
    "residual_scale": (None, 1.0, "scaled residuals"),
    "use_parallel_residual": (None, False, "parallel residual blocks"),
}


def _refuse_unsupported(reader: gguf.GGUFReader, arch: str, head_dim: int, context: int) -> None:
    """Refuse GGUF metadata that changes the math of a llama/qwen2/qwen3(moe) model in ways mimw does not compute."""
    where = reader.data.filename
    for key, (*neutral, what) in _UNSUPPORTED_META.items():
        if key == "expert_count" and arch == "qwen3moe":  # its experts are read by _moe
            continue
        v = _field(reader, f"{arch}.{key}")
        if v not in neutral:
            raise CheckpointError(f"{where}: {arch}.{key} = {v!r}: not supported ({what})")
    rot = _field(reader, f"{arch}.rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise CheckpointError(f"{where}: {arch}.rope.dimension_count: partial rotary embeddings ({rot} of "
                              f"{head_dim} head dimensions) are not supported")
    vlen = _field(reader, f"{arch}.attention.value_length")
    if vlen is not None and int(vlen) != head_dim:
        raise CheckpointError(f"{where}: {arch}.attention.value_length: {vlen} differs from the key length "
                              f"{head_dim}, which mimw does not support")
    window = _field(reader, f"{arch}.attention.sliding_window")
    if window and int(window) < context:
        raise CheckpointError(f"{where}: {arch}.attention.sliding_window: sliding-window attention ({window} "
                              f"tokens, shorter than the {context}-token context) is not supported")


def _llama3_from_factors(spec: ModelSpec, r: torch.Tensor, where: str) -> Llama3RopeScaling | None:
    """Llama 3 scaling parameters reproducing llama.cpp's ``rope_freqs`` divisors r [hd/2].

    llama.cpp divides frequency f by r = 1 (wavelength < old/high), ``factor`` (wavelength > old/low), or
    1 / ((1 - s) / factor + s) with s = (old / wavelength - low) / (high - low) in between. Only the ratios of
    (old, low, high) matter, so low = 1 is fixed; a linear fit of s against 1/wavelength over the in-between
    frequencies gives high and old. Candidates are checked by recomputing the frequencies."""
    base = rope.inv_freq(spec.with_(rope_scaling=None)).double()
    if r.shape != base.shape:
        raise CheckpointError(f"{where}: {ROPE_FREQS} has {r.numel()} entries, expected {base.numel()}")
    if torch.allclose(r, torch.ones_like(r)):
        return None
    factor = float(r.max())
    wavelen = 2 * math.pi / base
    mid = (r > 1 + 1e-4) & (r < factor * (1 - 1e-4))
    cands = [(4.0, 8192), (4.0, int(wavelen[r > 1 + 1e-4].min()))]
    if int(mid.sum()) >= 2:
        s = (1 / r[mid] - 1 / factor) / (1 - 1 / factor)
        a, b = np.polyfit((1 / wavelen[mid]).numpy(), s.numpy(), 1)
        high = round(1 - 1 / b, 4)
        cands.insert(0, (high, int(round(a * (high - 1)))))
    for high, old in cands:
        rs = Llama3RopeScaling(factor, 1.0, high, old)
        if torch.allclose(rope.inv_freq(spec.with_(rope_scaling=rs)).double(), base / r, rtol=1e-4, atol=0):
            return rs
    raise CheckpointError(f"{where}: {ROPE_FREQS} does not follow Llama 3 RoPE scaling (unsupported scaling)")


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row interleave of attn_q / attn_k ([n_heads*hd, ...] -> HF layout)."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
              progress: bool = True, reader: gguf.GGUFReader | None = None) -> ModelWeights:
    """Read (and dequantize) a GGUF into ``ModelWeights`` in ``dtype`` on ``device``."""
    reader = reader or open_gguf(path)
    spec = spec_from_gguf(reader)
    where = reader.data.filename
    d, v = spec.hidden_size, spec.vocab_size
    needed = {"token_embd.weight": (v, d), "output_norm.weight": (d,)}
    if not spec.tie_word_embeddings:
        needed["output.weight"] = (v, d)
    for n in range(spec.num_layers):
        needed.update({f"blk.{n}.{LAYER_NAMES[r]}": s for r, s in expected_layer_shapes(spec, n).items()})
    tensors = {t.name: t for t in reader.tensors}
    for name in needed:
        if name not in tensors:
            raise CheckpointError(f"{where}: missing tensor {name!r} (required by {spec.arch} with "
                                  f"{spec.num_layers} layers per the GGUF metadata)")
    unknown = [n for n in tensors if n not in needed and n != ROPE_FREQS]
    if unknown:
        raise CheckpointError(f"{where}: unexpected tensor {unknown[0]!r} ({len(unknown)} unexpected in all); "
                              f"mimw's {spec.arch} has no such weight")

    out: dict[str, torch.Tensor] = {}
    for name in tqdm(needed, desc=f"loading {Path(where).name}", unit="tensor", disable=not progress, leave=False):
        t = tensors[name]
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        if len(shape) == 2 and shape[1] == 1 and len(needed[name]) == 1:
            shape = shape[:1]
        if shape != needed[name]:
            raise CheckpointError(f"{where}: tensor {name!r} has shape {list(shape)}, expected "
                                  f"{list(needed[name])} from the GGUF metadata")
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
            w = torch.from_numpy(np.array(arr, dtype=np.float32).reshape(shape))
        except NotImplementedError:
            raise CheckpointError(f"{where}: tensor {name!r} has GGML type {t.tensor_type.name}, which the gguf "
                                  "package cannot dequantize") from None
        except (ValueError, OSError) as e:  # a short or unreadable data region
            raise CheckpointError(f"{where}: tensor {name!r} cannot be read (truncated or corrupt?): {e}") from None
        check_finite(w, name, where)
        if spec.arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            w = _unpermute(w, spec.num_heads if "attn_q" in name else spec.num_kv_heads)
        out[name] = w.to(device=device, dtype=dtype)

    layers = [LayerWeights(**{r: out[f"blk.{n}.{LAYER_NAMES[r]}"] for r in expected_layer_shapes(spec, n)})
              for n in range(spec.num_layers)]
    embed = out["token_embd.weight"]
    lm_head = embed if spec.tie_word_embeddings else out["output.weight"]
    return ModelWeights(spec, embed, layers, out["output_norm.weight"], lm_head)


def save_gguf(weights: ModelWeights, path: str | Path, matrix_type: str = "F32") -> Path:
    """Write ``weights`` as a GGUF the way llama.cpp's converter would (Q/K permuted for llama, Llama 3 scaling
    as ``rope_freqs``), without tokenizer metadata. Matrices are stored as ``matrix_type`` (F32, F16, Q8_0);
    norms and biases as F32. Used by tests."""
    spec, path = weights.spec, Path(path)
    qtype = gguf.GGMLQuantizationType[matrix_type]
    if spec.is_moe and (spec.dense_layers or not spec.norm_topk_prob):
        raise ValueError("llama.cpp's qwen3moe has an MoE block on every layer and renormalises the top-k weights: "
                         f"{spec.name} (dense layers {spec.dense_layers}, norm_topk_prob={spec.norm_topk_prob}) "
                         "has no GGUF form")
    w = gguf.GGUFWriter(path, {v: k for k, v in GGUF_ARCHS.items()}[spec.arch])
    w.add_name(spec.name)
    w.add_block_count(spec.num_layers)
    w.add_context_length(spec.max_position_embeddings)
    w.add_embedding_length(spec.hidden_size)
    w.add_feed_forward_length(spec.intermediate_size)
    w.add_head_count(spec.num_heads)
    w.add_head_count_kv(spec.num_kv_heads)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_rope_dimension_count(spec.head_dim)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.rms_norm_eps)
    w.add_vocab_size(spec.vocab_size)
    if spec.bos_token_id is not None:
        w.add_bos_token_id(spec.bos_token_id)
    if spec.eos_token_ids:
        w.add_eos_token_id(spec.eos_token_ids[0])
    if spec.is_moe:
        w.add_expert_count(spec.num_experts)
        w.add_expert_used_count(spec.num_experts_per_tok)
        w.add_expert_feed_forward_length(spec.moe_intermediate_size)

    def add(name: str, t: torch.Tensor) -> None:
        a = t.detach().float().cpu().numpy()
        if a.ndim >= 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, a)

    if isinstance(spec.rope_scaling, LinearRopeScaling):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(spec.rope_scaling.factor)
    elif spec.rope_scaling is not None:
        base = rope.inv_freq(spec.with_(rope_scaling=None))
        add(ROPE_FREQS, base / rope.inv_freq(spec))
    add("token_embd.weight", weights.embed)
    for n, lw in enumerate(weights.layers):
        for role, t in lw.tensors().items():
            if spec.arch == "llama" and role in ("wq", "wk"):
                h = spec.num_heads if role == "wq" else spec.num_kv_heads
                t = t.reshape(h, 2, spec.head_dim // 2, -1).swapaxes(1, 2).reshape(t.shape)
            add(f"blk.{n}.{LAYER_NAMES[role]}", t)
    add("output_norm.weight", weights.final_norm)
    if not spec.tie_word_embeddings:
        add("output.weight", weights.lm_head)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
