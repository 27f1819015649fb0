"""The measuring process: for one model, build each backend at each context, check it, time it.

Runs as ``python -m mimw.bench.worker CONFIG_JSON MODEL TASKS EVENTS`` under ``mimw.bench.supervisor`` (or in-process
through ``run_tasks``). Everything it learns goes out as JSON events, one per line, appended to EVENTS as soon as it
is known, so a crash or a kill loses at most the backend being measured:

  {"event": "setup", "model", "spec", "weights_s"}           weights are on the device
  {"event": "start", "context", "backend"}                    a backend is being built (compile, capture)
  {"event": "phase", "context", "backend", "phase"}           "check" / "time"
  {"event": "result", "model", "context", "backend", "status", "ms_per_step", "bytes_per_step",
   "timing", "check", "notes", "error"}                       status: ok | check-failed | unchecked | unavailable | error

Per context the inputs (``decode_inputs``) and the reference logits are made once, plus, for bf16 runs, the fp32
reference that measures bf16's own rounding noise (``mimw.bench.check``: the tolerance is max(2e-2, 2 x noise));
an MoE backend that reports its routing (``Peer.routing``) is judged against the reference forced onto that routing
after its routing is found faithful (``mimw.bench.own_route``); one that does not, against the reference over each
routing the step may legitimately take (``mimw.bench.routes``, enumerated when first needed);
every backend shares the one weight set (``BenchWeights``). After each backend its objects are dropped and the allocator cache emptied; a CUDA
error that poisons the context ends the process with code 3 so that the supervisor restarts a fresh one.
"""
from __future__ import annotations

import gc
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..models.spec import PRESETS
from .check import compare_logits, compare_routes, noise_tolerance, rel_err
from .config import DecodeBenchConfig, preset_spec
from .floor import routed_experts, step_bytes
from .fused import BenchWeights, fuse, random_bench_weights
from .inputs import decode_inputs, fp32_reference_logits, reference_logits
from .peers import BACKENDS, PeerContext, Unavailable, is_mimw
from .own_route import own_route_check
from .routes import MAX_ROUTES, along, fallback_tie, route_tie, step_routes
from .timing import time_steps

Emit = Callable[[dict], None]
POISONED_EXIT = 3


def load_weights(model: str, cfg: DecodeBenchConfig) -> BenchWeights:
    """Random weights for a preset (generated on the device), else a checkpoint through mimw.models.checkpoint."""
    if model in PRESETS:
        return random_bench_weights(preset_spec(model, cfg.layers), cfg.seed, cfg.torch_dtype, cfg.device)
    try:
        from ..models.checkpoint import load_model
    except ImportError as e:
        raise RuntimeError(f"checkpoint loading unavailable ({e}); use a preset") from None
    loaded = load_model(model, dtype=cfg.torch_dtype, device=cfg.device, progress=False)
    return fuse(loaded.weights)


def _spec_json(bw: BenchWeights) -> dict:
    s = bw.spec
    return {"name": s.name, "arch": s.arch, "params": s.param_count(), "decode_weight_bytes": s.decode_weight_bytes(),
            "kv_bytes_per_token": s.kv_bytes_per_token()}


def _error_text(e: BaseException) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"[:300]


def _cleanup(device: torch.device) -> bool:
    """Free what the last backend left; False when the CUDA context is unusable."""
    gc.collect()
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return True
    except Exception:  # noqa: BLE001 - a sticky CUDA error: nothing in this process can run any more
        traceback.print_exc()
        return False


class Reference:
    """The oracle for one context: bf16 reference logits, and the fp32 ones when they could be computed; the step's
    compulsory bytes (an MoE model's: the experts this step routes to).

    An MoE model's fp32 run follows the bf16 run's routing (``routes.along``), so that the noise it measures is
    rounding, not a near-tie routed elsewhere; its router probabilities against the bf16 run's give the near-tie
    bound (``routes.route_tie``). A backend that reports its own routing is checked against the bf16 reference
    forced onto it (``own_route.own_route_check``); one that does not, against the bf16 reference over every routing
    within the bound (``routes.step_routes``, enumerated on first use; it passes against one of them,
    ``check.compare_routes``)."""

    def __init__(self, bw: BenchWeights, inputs, dtype: torch.dtype, kv_bytes_per_token: int | None = None,
                 max_routes: int = MAX_ROUTES):
        spec = bw.spec
        self.weights, self.inputs, self.max_routes, self.is_moe = bw.weights, inputs, max_routes, spec.is_moe
        routings: list = []
        self.logits = reference_logits(bw.weights, inputs, routings)
        self.bytes = step_bytes(spec, inputs.context, kv_bytes_per_token=kv_bytes_per_token,
                                routed_experts=routed_experts(routings) if spec.is_moe else None)
        self.logits32, self.noise, self.route_tie = None, None, None
        if dtype != torch.float32:
            routings32: list = []
            try:
                self.logits32 = fp32_reference_logits(bw.weights, inputs, routings32,
                                                      along(routings, spec) if spec.is_moe else None)
                self.noise = rel_err(self.logits, self.logits32)
                self.route_tie = route_tie(routings, routings32) if spec.is_moe else None
            except Exception:  # noqa: BLE001 - e.g. out of memory for the fp32 copy: keep the fixed tolerance
                traceback.print_exc()
            gc.collect()
        self.rel_tol = noise_tolerance(self.noise)
        if spec.is_moe and self.route_tie is None:
            self.route_tie = fallback_tie(routings, dtype)
        self._routes: tuple[list, bool] | None = None if spec.is_moe else ([], False)

    def _enumerated(self) -> tuple[list, bool]:
        if self._routes is None:  # the reference runs of the enumeration, only when a backend needs them
            self._routes = step_routes(self.weights, self.inputs, self.route_tie, self.max_routes)
        return self._routes

    @property
    def routes(self) -> list:
        """An MoE step's enumerated routes (``routes.step_routes``, run on first use); [] for a dense model."""
        return self._enumerated()[0]

    @property
    def routes_capped(self) -> bool:
        """Whether ``MAX_ROUTES`` cut the enumeration short."""
        return self._enumerated()[1]

    def check(self, logits: torch.Tensor, routing: list | None = None) -> dict:
        """The check of a backend's step: its ``logits`` and, for an MoE model, its experts per MoE layer in layer
        order (``Peer.routing``; None: it reports none, and the enumeration judges it)."""
        if self.is_moe and routing is not None:
            c = own_route_check(logits, self.weights, self.inputs, routing, self.route_tie, self.rel_tol).to_json()
            c["route_tie"] = self.route_tie
        elif not self.routes:
            c = compare_logits(logits, self.logits, self.rel_tol).to_json()
        else:
            res, i = compare_routes(logits, [r.logits for r in self.routes], self.rel_tol)
            c = res.to_json()
            route = self.routes[i]
            if res.ok and route.deviations:
                c["detail"] = "ok (routing near-tie" + ("; argmax near-tie)" if "near-tie" in res.detail else ")")
            elif not res.ok and len(self.routes) > 1:
                c["detail"] += f" (the closest of {len(self.routes)} near-tie routings)"
            c.update(routing=route.describe(), routings=len(self.routes), routes_capped=self.routes_capped,
                     route_tie=self.route_tie, routing_source="enumerated")
        c["bf16_noise"] = self.noise
        # the fp32 reference ran the bf16 reference's own routing: no yardstick for a backend routed elsewhere
        elsewhere = bool(c.get("near_ties")) or c.get("unfaithful_layer") is not None
        c["rel_err_fp32"] = None if self.logits32 is None or elsewhere else rel_err(logits, self.logits32)
        return c


def _row(model: str, c: int, backend: str, nbytes: int, **kw) -> dict:
    return {"event": "result", "model": model, "context": c, "backend": backend, "status": "error",
            "ms_per_step": None, "bytes_per_step": nbytes, "timing": None, "check": None, "notes": "",
            "error": None, **kw}


def measure(model: str, backend: str, ctx: PeerContext, ref: Reference, cfg: DecodeBenchConfig,
            emit: Emit) -> dict:
    """Build, check and time one backend; returns the result event (never raises)."""
    c = ctx.inputs.context
    row = _row(model, c, backend, ref.bytes)
    try:
        peer = BACKENDS[backend](ctx)
    except Unavailable as e:
        return {**row, "status": "unavailable", "error": str(e)}
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        return {**row, "error": f"build: {_error_text(e)}"}
    row["notes"] = peer.notes
    if ctx.inputs.kv_dtype is not None and not is_mimw(backend):
        own = (f"its own {str(cfg.torch_dtype).removeprefix('torch.')} KV cache holding the {cfg.kv_dtype} cache's "
               "values (the step's new row unrounded)")
        row["notes"] = "; ".join(n for n in (own, peer.notes) if n)
    try:
        emit({"event": "phase", "context": c, "backend": backend, "phase": "check"})
        peer.reset()
        peer.step()
        logits = peer.logits()
        check = None if logits is None else ref.check(logits, peer.routing() if ctx.bw.spec.is_moe else None)
        row["check"] = check
        emit({"event": "phase", "context": c, "backend": backend, "phase": "time"})
        peer.reset()
        timing = time_steps(peer.step, ctx.device, cfg.iters, cfg.warmup, cfg.budget_s)
        row.update(timing=timing.to_json(), ms_per_step=timing.median_ms,
                   status="unchecked" if check is None else ("ok" if check["ok"] else "check-failed"))
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        row.update(status="error", error=f"run: {_error_text(e)}")
    return row


def run_tasks(model: str, tasks: Sequence[tuple[int, str]], cfg: DecodeBenchConfig, emit: Emit,
              progress: bool = True) -> int:
    """Measure ``tasks`` ((context, backend) pairs, grouped by context) for ``model``; returns an exit code."""
    from tqdm import tqdm

    device = torch.device(cfg.device)
    torch.set_grad_enabled(False)
    t0 = time.perf_counter()
    bw = load_weights(model, cfg)
    emit({"event": "setup", "model": model, "spec": _spec_json(bw), "weights_s": time.perf_counter() - t0})
    bar = tqdm(tasks, desc=Path(model).name, file=sys.stderr, ascii=True, disable=not progress, mininterval=0)
    cur_ctx, pctx, ref, ctx_error = None, None, None, None

    def emit_and_show(ev: dict) -> None:
        if ev["event"] == "phase":
            bar.set_postfix_str(f"ctx={ev['context']} {ev['backend']}: {ev['phase']}", refresh=True)
        emit(ev)

    for c, backend in bar:
        bar.set_postfix_str(f"ctx={c} {backend}: build (compile/capture)", refresh=True)
        if c != cur_ctx:
            cur_ctx, pctx, ref, ctx_error = c, None, None, None
            _cleanup(device)
            try:
                inputs = decode_inputs(bw.spec, c, cfg.seed, cfg.torch_dtype, device, cfg.kv_torch_dtype)
                ref = Reference(bw, inputs, cfg.torch_dtype, cfg.kv_bytes_per_token(bw.spec))
                pctx = PeerContext(bw, inputs, device, cfg.iters + cfg.warmup + 1, cfg.megakernel)
                _cleanup(device)  # hand the fp32 reference's memory back before the backends allocate
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                ctx_error = f"context setup: {_error_text(e)}"
        emit({"event": "start", "context": c, "backend": backend})
        if ctx_error is not None:
            # an MoE step's bytes depend on its routing, which the failed setup did not reach
            row = _row(model, c, backend, None if bw.spec.is_moe else
                       step_bytes(bw.spec, c, kv_bytes_per_token=cfg.kv_bytes_per_token(bw.spec)), error=ctx_error)
        else:
            row = measure(model, backend, pctx, ref, cfg, emit_and_show)
        emit(row)
        ms = f"{row['ms_per_step']:.3f} ms" if row["ms_per_step"] else "-"
        bar.write(f"[bench] {Path(model).name} ctx={c} {backend}: {row['status']} {ms} {row['error'] or ''}")
        if not _cleanup(device):
            return POISONED_EXIT
    bar.close()
    return 0


def _file_emitter(path: str) -> Emit:
    def emit(event: dict) -> None:
        with open(path, "a") as f:
            f.write(json.dumps({**event, "t": time.time()}) + "\n")
            f.flush()

    return emit


def main(argv: Sequence[str] | None = None) -> int:
    cfg_json, model, tasks_text, events = list(argv if argv is not None else sys.argv[1:])
    cfg = DecodeBenchConfig.from_json(cfg_json)
    tasks = [(int(c), b) for c, b in (t.split(":", 1) for t in tasks_text.split(","))]
    return run_tasks(model, tasks, cfg, _file_emitter(events))


if __name__ == "__main__":
    sys.exit(main())
