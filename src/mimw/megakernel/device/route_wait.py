"""The loader's wait on a layer's routing entry, and its trace.

An MoE layer's first expert span (isa.EXPERT_SPAN) is the one place the loader waits on step data (device/ring.py):
its expert is known once the layer's ROUTER finisher has stored the routing entry. The ring cannot take anything
meanwhile: it is consumed in queue order, and the expert tiles come first. The wait is the plain poll of
sync.routed_wait: one volatile load of the entry an L2 round trip, until it carries the step's tag; the tiles
already requested keep landing while it polls.

Traced (``C.TRACE``), each layer's first wait stores [the globaltimer once the entry is tagged, the ns since the
first poll] at ``waits[sm, layer]`` (tools/trace.py: the routing wait per layer).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .sync import globaltimer, routed_wait

WAIT_STAMPS: gl.constexpr = gl.constexpr(2)  # [tagged, ns waited] per (SM, layer)


@gluon.jit
def first_wait(routed_ptr, index, tag, waits, C: gl.constexpr):
    """A layer's first routing wait (``waits``: the trace [num_sms * NL, WAIT_STAMPS] and this wait's row in it),
    traced where the plan says so. Returns the expert."""
    if C.TRACE:  # the low 32 bits of the first stamp: a wait's length wraps only past 2 s, and one register
        # across the wait, not two, keeps the loader within its 48
        t_first = globaltimer().to(gl.int32)
    e = routed_wait(routed_ptr, index, tag)
    if C.TRACE:
        t_tagged = globaltimer()
        at = waits[0] + waits[1] * WAIT_STAMPS  # computed here, not held across the wait
        gl.store(at, t_tagged)
        gl.store(at + 1, (t_tagged.to(gl.int32) - t_first).to(gl.int64))
    return e
