"""One rank's comparison of every collective on symmetric tensors (gpucomm.empty) against the same
call on ordinary tensors holding the same values, bit for bit. Run by tests/workspace/test_symmetric.py
on the shm workspace and by tests/gpu/test_symmetric_gpu.py on the cuda_ipc one.
"""

from __future__ import annotations

__all__ = ["ALL_REDUCE_ALGOS", "every_collective_symmetric_and_ordinary"]

ALL_REDUCE_ALGOS = ("oneshot", "twoshot")


def _values(seed: int, rank: int, n: int, dtype: object) -> object:
    import torch

    gen = torch.Generator().manual_seed(seed * 7919 + rank * 101 + n)
    if dtype.is_floating_point:  # type: ignore[attr-defined]
        return (torch.rand(n, generator=gen, dtype=torch.float64) * 2 - 1).to(dtype)
    return torch.randint(-100, 101, (n,), generator=gen, dtype=dtype)


def _symmetric_like(t: object) -> object:
    import gpucomm

    s = gpucomm.empty(t.shape, dtype=t.dtype, device=t.device)  # type: ignore[attr-defined]
    s.copy_(t)
    return s


def every_collective_symmetric_and_ordinary(
    rank: int, world_size: int, seed: int, kernels: str, sizes: tuple, dtypes: tuple, device: str = "cpu"
) -> list[str]:
    """Each collective twice, on ordinary tensors and on symmetric ones holding the same
    values; returns the cases whose bytes differ (and the in-place checks that fail).
    ``device``: cpu (the shm workspace) or cuda (tests/gpu: the cuda_ipc one)."""
    import torch

    import gpucomm
    from gpucomm.ops.program import Slot, operands
    from gpucomm.reduce_op import ReduceOp

    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = f"cuda:{torch.cuda.current_device()}"
    transport = "shm" if device == "cpu" else "cuda_ipc"
    where = torch.device(device).type
    gpucomm.init_process_group(
        transport=transport, kernels=kernels, workspace_bytes="48K", heap_bytes="8M", timeout=120
    )
    comm = gpucomm.get_default_communicator()
    forced = {algo: comm.new_subgroup(list(range(world_size)), algo=algo) for algo in ALL_REDUCE_ALGOS}
    P = world_size
    bad: list[str] = []

    def same(what: str, a: torch.Tensor, b: torch.Tensor) -> None:
        if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
            bad.append(f"rank {rank}: {what}: symmetric and ordinary results differ")

    for n in sizes:
        for dtype in dtypes:
            x = _values(seed, rank, n, dtype).to(device)
            tag = f"{n} x {dtype}"
            for algo, sub in forced.items():
                for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX):
                    plain, sym = x.clone(), sub.empty(n, dtype=dtype, device=device)
                    sym.copy_(x)
                    sub.all_reduce(plain, op)
                    sub.all_reduce(sym, op)
                    same(f"all_reduce {algo} {op.name} {tag}", sym, plain)
                if algo == "twoshot" and n:
                    engine = sub._engines[where]
                    fields = (dtype, n, "MAX", "twoshot", "symmetric", sub.heap(where).offset(sym))
                    program = next((p for k, p in engine._programs.items() if k[1] == fields), None)
                    slots = (
                        []
                        if program is None
                        else [o for i in program.instructions for o in operands(i) if isinstance(o, Slot)]
                    )
                    if program is None or slots or program.syncs != 3:
                        syncs = None if program is None else program.syncs
                        bad.append(
                            f"rank {rank}: all_reduce twoshot {tag}: not in place: "
                            f"{len(slots)} slot operands, {syncs} syncs"
                        )
            # A contiguous slice of a symmetric tensor is symmetric too (every rank slices alike).
            if n > 2:
                sym, plain = _symmetric_like(x), x.clone()
                comm.all_reduce(sym[1:-1])
                comm.all_reduce(plain[1:-1])
                same(f"all_reduce of a slice {tag}", sym, plain)
            root = P - 1
            plain, sym = x.clone(), _symmetric_like(x)
            comm.broadcast(plain, root)
            comm.broadcast(sym, root)
            same(f"broadcast {tag}", sym, plain)
            plain, sym = x.clone(), _symmetric_like(x)
            comm.reduce(plain, root, ReduceOp.SUM)
            comm.reduce(sym, root, ReduceOp.SUM)
            same(f"reduce {tag}", sym, plain)
            out_plain = torch.zeros(P * n, dtype=dtype, device=device)
            out_sym = _symmetric_like(out_plain)
            comm.all_gather_into_tensor(out_plain, x)
            comm.all_gather_into_tensor(out_sym, _symmetric_like(x))
            same(f"all_gather_into_tensor {tag}", out_sym, out_plain)
            big = (
                torch.cat([_values(seed + 1, rank, n, dtype) for _ in range(P)]).to(device)
                if n
                else torch.zeros(0, dtype=dtype, device=device)
            )
            out_plain, out_sym = (
                torch.zeros(n, dtype=dtype, device=device),
                _symmetric_like(torch.zeros(n, dtype=dtype, device=device)),
            )
            comm.reduce_scatter_tensor(out_plain, big, ReduceOp.SUM)
            comm.reduce_scatter_tensor(out_sym, _symmetric_like(big), ReduceOp.SUM)
            same(f"reduce_scatter_tensor {tag}", out_sym, out_plain)
            outs_plain = [torch.zeros(n, dtype=dtype, device=device) for _ in range(P)]
            outs_sym = [_symmetric_like(t) for t in outs_plain]
            comm.all_gather(outs_plain, x)
            comm.all_gather(outs_sym, _symmetric_like(x))
            for p in range(P):
                same(f"all_gather [{p}] {tag}", outs_sym[p], outs_plain[p])
            a2a_plain, a2a_sym = (
                torch.zeros(P * n, dtype=dtype, device=device),
                _symmetric_like(torch.zeros(P * n, dtype=dtype, device=device)),
            )
            comm.all_to_all_single(a2a_plain, big)
            comm.all_to_all_single(a2a_sym, _symmetric_like(big))
            same(f"all_to_all_single {tag}", a2a_sym, a2a_plain)
            if P > 1:
                plain, sym = x.clone(), _symmetric_like(x)
                if rank == 0:
                    comm.send(x, 1)
                    comm.send(x, 1)
                elif rank == 1:
                    comm.recv(plain, 0)
                    comm.recv(sym, 0)
                same(f"send/recv {tag}", sym, plain)
    if max(sizes) * 2 > 18 << 10:  # a size above one half of the 48K workspace: in place under auto
        engine = comm._engines[where]
        in_place = {key[0] for key in engine._programs if "symmetric" in key[1]}
        expected = {"broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor"}
        if not expected <= in_place:
            bad.append(f"rank {rank}: no in-place program for {sorted(expected - in_place)}")
        # 10000 float32 elements: 40 KB, one-shot's size under auto (up to 64 KiB here), yet more
        # than a half: a symmetric tensor goes in place all the same (Engine.serves).
        one_shot_sized = [
            key
            for key in engine._programs
            if key[0] == "all_reduce"
            and "symmetric" in key[1]
            and key[1][0] == torch.float32
            and key[1][1] * 4 <= 64 << 10
        ]
        if torch.float32 in dtypes and 10000 in sizes and not one_shot_sized:
            bad.append(f"rank {rank}: a one-shot-sized symmetric all_reduce above a half did not run in place")
    for sub in forced.values():
        sub.close()
    gpucomm.destroy_process_group()
    return bad
