"""Bound launches on a GPU: 2 ranks on the cuda_ipc workspace (they may share one GPU), the Triton
and CUDA C++ program kernels.

- Repeated blocking all_reduces, and the CUDA C++ copy, reduce, signal and wait, go through
  gpucomm's launcher only: Triton's JIT dispatch, a compiled kernel's own launcher and gpucomm's
  way into CuPy's Function (its argument conversion) are patched to raise after the warm-up, and
  every result is right. With GPUCOMM_NATIVE=0 (no launcher), Triton's compiled kernel's own
  launcher serves, never the JIT dispatch, and CuPy's Function the CUDA C++ kernels.
- A repeated call captured into a CUDA graph is the same bound launch on the capturing stream:
  replays give the right sums.
- The Triton kernel compiled by ``triton_launch.compile_for`` is the one Triton's JIT would
  compile for the same arguments (same hash): the binder's specialisation is reproduced.

Skipped without CUDA and CuPy.
"""

from __future__ import annotations

import pytest
from cuda_group import NEEDS_CUDA_IPC, init_cuda_group
from spawn import run_ranks

pytestmark = NEEDS_CUDA_IPC

KERNELS = ("triton", "cuda")
WORLD = 2
N = 4096
REPEATS = 20


def _refuse(what: str):  # noqa: ANN202
    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a repeated call entered {what}")

    return refused


def _repeated(rank: int, world_size: int, kernels: str, bound: bool) -> list[str]:
    import time

    import torch
    import triton.compiler.compiler as compiler
    from triton.runtime.jit import JITFunction

    import gpucomm
    from gpucomm.ops.contract import Region
    from gpucomm.ops.cuda_ops import CudaKernels
    from gpucomm.ops.registry import get_kernels
    from gpucomm.reduce_op import ReduceOp

    device = init_cuda_group(rank, kernels)
    t = torch.empty(N, device=device)
    t.fill_(1.0)
    gpucomm.all_reduce(t)
    gpucomm.all_reduce(t)  # learned by the fast path
    ops = get_kernels(kernels, device)
    src, dst = torch.arange(N, dtype=torch.float32, device=device), torch.empty(N, device=device)
    if kernels == "cuda":
        ops.copy(Region.of(dst), Region.of(src))  # binds gpucomm_copy
    torch.cuda.synchronize(device)
    JITFunction.run = _refuse("JITFunction.run")
    if bound:  # without the launcher these are what serve
        compiler.CompiledKernel.run = property(_refuse("CompiledKernel.run"))
        # gpucomm's one way into CuPy's Function (whose type CuPy 14 makes immutable: it cannot
        # be patched itself).
        CudaKernels._launch_on = _refuse("CuPy's Function (CudaKernels._launch_on)")
    failures = []
    for k in range(REPEATS):
        t.fill_(float(rank + k))
        gpucomm.all_reduce(t)
        want = float(sum(r + k for r in range(world_size)))
        if not torch.equal(t, torch.full_like(t, want)):
            failures.append(f"rank {rank}, call {k}: {t[:2].tolist()}, expected {want}")
    if kernels == "cuda":
        dst.zero_()
        ops.copy(Region.of(dst[1:]), Region.of(src[: N - 1]))  # other words, another grid
        if not torch.equal(dst[1:], src[: N - 1]):
            failures.append(f"rank {rank}: gpucomm_copy copied {dst[:4].tolist()}")
        # reduce, signal and wait: through the launcher too, never CuPy's Function (whose launches
        # the results on an H100 did not follow).
        ops.reduce(Region.of(dst), [Region.of(src), Region.of(src)], torch.float32, ReduceOp.SUM)
        if not torch.equal(dst, 2 * src):
            failures.append(f"rank {rank}: the CUDA C++ reduce gave {dst[:4].tolist()}")
        flag = torch.zeros(2, dtype=torch.int64, device=device)
        ops.signal([Region.of(flag[:1])], 3)
        missing = ops.wait([Region.of(flag[:1]), Region.of(flag[1:])], 3, time.monotonic() + 0.1)
        if missing != [1] or flag.tolist() != [3, 0]:
            failures.append(f"rank {rank}: signal then wait: missing {missing}, flags {flag.tolist()}")
    # Captured: the same bound launch on the capturing stream.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gpucomm.all_reduce(t)
    for k in range(3):
        t.fill_(float(rank + 10 * k))
        graph.replay()
        torch.cuda.synchronize(device)
        want = float(sum(r + 10 * k for r in range(world_size)))
        if not torch.equal(t, torch.full_like(t, want)):
            failures.append(f"rank {rank}, replay {k}: {t[:2].tolist()}, expected {want}")
    del graph
    gpucomm.destroy_process_group()
    return failures


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("native", ["1", "0"], ids=["launcher", "no-launcher"])
def test_repeated_and_captured_calls_launch_through_the_launcher_only(kernels: str, native: str) -> None:
    for failures in run_ranks(_repeated, WORLD, kernels, native == "1", env={"GPUCOMM_NATIVE": native}, timeout=600):
        assert not failures, failures


def _same_kernel_as_the_jit(rank: int, world_size: int) -> list[str]:
    import torch
    from triton.runtime import driver

    from gpucomm._kernels.triton import program
    from gpucomm.ops import triton_launch
    from gpucomm.ops.launch_args import ProgramArgs

    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    prog, operands, peers = (torch.zeros(n, dtype=torch.int64, device=device) for n in (3 * program.WORDS, 12, 4))
    grid, values, constexprs, options = program.arguments(
        ProgramArgs(
            prog,
            operands,
            peers,
            0x7F00_0000_1000,
            0x7F00_0000_2000,
            channels=2,
            rank=0,
            world=2,
            fingerprint=9,
            half_bytes=1 << 20,
            granule=4096,
            timeout_ns=120 * 10**9,
            dtype=torch.float32,
            op=0,
            copy_bytes=8,
            aligned=True,
        )
    )
    ours = triton_launch.compile_for(
        program.program_kernel, driver.active.get_current_target(), values, constexprs, options
    )
    jit = program.program_kernel.warmup(*values, grid=grid, **constexprs, **options)
    return [] if ours.hash == jit.hash else [f"compile_for made {ours.hash}, the JIT {jit.hash}"]


def test_compile_for_makes_the_kernel_the_jit_would() -> None:
    for failures in run_ranks(_same_kernel_as_the_jit, 1, timeout=600):
        assert not failures, failures
