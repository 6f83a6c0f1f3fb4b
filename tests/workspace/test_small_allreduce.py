"""The small-message all_reduce (gpucomm.workspace.small, ``GPUCOMM_ALGO=oneshot_small``) of both kernel
families, Triton's under the interpreter and CUDA C++'s built for the host (GPUCOMM_CUDA_EMULATE=1),
across real processes on the shared-memory workspace: every op of fp32, fp16, bf16
and int32 (fp64 and int64 at small sizes) at 1, 7 and 4099 elements against float64 references,
bitwise the same on every rank and bitwise the program kernel's one-shot; repeated calls on one
buffer (the host's fast path) with fresh inputs and this rank's halves poisoned before each;
launches of the program kernel in between; a rank calling another shape raises
CommMismatchError, a rank that never comes makes the others raise CommTimeoutError in time.
The PTX side (one global load before a peer's data) is tests/ops/test_small_ptx.py.
"""

from __future__ import annotations

import random
import time

import pytest
from spawn import run_ranks

INTERPRET = {"TRITON_INTERPRET": "1"}
# The CUDA C++ kernels built for the host, 64 threads a block (512, the GPU's, in one case).
EMULATE = {"GPUCOMM_CUDA_EMULATE": "1", "GPUCOMM_CUDA_EMULATE_THREADS": "64"}
FAMILIES = {"triton": INTERPRET, "cuda": EMULATE}
# 48 KiB halves: 4099 elements of 4 bytes fit one, as any message `auto` gives this path does.
WORKSPACE = "128K"
SIZES = (1, 7, 4099)
# The CUDA C++ kernels' runs (fast on the host) add whole 16-byte vectors, where a channel's share
# of 1 channel ends exactly at the end of the tensor.
CUDA_SIZES = (1, 7, 4096, 4099)


def _poison_my_halves(engine) -> None:
    """Garbage in both of this rank's halves: a kernel that folded a stale half would show it.
    Called between barriers, when no peer reads them."""
    ws = engine.workspace
    ws.data(engine.rank, engine.p2p_bytes, 2 * engine.half_bytes).bytes.fill_(0xFF)


def _matrix(
    rank: int, world_size: int, seed: int, channels: int | None, kernels: str = "triton", sizes: tuple = SIZES
) -> tuple[list[str], list[str]]:
    import torch
    from collective_matrix import OPS, close_enough, digest, make_input, reference

    import gpucomm

    knobs = {} if channels is None else {"channels": channels}
    gpucomm.init_process_group(
        transport="shm", kernels=kernels, algo="oneshot_small", workspace_bytes=WORKSPACE, timeout=60, **knobs
    )
    comm = gpucomm.get_default_communicator()
    engine = comm._engines["cpu"]
    problems, digests = [], []
    if engine.serves("all_reduce", torch.ones(7)) != "oneshot_small":
        problems.append(f"served by {engine.serves('all_reduce', torch.ones(7))}")
    program = comm.new_subgroup(list(range(world_size)), algo="oneshot")
    case = 0
    for i, dtype in enumerate((torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.float64, torch.int64)):
        for j, op in enumerate(OPS):
            for n in sizes if dtype.itemsize < 8 else sizes[:2]:
                case += 1
                ins = [make_input(seed, case, r, n, dtype, op) for r in range(world_size)]
                t = ins[rank].clone()
                gpucomm.all_reduce(t, op=op)
                if not close_enough(t, reference(ins, op, dtype), ins, op):
                    problems.append(f"{dtype} {op.name} n={n}: wrong result")
                digests.append(digest(t))
                if n == sizes[-1] and (i + j) % 2 == 0:  # the ops in turn: the program kernel's bits
                    u = ins[rank].clone()
                    program.all_reduce(u, op=op)
                    if not torch.equal(t.view(torch.uint8), u.view(torch.uint8)):
                        problems.append(f"{dtype} {op.name} n={n}: not the program kernel's one-shot bit for bit")
    # Repeated calls on one buffer: from the second on the host's fast path launches what the first
    # bound. Each call gets fresh inputs; this rank's halves hold garbage before it.
    buf = torch.empty(4099, dtype=torch.float32)
    for k in range(4):
        gpucomm.barrier()
        _poison_my_halves(engine)
        gpucomm.barrier()
        case += 1
        ins = [make_input(seed, case, r, buf.numel(), buf.dtype, OPS[0]) for r in range(world_size)]
        buf.copy_(ins[rank])
        gpucomm.all_reduce(buf)
        if not close_enough(buf, reference(ins, OPS[0], buf.dtype), ins, OPS[0]):
            same = torch.equal(buf, ins[rank])
            problems.append(f"repeat {k}: wrong result{' (this rank own input)' if same else ''}")
        digests.append(digest(buf))
        if k and comm._repeat.find(buf, gpucomm.ReduceOp.SUM) is None:
            problems.append(f"repeat {k}: not on the host's fast path")
    program.close()
    gpucomm.destroy_process_group()
    return problems, digests


def _check_matrix(results: list, seed: int) -> None:
    problems = [f"rank {r}: {p}" for r, (probs, _) in enumerate(results) for p in probs]
    assert not problems, f"seed {seed}:\n" + "\n".join(problems[:40])
    digests = [d for _, d in results]
    for r, d in enumerate(digests):
        assert d == digests[0], f"seed {seed}: rank {r}'s results differ bitwise from rank 0's"


@pytest.mark.parametrize("world_size, channels", [(2, None), (3, 3), (4, None)])
def test_small_all_reduce_matches_the_reference_and_the_program_kernel(world_size: int, channels: int | None) -> None:
    seed = random.randrange(1 << 30)
    _check_matrix(run_ranks(_matrix, world_size, seed, channels, env=INTERPRET, timeout=900), seed)


@pytest.mark.parametrize("world_size, channels, threads", [(2, None, 512), (3, 3, 64), (4, None, 64), (8, 2, 64)])
def test_cuda_small_all_reduce_matches_the_reference_and_the_program_kernel(
    world_size: int, channels: int | None, threads: int
) -> None:
    """small.cu and program.cu built for the host: the same matrix, at 8 ranks too, and once with
    the GPU's 512 threads a block."""
    seed = random.randrange(1 << 30)
    env = {**EMULATE, "GPUCOMM_CUDA_EMULATE_THREADS": str(threads)}
    _check_matrix(run_ranks(_matrix, world_size, seed, channels, "cuda", CUDA_SIZES, env=env, timeout=900), seed)


def test_both_families_give_the_same_bits() -> None:
    """small.cu and kernels/triton/small.py (and each family's program kernel) on the same inputs."""
    seed = random.randrange(1 << 30)
    cuda = run_ranks(_matrix, 2, seed, None, "cuda", env=EMULATE, timeout=900)
    triton = run_ranks(_matrix, 2, seed, None, "triton", env=INTERPRET, timeout=900)
    _check_matrix(cuda, seed)
    assert cuda[0][1] == triton[0][1], f"seed {seed}: the CUDA C++ and Triton kernels' results differ bitwise"


def _mismatch(rank: int, world_size: int, kernels: str = "triton") -> str:
    import torch

    import gpucomm

    gpucomm.init_process_group(
        transport="shm", kernels=kernels, algo="oneshot_small", workspace_bytes=WORKSPACE, timeout=20
    )
    gpucomm.all_reduce(torch.ones(5))  # a first call that agrees
    try:
        gpucomm.all_reduce(torch.ones(7 + rank))  # rank 1 calls another size
    except gpucomm.CommMismatchError as err:
        return f"mismatch {err.peers}"
    return "returned"


@pytest.mark.parametrize("kernels", ["triton", "cuda"])
def test_ranks_calling_different_shapes_raise_mismatch(kernels: str) -> None:
    results = run_ranks(_mismatch, 2, kernels, env=FAMILIES[kernels], timeout=300)
    assert results == ["mismatch [1]", "mismatch [0]"], results


def _absent(rank: int, world_size: int, timeout: float, kernels: str = "triton") -> float:
    import torch

    import gpucomm

    gpucomm.init_process_group(
        transport="shm", kernels=kernels, algo="oneshot_small", workspace_bytes=WORKSPACE, timeout=timeout
    )
    gpucomm.all_reduce(torch.ones(5))
    gpucomm.barrier()
    if rank == 1:
        time.sleep(timeout + 8)  # never calls; its process lives on until the others are done
        return 0.0
    start = time.monotonic()
    try:
        gpucomm.all_reduce(torch.ones(5))
    except gpucomm.CommTimeoutError as err:
        assert err.missing == [1], str(err)
        return time.monotonic() - start
    raise AssertionError("all_reduce with an absent peer returned")


@pytest.mark.parametrize("kernels", ["triton", "cuda"])
def test_an_absent_rank_makes_the_others_time_out(kernels: str) -> None:
    timeout = 3.0
    results = run_ranks(_absent, 2, timeout, kernels, env=FAMILIES[kernels], timeout=300)
    assert timeout * 0.9 <= results[0] <= timeout + 15, results


def _too_large(rank: int, world_size: int) -> str:
    import torch

    import gpucomm

    gpucomm.init_process_group(
        transport="shm", kernels="triton", algo="oneshot_small", workspace_bytes="16K", timeout=20
    )
    try:
        gpucomm.all_reduce(torch.ones(4099))  # 16 KiB, over a 6 KiB half
    except gpucomm.UnsupportedError as err:
        return str(err)
    return "served"


def test_a_message_larger_than_a_half_is_refused_before_any_launch() -> None:
    results = run_ranks(_too_large, 2, env=INTERPRET, timeout=300)
    for text in results:
        assert "oneshot_small" in text and "do not fit one half" in text, text


def _torch_kernels(rank: int, world_size: int) -> str:
    import torch

    import gpucomm

    gpucomm.init_process_group(transport="shm", kernels="torch", algo="oneshot_small", timeout=20)
    t = torch.ones(7)
    try:
        gpucomm.all_reduce(t)
    except gpucomm.UnsupportedError as err:
        return str(err) if torch.equal(t, torch.ones(7)) else "refused after moving data"
    return "served"


def test_the_torch_kernels_are_refused_by_name() -> None:
    for text in run_ranks(_torch_kernels, 2, timeout=120):
        assert "oneshot_small" in text and "kernels=torch" in text, text


def test_auto_takes_the_small_path_on_cuda_tensors_up_to_64_kib() -> None:
    from gpucomm.algorithms import select

    # Wherever the model has one-shot ahead (its GPU threshold per world size), up to 64 KiB.
    assert select.choose("all_reduce", 64 << 10, 2, "cuda_ipc", "auto") == select.SMALL
    assert select.choose("all_reduce", 4, 2, "cuda_ipc", "auto") == select.SMALL
    assert select.choose("all_reduce", (64 << 10) + 1, 2, "cuda_ipc", "auto") == "oneshot"
    at_8 = select.oneshot_max_bytes(8, "cuda_ipc")
    assert select.choose("all_reduce", at_8, 8, "cuda_ipc", "auto") == select.SMALL
    assert select.choose("all_reduce", at_8 + 4, 8, "cuda_ipc", "auto") == "twoshot"
    # CPU tensors stay on the program kernel's one-shot; the name serves wherever it is given.
    assert select.choose("all_reduce", 4096, 4, "shm", "auto") == "oneshot"
    assert select.choose("all_reduce", 4096, 4, "shm", "oneshot_small") == select.SMALL
    assert select.choose("all_reduce", 4096, 4, "shm", "all_reduce=oneshot_small") == select.SMALL
