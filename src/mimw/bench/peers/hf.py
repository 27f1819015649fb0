"""The transformers peer: ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` with our weights.

The model is built from ``spec.to_hf_config()`` (sdpa attention) and its parameters are replaced by the run's shared
tensors (no copy). The cache is a ``StaticCache`` as transformers recommends for compiled decoding; the step is
``model(input_ids, position_ids, past_key_values=cache)`` (``cache=`` on newer transformers), tried in this order on CUDA:
  1. ``torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)`` (transformers' documented recipe),
  2. eager + a manual CUDA graph,
  3. eager;
the notes say which one ran and why the earlier ones failed.

StaticCache (transformers 5.x) keeps its write position in a per-layer device counter ``cumulative_length`` that
every step advances, and always attends over all ``max_cache_len`` rows with a mask. So the cache gets
``max_steps + 64`` spare rows (the steps between two resets never run off the end: an out-of-range ``index_copy_``
would be a device-side assert) and ``reset()`` puts the counters back to C. Cost: those spare rows are read every
step: ~170 extra rows of KV, under 0.3% extra traffic at the benchmark's sizes (noted in bench/README.md).
"""
from __future__ import annotations

import inspect
import traceback

import torch
from torch import nn

from .base import Peer, PeerContext, Unavailable
from .graph import capture, inductor_cudagraph_skips


def _p(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def build_model(ctx: PeerContext) -> nn.Module:
    """The transformers model for ``ctx.bw`` (parameters are the shared tensors)."""
    try:
        import transformers
    except ImportError as e:
        raise Unavailable(f"transformers not installed ({e})") from None
    spec, w = ctx.bw.spec, ctx.bw.weights
    if spec.is_moe:  # its experts would be allocated once more by _from_config, then copied into gate_up_proj
        raise Unavailable("mixture-of-experts models are not mapped onto transformers' modules here")
    cfg = spec.to_hf_config()
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    cls = getattr(transformers, cfg["architectures"][0])
    with torch.device(ctx.device):
        model = cls._from_config(config, dtype=w.dtype, attn_implementation="sdpa")
    core = model.model
    core.embed_tokens.weight = _p(w.embed)
    model.lm_head.weight = core.embed_tokens.weight if w.lm_head is w.embed else _p(w.lm_head)
    core.norm.weight = _p(w.final_norm)
    for layer, lw in zip(core.layers, w.layers, strict=True):
        a, mlp = layer.self_attn, layer.mlp
        a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight = map(_p, (lw.wq, lw.wk, lw.wv, lw.wo))
        if lw.bq is not None:
            a.q_proj.bias, a.k_proj.bias, a.v_proj.bias = map(_p, (lw.bq, lw.bk, lw.bv))
        if lw.q_norm is not None:
            a.q_norm.weight, a.k_norm.weight = _p(lw.q_norm), _p(lw.k_norm)
        layer.input_layernorm.weight = _p(lw.attn_norm)
        layer.post_attention_layernorm.weight = _p(lw.mlp_norm)
        mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight = map(_p, (lw.w_gate, lw.w_up, lw.w_down))
    return model.eval()


class _Runner:
    """Holds the model, its StaticCache and the static step inputs."""

    def __init__(self, ctx: PeerContext):
        import transformers

        spec, inp = ctx.bw.spec, ctx.inputs
        self.model = build_model(ctx)
        self.context = inp.context
        self.cache = transformers.StaticCache(config=self.model.config, max_cache_len=inp.context + ctx.max_steps + 64)
        # transformers <= 5.2x takes the cache as ``past_key_values``; later versions renamed it ``cache``
        params = inspect.signature(type(self.model).forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.tok = torch.tensor([[inp.token]], device=ctx.device)
        self.pos = torch.tensor([[inp.context]], device=ctx.device)
        with torch.no_grad():  # one step at position 0 lets the cache allocate its layers lazily
            self.model(input_ids=self.tok, position_ids=torch.zeros_like(self.pos), use_cache=True,
                       **{self.cache_kw: self.cache})
            for i, layer in enumerate(self.cache.layers):
                if tuple(layer.keys.shape) != (1, spec.num_kv_heads, self.cache_len, spec.head_dim):
                    raise RuntimeError(f"unexpected StaticCache layer shape {tuple(layer.keys.shape)}")
                layer.keys.zero_(), layer.values.zero_()
                layer.keys[0, :, : inp.context] = inp.k[i].transpose(0, 1)
                layer.values[0, :, : inp.context] = inp.v[i].transpose(0, 1)
        self.reset()

    @property
    def cache_len(self) -> int:
        return self.cache.layers[0].max_cache_len

    def reset(self) -> None:
        for layer in self.cache.layers:
            if isinstance(layer.cumulative_length, torch.Tensor):
                layer.cumulative_length.fill_(self.context)
            else:
                layer.cumulative_length = self.context

    def forward(self, fn=None) -> torch.Tensor:
        out = (fn or self.model.forward)(input_ids=self.tok, position_ids=self.pos, use_cache=True,
                                         **{self.cache_kw: self.cache})
        return out.logits[0, -1]


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]


def hf_transformers(ctx: PeerContext) -> Peer:
    r = _Runner(ctx)
    out: list[torch.Tensor | None] = [None]
    failures: list[str] = []
    if ctx.device.type == "cuda":
        try:
            import torch._dynamo

            torch._dynamo.reset()
            torch._dynamo.mark_static_address(r.tok)
            torch._dynamo.mark_static_address(r.pos)
            fn = torch.compile(r.model.forward, mode="reduce-overhead", fullgraph=True)
            skips = inductor_cudagraph_skips()

            def step() -> None:
                torch.compiler.cudagraph_mark_step_begin()
                out[0] = r.forward(fn)

            for _ in range(3):
                step()
            torch.cuda.synchronize()
            r.reset()
            graphs = "" if inductor_cudagraph_skips() == skips else " (CUDA graphs SKIPPED by inductor, see log)"
            return Peer(step, lambda: out[0], f"torch.compile reduce-overhead, StaticCache{graphs}", r.reset)
        except Exception as e:  # noqa: BLE001 - any compile failure falls back to the next recipe
            failures.append(f"compile failed ({_why(e)})")
            traceback.print_exc()
            r.reset()
        try:
            graph, logits = capture(r.forward)
            r.reset()
            return Peer(graph.replay, lambda: logits, "; ".join(["eager + CUDA graph", *failures]), r.reset)
        except Exception as e:  # noqa: BLE001
            failures.append(f"graph failed ({_why(e)})")
            traceback.print_exc()
            torch.cuda.synchronize()
            r.reset()

    def eager_step() -> None:
        out[0] = r.forward()

    return Peer(eager_step, lambda: out[0], "; ".join(["eager, StaticCache", *failures]), r.reset)
