"""The kernel's arguments (launch/args.py): host logic on the CPU."""
import pytest

from mimw.megakernel.launch import args


def test_the_kv_pool_descriptors_follow_the_pools_and_carry_the_plans_box():
    """The loader's K/V stream takes two TMA descriptors right after the pools (device/kernel.py reads them in that
    order); their compile type is the plan's box [KVBOX, head_dim] of the cache's element type, unswizzled (the slot
    holds the rows in plain row-major order, as device/kv_stream.py reads them)."""
    names = [name for name, _ in args.GROUPS]
    assert names[names.index("kv") + 1: names.index("kv") + 3] == ["k_desc", "v_desc"]
    bf16 = args.signature(32, 256, False, (16, 64))
    fp8 = args.signature(32, 256, True, (16, 128))
    assert bf16["k_desc"] == bf16["v_desc"] and bf16["k_desc"].startswith("tensordesc<bf16[16, 64],")
    assert fp8["k_desc"].startswith("tensordesc<fp8e4nv[16, 128],") and fp8["kv"][:2] == ("*fp8e4nv", "*fp8e4nv")
    assert "swizzle_byte_width=0" in bf16["k_desc"] and "element_bitwidth=8" in fp8["k_desc"]
    assert bf16["weights"] != bf16["k_desc"]
    assert all(path[0] not in (names.index("k_desc"), names.index("v_desc")) for path in args.pointer_paths())


def test_the_groups_are_the_kernels_parameters_and_the_trace_its_stamps_and_routing_waits():
    """GROUPS names the kernel's parameters in its order (device/kernel.py; ``C`` last, the constants): the weights
    are reached through their descriptor alone; the trace is the instructions' stamps and the loaders' routing waits
    (device/route_wait.py), two 16-byte aligned pointers."""
    from mimw.megakernel.device.kernel import megakernel

    names = [name for name, _ in args.GROUPS]
    assert names == list(megakernel.arg_names[:-1]) and megakernel.arg_names[-1] == "C"
    assert names[names.index("weights") + 1] == "vecs"
    sig = args.signature(32, 256)
    assert sig["weights"].startswith("tensordesc<bf16[256, 32]")
    assert sig["trace"] == ("*i64", "*i64") and dict(args.GROUPS)["trace"] == (("stamps", "*i64"), ("waits", "*i64"))
    t = names.index("trace")
    assert {(t, 0), (t, 1)} <= set(args.pointer_paths())


def test_a_launch_without_the_kv_descriptors_is_a_clear_error():
    sources = {k: 0 for _, fields in args.GROUPS if not isinstance(fields, str) for k, _ in fields}
    sources.update(weights=0)
    with pytest.raises(KeyError, match="k_desc"):
        args.values(sources)
    sources.update(k_desc="K", v_desc="V")
    out = args.values(sources)
    assert out[[n for n, _ in args.GROUPS].index("k_desc")] == "K"


def test_the_decoder_names_every_kernel_argument_and_no_other():
    """MegakernelDecoder._args (launch/decoder.py, which needs a GPU to run) passes ``args.values`` exactly the names
    GROUPS describes: read from its source, so a renamed field fails here on the CPU, not at the first launch."""
    import ast
    import inspect

    from mimw.megakernel.launch import decoder

    tree = ast.parse(inspect.getsource(decoder.MegakernelDecoder._args).lstrip().replace("\n    ", "\n"))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "values"]
    assert len(calls) == 1 and isinstance(calls[0].args[0], ast.Call)
    passed = {k.arg for k in calls[0].args[0].keywords}
    wanted = {n for n, f in args.GROUPS if isinstance(f, str)}
    wanted |= {k for _, f in args.GROUPS if not isinstance(f, str) for k, _ in f}
    assert passed == wanted
