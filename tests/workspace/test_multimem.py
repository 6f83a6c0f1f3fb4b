"""The multimem all_reduce (NVLink SHARP): its sm_90 PTX, and its multicast view on the CPU.

No GPU here, so two things stand in for one. The kernel compiles ahead of time for sm_90 (ptxas
accepts it) and its PTX holds the switch's instructions: ``multimem.ld_reduce`` (with
``.acc::f32`` for 16-bit floats), ``multimem.st`` and the barrier's ``multimem.red.release``.
Under the Triton interpreter the same kernel runs across real processes on the multicast view
of the shared-memory heap (a load-reduce reads every rank's copy in rank order, a store writes
every copy), and must give the bits of the one-shot all_reduce of the same values: the view
folds in rank order in fp32, as one-shot does. Calls it cannot serve raise with their reason; a
rank that never arrives ends in CommTimeoutError.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import textwrap

import pytest
from spawn import run_ranks

# dtype, gpucomm.ReduceOp value, elements per unit, the ld_reduce the PTX must hold
AOT_CASES = (
    ("float32", 0, 4, "multimem.ld_reduce.relaxed.sys.global.add.v4.f32", "multimem.st.relaxed.sys.global.v4.f32"),
    (
        "bfloat16",
        0,
        8,
        "multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.bf16x2",
        "multimem.st.relaxed.sys.global.v4.bf16x2",
    ),
    (
        "float16",
        0,
        8,
        "multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.f16x2",
        "multimem.st.relaxed.sys.global.v4.f16x2",
    ),
    ("int32", 2, 1, "multimem.ld_reduce.relaxed.sys.global.min.s32", "multimem.st.relaxed.sys.global.b32"),
    ("int64", 0, 1, "multimem.ld_reduce.relaxed.sys.global.add.u64", "multimem.st.relaxed.sys.global.b64"),
)
_MULTIMEM = re.compile(r"\bmultimem\.[a-z_]+(?:\.[\w:]+)+")


def _aot_worker() -> dict:
    """Compile the kernel for sm_90 in every AOT case: the multimem instructions of its PTX, and
    whether ptxas made a cubin of it."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget

    from gpucomm._kernels.triton import multimem

    signature = {
        "mc_base": "i64",
        "peers_ptr": "*i64",
        "offset": "i64",
        "signal_offset": "i64",
        "state_addr": "i64",
        "record_addr": "i64",
        "rank": "i32",
        "world": "i32",
        "lo": "i32",
        "hi": "i32",
        "timeout_ns": "i64",
    }
    report = {}
    for dtype, op, unit_elems, _, _ in AOT_CASES:
        constexprs = {"DTYPE": getattr(tl, dtype), "OP": op, "UNIT_ELEMS": unit_elems, "LANES": 32 * multimem.NUM_WARPS}
        source = triton.compiler.ASTSource(
            fn=multimem.multimem_all_reduce_kernel,
            signature={**signature, **{k: "constexpr" for k in constexprs}},
            constexprs=constexprs,
        )
        try:
            compiled = triton.compile(
                source, target=GPUTarget("cuda", 90, 32), options={"num_warps": multimem.NUM_WARPS}
            )
        except Exception as exc:  # reported per case, so one failure does not hide the others
            report[dtype] = f"{type(exc).__name__}: {exc}"
            continue
        ptx = compiled.asm["ptx"]
        red = ptx.find("multimem.red.release")
        report[dtype] = {
            "multimem": sorted(set(_MULTIMEM.findall(ptx))),
            "cubin": len(compiled.asm["cubin"]),
            # What follows the barrier's multicast add before the wait's first ordinary load.
            "after_red": ptx[red : ptx.find("atom.", red)] if red >= 0 else "",
        }
    return report


@pytest.fixture(scope="module")
def sm90() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, __file__, "--aot"], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"AOT worker failed (exit {proc.returncode}):\n{proc.stderr[-8000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", AOT_CASES, ids=[c[0] for c in AOT_CASES])
def test_sm90_ptx_reduces_in_the_switch(sm90: dict, case: tuple) -> None:
    dtype, _, _, ld_reduce, st = case
    seen = sm90[dtype]
    assert isinstance(seen, dict), f"{dtype} did not compile: {seen}"
    assert seen["cubin"] > 0, "ptxas made no cubin"
    assert ld_reduce in seen["multimem"], seen["multimem"]
    assert st in seen["multimem"], seen["multimem"]
    # The barrier: one multicast add with release semantics at system scope, then the proxy fence
    # that orders it before the wait's poll of the same word through its ordinary address.
    assert "multimem.red.release.sys.global.add.u64" in seen["multimem"], seen["multimem"]
    assert "fence.proxy.alias" in seen["after_red"], seen["after_red"]


def test_unit_addresses_past_2_gib_do_not_wrap() -> None:
    """The switch's addresses are computed as integers from the unit index, which Triton types as
    an i32 where it fits: a slice starting past 2 GiB of a tensor must not wrap. Under the
    interpreter, whose i32 arithmetic wraps as the compiled kernel's does."""
    code = textwrap.dedent(
        """
        import torch, triton, triton.language as tl
        from gpucomm._kernels.triton.multimem import _unit_address

        @triton.jit
        def k(out, mc_base, offset, lo, UNIT_BYTES: tl.constexpr):
            units = lo + tl.arange(0, 4)
            tl.store(out + tl.arange(0, 4), _unit_address(mc_base, offset, units, UNIT_BYTES))

        for unit_bytes in (16, 8, 4):
            lo = (1 << 31) // unit_bytes + 5  # the first unit past 2 GiB, and 5 more
            out = torch.zeros(4, dtype=torch.int64)
            k[(1,)](out, 1 << 40, 4096, lo, UNIT_BYTES=unit_bytes)
            want = [(1 << 40) + 4096 + (lo + i) * unit_bytes for i in range(4)]
            assert out.tolist() == want, (unit_bytes, out.tolist(), want)
        print("ok")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def _view(rank: int, world_size: int, seed: int) -> list[str]:
    import warnings

    import torch

    import gpucomm
    from gpucomm.reduce_op import ReduceOp

    gpucomm.init_process_group(transport="shm", kernels="triton", heap_bytes="1M", timeout=60)
    world = gpucomm.get_default_communicator()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # forcing multimem warns that float SUM leaves the contract
        multimem = world.new_subgroup(list(range(world_size)), algo="multimem")
    oneshot = world.new_subgroup(list(range(world_size)), algo="oneshot")
    bad: list[str] = []
    cases = [
        (torch.float32, ReduceOp.SUM),
        (torch.bfloat16, ReduceOp.SUM),
        (torch.float16, ReduceOp.SUM),
        (torch.int32, ReduceOp.MIN),
        (torch.int64, ReduceOp.SUM),
        (torch.int64, ReduceOp.MAX),
    ]
    for n in (64, 1000):  # units split unevenly between the ranks at 1000
        for dtype, op in cases:
            gen = torch.Generator().manual_seed(seed + rank * 1009 + n)
            if dtype.is_floating_point:
                x = (torch.rand(n, generator=gen, dtype=torch.float64) * 2 - 1).to(dtype)
            else:
                x = torch.randint(-1000, 1000, (n,), generator=gen, dtype=dtype)
            sym, plain = multimem.empty(n, dtype=dtype), x.clone()
            sym.copy_(x)
            for _ in range(2):  # twice: the barrier counts go on from the state words
                multimem.all_reduce(sym, op)
                oneshot.all_reduce(plain, op)
            if not torch.equal(sym.view(torch.uint8), plain.view(torch.uint8)):
                bad.append(f"rank {rank}: {n} x {dtype} {op.name}: the multicast view differs from one-shot")
    try:
        multimem.all_reduce(torch.ones(64))
    except gpucomm.UnsupportedError as err:
        bad.append(f"ordinary tensor: {err}")
    try:
        multimem.all_reduce(multimem.empty(64, dtype=torch.float32), ReduceOp.PRODUCT)
    except gpucomm.UnsupportedError as err:
        bad.append(f"product: {err}")
    # A rank that never arrives: the other's barrier ends at its deadline.
    late = world.new_subgroup(list(range(world_size)), algo="multimem", timeout=3.0)
    t = late.empty(64, dtype=torch.float32)
    if rank == 0:
        try:
            late.all_reduce(t)
        except gpucomm.CommTimeoutError as err:
            bad.append(f"timeout: {err}")
    for comm in (late, multimem, oneshot):
        comm.close()
    gpucomm.destroy_process_group()
    return bad


def test_multicast_view_matches_one_shot_and_says_why_not() -> None:
    seed = random.randrange(1 << 30)
    results = run_ranks(_view, 2, seed, env={"TRITON_INTERPRET": "1"}, timeout=600)
    for rank, seen in enumerate(results):
        text = "\n".join(seen)
        assert "differs" not in text, f"seed {seed}:\n{text}"
        assert (
            "ordinary tensor: gpucomm.all_reduce: the multimem path cannot serve this call: "
            "the tensor is not in the symmetric heap" in text
        ), text
        assert (
            "product: gpucomm.all_reduce: the multimem path cannot serve this call: "
            "the switch does not reduce torch.float32 with PRODUCT" in text
        ), text
        if rank == 0:
            assert "timeout: gpucomm all_reduce" in text and "multimem barrier" in text, text


def _unavailable(rank: int, world_size: int) -> str:
    import gpucomm

    gpucomm.init_process_group(transport="shm", kernels="torch", timeout=30)
    reason = gpucomm.get_default_communicator()._engines["cpu"].multimem.reason
    gpucomm.destroy_process_group()
    return reason


def test_unavailable_says_why_in_one_line() -> None:
    reasons = run_ranks(_unavailable, 1, timeout=120)
    assert reasons == ["the multimem kernel is Triton's, and this engine runs kernels=torch"]


if __name__ == "__main__" and sys.argv[1:] == ["--aot"]:
    print(json.dumps(_aot_worker()))
