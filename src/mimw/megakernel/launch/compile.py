"""Compile a launch plan's megakernel for sm_90a on any machine (no GPU needed), and read its ptxas report: how CI
catches compile errors and spills, and how the PTX of two builds is compared. ``partition_barrier_errors`` finds the
CTA-wide barrier that deadlocks a warp-specialized kernel (docs/megakernel.md, "Roles")."""
from __future__ import annotations

from ..plan import LaunchPlan
from . import args


def compile_sm90a(p: LaunchPlan, ones: bool = False):
    """The megakernel ``p`` launches, compiled for sm_90a; returns triton's CompiledKernel (``.asm['ptx']``,
    ``.metadata.shared``). ``ones``: every int argument specialized to the constant 1, as the launch compiles an int
    argument that equals 1 (one split, one page, one counter...)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from ..device.kernel import megakernel

    c = p.constants
    sig = args.signature(p.tuning.tile_rows, p.tuning.tile_k, c.FP8, (c.KVBOX, c.HD))
    constants = {"C": p.constants}
    if ones:
        for path in args.int_paths():
            group = list(sig[args.GROUPS[path[0]][0]])
            group[path[1]] = "constexpr"
            sig[args.GROUPS[path[0]][0]] = tuple(group)
            constants[path] = 1
    sig["C"] = "constexpr"
    aligned = {path: [["tt.divisibility", 16]] for path in args.pointer_paths()}
    src = GluonASTSource(megakernel, sig, constants, aligned)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": p.constants.NW})


def ptxas_report(ptx: str) -> dict:
    """Assemble ``ptx`` for sm_90a with the ptxas shipped in the triton wheel; the entry's registers, stack and
    spills, ``functions``: each function's stack and spills by name, and ``worker_registers``: the most registers
    the worker partitions' code names, read from the SASS (the loader's budget is Tuning.loader_regs)."""
    import os
    import re
    import subprocess
    import tempfile

    import triton

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        src, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run([os.path.join(bin_dir, "ptxas"), "-arch=sm_90a", "-v", src, "-o", cubin],
                             capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([os.path.join(bin_dir, "nvdisasm"), "-c", cubin], capture_output=True, text=True,
                              check=True).stdout
    num = lambda pat: int(re.search(pat, out).group(1))  # noqa: E731
    # every function's own line (the entry first; a noinline device function, e.g. attn_query_block's,
    # is allocated apart and reported after it)
    functions = {m.group(1): dict(stack=int(m.group(2)), spill_stores=int(m.group(3)), spill_loads=int(m.group(4)))
                 for m in re.finditer(r"Function properties for (\S+)\s+(\d+) bytes stack frame, (\d+) bytes spill "
                                      r"stores, (\d+) bytes spill loads", out)}
    return dict(registers=num(r"Used (\d+) registers"), stack=num(r"(\d+) bytes stack frame"),
                spill_stores=num(r"(\d+) bytes spill stores"), spill_loads=num(r"(\d+) bytes spill loads"),
                functions=functions, worker_registers=worker_registers(sass))


def worker_registers(sass: str) -> int:
    """The most registers the worker partitions' code names (the highest R index + 1), from the SASS: the code after
    each register release (``USETMAXREG.DEALLOC``, the partition's ``setmaxnreg.dec``) up to the next allocation,
    where ptxas lays a worker's code out. 0 where the kernel releases none."""
    import re

    most, start = 0, None
    lines = sass.splitlines()
    for n, line in enumerate(lines):
        if "USETMAXREG.DEALLOC" in line:
            start = n
        elif "USETMAXREG.TRY_ALLOC" in line and start is not None:
            regs = [int(r) for r in re.findall(r"\bR(\d+)\b", "\n".join(lines[start:n]))]
            most, start = max([most] + [r + 1 for r in regs]), None
    return most


def partition_barrier_errors(ptx: str, num_warps: int) -> list[tuple[str, str]]:
    """Barrier 0 is the compute partition's: Triton's warp-specialize lowering rewrites the kernel's own barriers to
    name its ``num_warps`` warps' threads (``bar.sync 0, 32 * num_warps``); a bare ``bar.sync 0`` (left in a noinline
    function, which the lowering does not rewrite) waits for the whole CTA, the loader's warps included, which never
    arrive: the kernel deadlocks at its first use. Returns the (barrier, thread count) uses of barrier 0 that do not
    name the partition's threads (empty: none). Raises ValueError on PTX with no barrier at all (the pattern would no
    longer match what Triton emits)."""
    import re

    bars = re.findall(r"\b(?:bar|barrier)\.sync(?:\.aligned)?\s+(\d+)\s*(?:,\s*(\d+))?\s*;", ptx)
    if not bars:
        raise ValueError("no barrier in the PTX: the pattern no longer matches what Triton emits")
    return [(i, n) for i, n in bars if i == "0" and n != str(32 * num_warps)]
