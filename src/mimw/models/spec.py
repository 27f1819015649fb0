"""ModelSpec: the one description of a decoder's shapes, built at the edge and passed explicitly.

Dense Llama/Qwen2/Qwen3 decoders, and Qwen3-MoE: the same attention as Qwen3, with a mixture-of-experts MLP (a router
picks ``num_experts_per_tok`` of ``num_experts`` SwiGLU experts per token, their outputs weighted by the router's
softmax probabilities, renormalised over the chosen ones when ``norm_topk_prob``) on every layer but the
``dense_layers``, which keep a dense MLP of ``intermediate_size``.

Everything downstream (loader, reference decoder, megakernel scheduler, benchmarks) reads sizes from a
``ModelSpec``; no model size is compiled in anywhere. Specs come from a Hugging Face ``config.json``, from
GGUF metadata (``mimw.models.gguf_file``), or from the named presets below (published shapes, used with random
weights by the benchmarks).
"""
from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe")
MOE_ARCHS = ("qwen3_moe",)
HF_ARCHS = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


class SpecError(ValueError):
    """A config that mimw cannot describe: the message names the field."""


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.x frequency-dependent RoPE scaling (``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LinearRopeScaling:
    """Linear RoPE scaling (``rope_type: linear``): every inverse frequency divided by ``factor``."""

    factor: float


@dataclass(frozen=True)
class ModelSpec:
    """Shapes and numerics of a Llama/Qwen2/Qwen3 decoder, dense or Qwen3-MoE.

    arch: "llama" (no biases), "qwen2" (q/k/v biases), "qwen3" (RMSNorm on each q and k head) or "qwen3_moe"
    (Qwen3's attention, mixture-of-experts MLPs: the ``num_experts`` fields; zero for the dense archs).
    """

    name: str
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | LinearRopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    num_experts: int = 0  # routed experts of an MoE layer (0: a dense model)
    num_experts_per_tok: int = 0  # experts each token is routed to (top-k)
    moe_intermediate_size: int = 0  # one expert's intermediate size
    norm_topk_prob: bool = False  # renormalise the chosen experts' probabilities to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers of an MoE model with a dense MLP (intermediate_size)

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise SpecError(f"arch: unsupported architecture {self.arch!r} (supported: {', '.join(ARCHS)})")
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise SpecError(f"{f}: must be a positive integer, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise SpecError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise SpecError(f"head_dim: must be even for RoPE, got {self.head_dim}")
        self._check_moe()

    def _check_moe(self) -> None:
        if self.arch not in MOE_ARCHS:
            if self.num_experts or self.num_experts_per_tok or self.moe_intermediate_size or self.dense_layers:
                raise SpecError(f"num_experts: {self.arch} is a dense architecture; mixture-of-experts fields "
                                f"belong to {', '.join(MOE_ARCHS)}")
            return
        for f in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise SpecError(f"{f}: must be a positive integer for {self.arch}, got {v!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise SpecError(f"num_experts_per_tok: {self.num_experts_per_tok} exceeds num_experts "
                            f"({self.num_experts})")
        if self.num_experts >= 0xFFFF:
            raise SpecError(f"num_experts: {self.num_experts} experts; mimw supports fewer than 65535")
        if tuple(sorted(set(self.dense_layers))) != tuple(self.dense_layers) or any(
                not 0 <= l < self.num_layers for l in self.dense_layers):
            raise SpecError(f"dense_layers: must be sorted distinct layer indices below {self.num_layers}, got "
                            f"{self.dense_layers}")

    # --- derived sizes -------------------------------------------------------------------------------
    @property
    def attention_bias(self) -> bool:
        return self.arch == "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.arch in ("qwen3", "qwen3_moe")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is a mixture of experts (else a dense SwiGLU of intermediate_size)."""
        return self.is_moe and layer not in self.dense_layers

    @functools.cached_property  # read once per instruction while a program is planned
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(l for l in range(self.num_layers) if self.is_moe_layer(l))

    @functools.cached_property
    def mlp_layers(self) -> tuple[int, ...]:
        """The layers with a dense MLP (every layer of a dense model)."""
        return tuple(l for l in range(self.num_layers) if not self.is_moe_layer(l))

    @property
    def expert_param_count(self) -> int:
        """Parameters of one expert: gate, up [I_moe, D] and down [D, I_moe]."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    def layer_param_count(self, layer: int = 0) -> int:
        """Parameters of ``layer``; an MoE layer's count every expert and the router."""
        d, i = self.hidden_size, self.intermediate_size
        n = d * (self.q_size + 2 * self.kv_size) + self.q_size * d + 2 * d
        if self.is_moe_layer(layer):
            n += self.num_experts * d + self.num_experts * self.expert_param_count  # router, experts
        else:
            n += 3 * d * i
        if self.attention_bias:
            n += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            n += 2 * self.head_dim
        return n

    def param_count(self) -> int:
        emb = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else emb
        return emb + head + sum(self.layer_param_count(l) for l in range(self.num_layers)) + self.hidden_size

    def decode_weight_bytes(self, bytes_per_param: int = 2, routed_experts: int | None = None) -> int:
        """Bytes one decode step must stream: every layer weight, the final norm and the LM head (the embedding
        table contributes one row, which is negligible and counted as such).

        An MoE step reads only the experts its tokens are routed to: ``routed_experts`` is their number summed
        over the MoE layers (each distinct expert of a layer once, however many of the step's tokens chose it);
        None counts every expert (all the weights)."""
        n_moe = self.num_experts * len(self.moe_layers)
        if routed_experts is not None and not 0 <= routed_experts <= n_moe:
            raise ValueError(f"routed_experts={routed_experts}: between 0 and {len(self.moe_layers)} MoE layers x "
                             f"{self.num_experts} experts")
        n = sum(self.layer_param_count(l) for l in range(self.num_layers))
        if routed_experts is not None:
            n -= (n_moe - routed_experts) * self.expert_param_count
        n += self.hidden_size + self.vocab_size * self.hidden_size
        return (n + self.hidden_size) * bytes_per_param

    def kv_bytes_per_token(self, bytes_per_elem: int = 2) -> int:
        return 2 * self.num_layers * self.kv_size * bytes_per_elem

    def with_(self, **changes: Any) -> "ModelSpec":
        return dataclasses.replace(self, **changes)

    # --- construction from Hugging Face configs --------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any], name: str | None = None) -> "ModelSpec":
        """The spec of a transformers ``config.json`` dict; ``SpecError`` names any field mimw cannot compute
        (``mimw.models.hf_config`` reads it field by field)."""
        from .hf_config import spec_from_hf_config

        return spec_from_hf_config(cfg, name)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "ModelSpec":
        p = Path(path) / "config.json"
        if not p.is_file():
            raise SpecError(f"{p}: no config.json in the checkpoint directory")
        return cls.from_hf_config(json.loads(p.read_text()), name=Path(path).name)

    def to_hf_config(self) -> dict[str, Any]:
        """A transformers config dict for this spec (used by tests and peers to build HF models)."""
        hf_arch = {v: k for k, v in HF_ARCHS.items()}[self.arch]
        cfg: dict[str, Any] = {
            "architectures": [hf_arch],
            "model_type": self.arch,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "mlp_bias": False,
        }
        rs = self.rope_scaling
        if isinstance(rs, LinearRopeScaling):
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": rs.factor}
        elif rs is not None:
            cfg["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": rs.factor,
                "low_freq_factor": rs.low_freq_factor,
                "high_freq_factor": rs.high_freq_factor,
                "original_max_position_embeddings": rs.original_max_position_embeddings,
            }
        if self.bos_token_id is not None:
            cfg["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            cfg["eos_token_id"] = list(self.eos_token_ids)
        if self.is_moe:  # transformers' Qwen3MoeConfig: dense layers listed in mlp_only_layers
            cfg.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                       moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                       decoder_sparse_step=1, mlp_only_layers=list(self.dense_layers))
        return cfg


_L3 = Llama3RopeScaling(32.0, 1.0, 4.0, 8192)
PRESETS: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        ModelSpec("llama-3.2-1b", "llama", 128256, 2048, 8192, 16, 32, 8, 64, 1e-5, 500000.0, _L3, 131072, True,
                  128000, (128001, 128008, 128009)),
        ModelSpec("llama-3.2-3b", "llama", 128256, 3072, 8192, 28, 24, 8, 128, 1e-5, 500000.0, _L3, 131072, True,
                  128000, (128001, 128008, 128009)),
        ModelSpec("llama-3.1-8b", "llama", 128256, 4096, 14336, 32, 32, 8, 128, 1e-5, 500000.0,
                  Llama3RopeScaling(8.0, 1.0, 4.0, 8192), 131072, False, 128000, (128001, 128008, 128009)),
        # the tensor-parallel shape (issue 32): 141 GB of bf16 weights, more than one GPU holds
        ModelSpec("llama-3.1-70b", "llama", 128256, 8192, 28672, 80, 64, 8, 128, 1e-5, 500000.0,
                  Llama3RopeScaling(8.0, 1.0, 4.0, 8192), 131072, False, 128000, (128001, 128008, 128009)),
        ModelSpec("qwen3-0.6b", "qwen3", 151936, 1024, 3072, 28, 16, 8, 128, 1e-6, 1000000.0, None, 40960, True,
                  None, (151645,)),
        ModelSpec("qwen3-1.7b", "qwen3", 151936, 2048, 6144, 28, 16, 8, 128, 1e-6, 1000000.0, None, 40960, True,
                  None, (151645,)),
        ModelSpec("qwen3-8b", "qwen3", 151936, 4096, 12288, 36, 32, 8, 128, 1e-6, 1000000.0, None, 40960, False,
                  None, (151645,)),
        ModelSpec("smollm2-135m", "llama", 49152, 576, 1536, 30, 9, 3, 64, 1e-5, 100000.0, None, 8192, True,
                  1, (2,)),
        # tiny shapes for tests (random weights only)
        ModelSpec("tiny-llama", "llama", 256, 64, 128, 2, 4, 2, 16, 1e-5, 10000.0, None, 512, False, 1, (2,)),
        ModelSpec("tiny-llama3", "llama", 256, 64, 128, 2, 4, 2, 16, 1e-5, 500000.0,
                  Llama3RopeScaling(8.0, 1.0, 4.0, 32), 1024, True, 1, (2,)),
        ModelSpec("tiny-qwen2", "qwen2", 256, 64, 160, 2, 4, 1, 16, 1e-6, 1000000.0, None, 512, True, None, (2,)),
        ModelSpec("tiny-qwen3", "qwen3", 256, 64, 128, 3, 8, 2, 32, 1e-6, 1000000.0, None, 512, False, None, (2,)),
        # Qwen3-MoE: 30.5B parameters, 3.3B active per token (128 experts, 8 routed per token, on all 48 layers)
        ModelSpec("qwen3-30b-a3b", "qwen3_moe", 151936, 2048, 6144, 48, 32, 4, 128, 1e-6, 1000000.0, None, 40960,
                  False, None, (151645,), num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                  norm_topk_prob=True),
        # tiny MoE for tests: 16 experts, 4 per token, layer 1 dense
        ModelSpec("tiny-qwen3-moe", "qwen3_moe", 256, 64, 128, 3, 8, 2, 32, 1e-6, 1000000.0, None, 512, False, None,
                  (2,), num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, norm_topk_prob=True,
                  dense_layers=(1,)),
        # tiny MoE whose decode batches plan on the megakernel's multi-token step ([32, 256] tiles need heads of 64):
        # its hidden size one column tile, experts 768 wide (the 30B-A3B's: three column tiles), layer 1 dense
        ModelSpec("tiny-qwen3-moe-mt", "qwen3_moe", 256, 64, 128, 3, 8, 2, 64, 1e-6, 1000000.0, None, 512, False,
                  None, (2,), num_experts=16, num_experts_per_tok=4, moe_intermediate_size=768, norm_topk_prob=True,
                  dense_layers=(1,)),
    ]
}


def get_preset(name: str) -> ModelSpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise SpecError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
