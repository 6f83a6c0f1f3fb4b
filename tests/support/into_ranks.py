"""What each rank runs to check all_reduce_into(output, input), on CPU tensors (the shm workspace,
gloo) or CUDA ones (the cuda_ipc workspace): tests/comm/test_all_reduce_into.py and
tests/gpu/test_all_reduce_into_gpu.py call the same :func:`into_rank`, so the GPU test's body runs in
CI on CPU.

Every algorithm (a subgroup forced to each, and the communicator's own choice), sizes of one and of
many pieces (16 KiB workspaces: 6 KiB halves), a few dtypes and ops: output poisoned first, against a
float64 reference of fresh random inputs, the input bitwise unchanged, the output bitwise all_reduce's
on a copy. Then repeated calls on one pair with fresh inputs, on CUDA tensors the call captured in a
CUDA graph and replayed with fresh inputs copied in before each replay (a capture takes the
copy-then-in-place form, gpucomm.comm.reduce_into), and an eager call after them.
"""

from __future__ import annotations

__all__ = ["ALGOS", "into_rank", "check_into_results"]

ALGOS = ("oneshot", "twoshot", "ring", "tree", "auto")


def _inputs(seed: int, case: int, world_size: int, n: int, dtype: object) -> list[object]:
    """Every rank's input of one case, on CPU (each rank draws all of them, for the reference)."""
    import torch

    out = []
    for r in range(world_size):
        g = torch.Generator().manual_seed(seed * 1000 + case * 10 + r)
        x = torch.randn(n, generator=g, dtype=torch.float64) * 4
        out.append(x.round().to(dtype) if not dtype.is_floating_point else (x + 0.5).to(dtype))
    return out


def _reference(inputs: list[object], op: object, dtype: object) -> object:
    import torch

    from gpucomm import ReduceOp

    x = torch.stack([t.to(torch.float64) for t in inputs])
    fold = {
        ReduceOp.SUM: lambda: x.sum(0),
        ReduceOp.AVG: lambda: x.mean(0),
        ReduceOp.MAX: lambda: x.max(0).values,
        ReduceOp.MIN: lambda: x.min(0).values,
        ReduceOp.PRODUCT: lambda: x.prod(0),
    }[op]()
    return fold if dtype.is_floating_point else torch.trunc(fold) if op is ReduceOp.AVG else fold


def _cases(lean: bool) -> list[tuple[int, object, object]]:
    import torch

    from gpucomm import ReduceOp

    # 7 elements: one piece; 4099 float32: 3 pieces of 6 KiB halves (two-shot pipelined);
    # 20011: 14-27 pieces (the pipelined two-shot, several ring pieces).
    cases = [
        (7, torch.float32, ReduceOp.SUM),
        (4099, torch.float32, ReduceOp.AVG),
        (20011, torch.float32, ReduceOp.SUM),
        (4099, torch.bfloat16, ReduceOp.MAX),
        (4099, torch.int32, ReduceOp.SUM),
        (20011, torch.float16, ReduceOp.MIN),
        (1000, torch.float64, ReduceOp.PRODUCT),
    ]
    return cases[:4] if lean else cases


def _bits(t: object) -> object:
    """An integer view of ``t`` (same element size), for bitwise comparisons."""
    import torch

    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _close(out: object, want: object, dtype: object) -> bool:
    import torch

    tol = {torch.bfloat16: 2e-2, torch.float16: 2e-3}.get(dtype, 1e-5)
    return torch.allclose(out.cpu().to(torch.float64), want, rtol=tol, atol=tol * 4)


def into_rank(
    rank: int, world_size: int, seed: int, kernels: str, transport: str, device_type: str = "cpu"
) -> tuple[list[str], str]:
    """One rank's checks (module docstring); returns its failures and its GPUCOMM_DEBUG=DEBUG log."""
    import io
    import logging

    import torch

    import gpucomm

    if device_type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    stream = io.StringIO()
    # A rank's first call on a GPU compiles the program kernel while its peers wait: a long timeout there.
    timeout = 120 if device_type == "cuda" else 60
    gpucomm.init_process_group(transport=transport, kernels=kernels, workspace_bytes="16K", timeout=timeout)
    logging.getLogger("gpucomm").addHandler(logging.StreamHandler(stream))
    logging.getLogger("gpucomm").setLevel(logging.DEBUG)
    comm = gpucomm.get_default_communicator()
    everyone = list(range(world_size))
    algos = ALGOS if transport in ("shm", "cuda_ipc") else ("auto",)
    groups = {a: comm if a == "auto" else comm.new_subgroup(everyone, algo=a) for a in algos}
    failures = []
    lean = kernels != "torch" or transport != "shm"
    for case, (n, dtype, op) in enumerate(_cases(lean)):
        inputs = _inputs(seed, case, world_size, n, dtype)
        want = _reference(inputs, op, dtype)
        for algo, group in groups.items():
            tag = f"n={n} {dtype} {op.name} algo={algo}"
            x = inputs[rank].to(device, copy=True)
            kept = x.clone()
            out = torch.empty_like(x)
            out.view(torch.uint8).fill_(0x7F)  # poisoned: a byte the call does not write shows
            group.all_reduce_into(out, x, op)
            copy = inputs[rank].to(device, copy=True)
            group.all_reduce(copy, op)
            if not torch.equal(_bits(x), _bits(kept)):
                failures.append(f"{tag}: the input changed")
            if not torch.equal(_bits(out), _bits(copy)):
                failures.append(f"{tag}: output differs in bits from all_reduce on a copy")
            if not _close(out, want, dtype):
                failures.append(
                    f"{tag}: output is not the reduction (max error {(out.cpu().double() - want).abs().max()})"
                )
    op = _cases(lean)[-1][2]
    # output is input: exactly all_reduce.
    y = inputs[rank].to(device, copy=True)
    z = inputs[rank].to(device, copy=True)
    comm.all_reduce_into(y, y, op)
    comm.all_reduce(z, op)
    if not torch.equal(y, z):
        failures.append("all_reduce_into(x, x) is not all_reduce(x)")
    # An asynchronous call: its Work ends with the output written.
    a, out = inputs[rank].to(device, copy=True), torch.zeros_like(z)
    comm.all_reduce_into(out, a, op, async_op=True).wait()
    if not torch.equal(out, z):
        failures.append("async all_reduce_into differs from all_reduce")
    failures += _repeated_and_captured(rank, world_size, seed, comm, device)
    for algo, group in groups.items():
        if algo != "auto":
            group.close()
    gpucomm.destroy_process_group()
    return failures, stream.getvalue()


def _repeated_and_captured(rank: int, world_size: int, seed: int, comm: object, device: object) -> list[str]:
    """One pair (out, x) called eagerly (the repeat's kept launch from the second call on), then on
    CUDA tensors from a CUDA graph, then eagerly again, each time with fresh inputs copied into x and
    out poisoned: out against all_reduce on a copy (bitwise) and the float64 reference, x unchanged."""
    import torch

    from gpucomm import ReduceOp

    n, dtype, op = 1000, torch.float32, ReduceOp.SUM
    x = torch.empty(n, dtype=dtype, device=device)
    out = torch.empty_like(x)
    failures: list[str] = []

    def fresh(step: int) -> tuple[object, object]:
        inputs = _inputs(seed, 100 + step, world_size, n, dtype)
        x.copy_(inputs[rank])
        out.fill_(float("nan"))
        return inputs[rank], _reference(inputs, op, dtype)

    def check(step: int, mine: object, want: object, how: str) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        copy = mine.to(device, copy=True)
        comm.all_reduce(copy, op)
        if not torch.equal(_bits(x.cpu()), _bits(mine)):
            failures.append(f"{how} {step}: the input changed")
        if not torch.equal(_bits(out), _bits(copy)):
            failures.append(f"{how} {step}: output differs in bits from all_reduce on a copy")
        if not _close(out, want, dtype):
            failures.append(f"{how} {step}: output is not the reduction")

    for step in range(3):
        mine, want = fresh(step)
        comm.all_reduce_into(out, x, op)
        check(step, mine, want, "eager")
    if device.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            comm.all_reduce_into(out, x, op)
        for step in range(3, 8):
            mine, want = fresh(step)
            graph.replay()
            check(step, mine, want, "replay")
        del graph
    mine, want = fresh(8)
    comm.all_reduce_into(out, x, op)  # eager again, from the epochs the replays left on the device
    check(8, mine, want, "eager after the replays")
    return failures


def check_into_results(results: list[tuple[list[str], str]], seed: int) -> list[str]:
    """Raise AssertionError with every rank's failures; else return each rank's log."""
    failures = [f"rank {r}: {f}" for r, (fails, _) in enumerate(results) for f in fails]
    if failures:
        raise AssertionError(f"seed {seed}:\n" + "\n".join(failures[:40]))
    return [log for _, log in results]
