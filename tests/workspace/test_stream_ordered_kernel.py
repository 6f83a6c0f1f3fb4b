"""The stream-ordered path, checked without a GPU: the real program kernel of both families (Triton's
under the interpreter, CUDA C++'s built for the host with GPUCOMM_CUDA_EMULATE=1), across real
processes, on the shared-memory workspace.

- Launches per call: a collective on the program kernel is a fixed, small number of launches
  (one for every collective but all_to_all), counted where Triton starts a kernel.
- Graph replay: the launches of one call are recorded and replayed, and nothing else, several
  times with fresh data written into the same tensors, while the ranks drift apart (one rank
  starts each replay late). This is what a CUDA graph does; it works only if nothing the host
  decided (an epoch, a half of the workspace) is frozen in the launch's arguments.
"""

from __future__ import annotations

import random
import time

import pytest
from spawn import run_ranks

INTERPRET = {"TRITON_INTERPRET": "1"}
KNOBS = {"transport": "shm", "kernels": "triton", "workspace_bytes": "64K", "timeout": 60}
# The CUDA C++ family: kernels=cuda, built for the host with 64 threads a block.
FAMILIES = {
    "triton": (INTERPRET, KNOBS),
    "cuda": ({"GPUCOMM_CUDA_EMULATE": "1", "GPUCOMM_CUDA_EMULATE_THREADS": "64"}, {**KNOBS, "kernels": "cuda"}),
}
# The name of each family's program kernel in a launch record (the CUDA one's has its op and dtype).
PROGRAM = {"triton": "program_kernel", "cuda": "gpucomm_program_"}


class _Launches:
    """Records every kernel launch of this process: where Triton's interpreter runs a kernel, or
    where a host-built CUDA C++ kernel is launched (gpucomm.ops.cuda_host.HostLaunch)."""

    def __init__(self, family: str = "triton") -> None:
        self.calls: list[tuple] = []
        launches = self
        if family == "cuda":
            from gpucomm.ops.cuda_host import HostLaunch

            original = HostLaunch.__call__

            def launch(self):  # noqa: ANN001, ANN202
                launches.calls.append((self, (), {}))
                return original(self)

            HostLaunch.__call__ = launch
            self._original = original
            self._name = lambda fn: fn._name.decode()
            return
        from triton.runtime.interpreter import InterpretedFunction

        self._original = InterpretedFunction.run
        self._name = lambda fn: fn.fn.__name__

        def run(fn, *args, **kwargs):  # noqa: ANN001, ANN202 (Triton's signature)
            launches.calls.append((fn, args, kwargs))
            return launches._original(fn, *args, **kwargs)

        InterpretedFunction.run = run

    def names(self) -> list[str]:
        return [self._name(fn) for fn, _, _ in self.calls]

    def replay(self, calls: list[tuple]) -> None:
        for fn, args, kwargs in calls:
            self._original(fn, *args, **kwargs)


def _cases(rank: int, world_size: int, n: int):
    """(name, make inputs, call, check) for each collective under test; inputs are integer-valued
    floats so that every reference is exact."""
    import torch

    import gpucomm

    P = world_size

    def data(seed: int, r: int, count: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed * 1009 + r)
        return torch.randint(-50, 50, (count,), generator=gen).to(torch.float32)

    cases = []
    t = torch.empty(n)

    def all_reduce_fill(seed: int) -> None:
        t.copy_(data(seed, rank, n))

    def all_reduce_check(seed: int) -> bool:
        return torch.equal(t, sum(data(seed, r, n) for r in range(P)))

    for algo in ("oneshot", "twoshot"):
        cases.append(
            (f"all_reduce[{algo}]", {"algo": algo}, all_reduce_fill, lambda comm: comm.all_reduce(t), all_reduce_check)
        )

    gathered = torch.empty(n * P)
    mine = torch.empty(n)

    def all_gather_fill(seed: int) -> None:
        mine.copy_(data(seed, rank, n))
        gathered.fill_(float("nan"))

    def all_gather_check(seed: int) -> bool:
        return torch.equal(gathered, torch.cat([data(seed, r, n) for r in range(P)]))

    cases.append(
        (
            "all_gather_into_tensor",
            {},
            all_gather_fill,
            lambda comm: comm.all_gather_into_tensor(gathered, mine),
            all_gather_check,
        )
    )

    big = torch.empty(n * P)
    out = torch.empty(n)

    def reduce_scatter_fill(seed: int) -> None:
        big.copy_(data(seed, rank, n * P))
        out.fill_(float("nan"))

    def reduce_scatter_check(seed: int) -> bool:
        total = sum(data(seed, r, n * P) for r in range(P))
        return torch.equal(out, total[rank * n : (rank + 1) * n])

    cases.append(
        (
            "reduce_scatter_tensor",
            {},
            reduce_scatter_fill,
            lambda comm: comm.reduce_scatter_tensor(out, big),
            reduce_scatter_check,
        )
    )

    b = torch.empty(n)
    root = P - 1

    def broadcast_fill(seed: int) -> None:
        b.copy_(data(seed, rank, n)) if rank == root else b.fill_(float("nan"))

    def broadcast_check(seed: int) -> bool:
        return torch.equal(b, data(seed, root, n))

    cases.append(("broadcast", {}, broadcast_fill, lambda comm: comm.broadcast(b, root), broadcast_check))
    del gpucomm
    return cases


def _launches_and_replays(
    rank: int, world_size: int, n: int, replays: int, channels: int, family: str = "triton"
) -> dict[str, tuple[list[str], list[bool]]]:
    import dataclasses

    import gpucomm
    from gpucomm.comm.communicator import Communicator

    launches = _Launches(family)
    gpucomm.init_process_group(**FAMILIES[family][1])
    world = gpucomm.get_default_communicator()
    results = {}
    for name, overrides, fill, call, check in _cases(rank, world_size, n):
        config = dataclasses.replace(world.config, channels=channels, **overrides)
        with Communicator(world.store, rank, world_size, prefix=f"{world.prefix}{name}/", config=config) as comm:
            fill(0)
            call(comm)  # builds the program
            fill(1)
            launches.calls.clear()
            call(comm)
            recorded = list(launches.calls)
            names = launches.names()
            ok = [check(1)]
            for k in range(replays):
                fill(2 + k)
                if rank == k % world_size:
                    time.sleep(0.3)  # this rank starts late: the others wait for it inside the kernel
                launches.replay(recorded)
                ok.append(check(2 + k))
            fill(100)
            call(comm)  # and the eager path carries on from the replayed epochs
            ok.append(check(100))
        results[name] = (names, ok)
    gpucomm.destroy_process_group()
    return results


@pytest.mark.parametrize("family", ["triton", "cuda"])
@pytest.mark.parametrize("world_size,channels", [(2, 1), (3, 2), (4, 3)])
def test_one_launch_per_collective_and_graph_replay(world_size: int, channels: int, family: str) -> None:
    # 1000 floats: one piece in a 64 KiB workspace; channels > 1 split every instruction.
    env = FAMILIES[family][0]
    results = run_ranks(_launches_and_replays, world_size, 1000, 3, channels, family, env=env, timeout=600)
    for rank, per_case in enumerate(results):
        for name, (names, ok) in per_case.items():
            assert len(names) == 1 and names[0].startswith(PROGRAM[family]), f"rank {rank}, {name}: launches {names}"
            assert all(ok), f"rank {rank}, {name}: results of the call, each replay, the next call: {ok}"


def _replays_across_pieces(rank: int, world_size: int, seed: int, family: str = "triton") -> list[bool]:
    """A tensor of many pieces in a small workspace: one launch still, replayed with fresh data."""
    import torch

    import gpucomm

    launches = _Launches(family)
    gpucomm.init_process_group(**{**FAMILIES[family][1], "workspace_bytes": "4K", "channels": 2, "algo": "twoshot"})
    n = 3001  # fp32: 8 pieces of 1.5 KiB halves
    t = torch.empty(n)

    def data(k: int, r: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed + 31 * k + r)
        return torch.randint(-9, 9, (n,), generator=gen).to(torch.float32)

    t.copy_(data(0, rank))
    launches.calls.clear()
    gpucomm.all_reduce(t)
    recorded = list(launches.calls)
    ok = [len(recorded) == 1, torch.equal(t, sum(data(0, r) for r in range(world_size)))]
    for k in range(1, 4):
        t.copy_(data(k, rank))
        if rank == 0:
            time.sleep(0.2 * random.random())
        launches.replay(recorded)
        ok.append(torch.equal(t, sum(data(k, r) for r in range(world_size))))
    gpucomm.destroy_process_group()
    return ok


@pytest.mark.parametrize("family", ["triton", "cuda"])
def test_replay_of_a_many_piece_all_reduce(family: str) -> None:
    seed = random.randrange(1 << 20)
    results = run_ranks(_replays_across_pieces, 3, seed, family, env=FAMILIES[family][0], timeout=600)
    for rank, ok in enumerate(results):
        assert all(ok), f"seed {seed}, rank {rank}: one launch, then the call and 3 replays correct: {ok}"


def _launch_counts(rank: int, world_size: int, family: str = "triton") -> dict[str, int]:
    """Launches of one call of every collective, after a first call built its program."""
    import torch

    import gpucomm

    launches = _Launches(family)
    gpucomm.init_process_group(**FAMILIES[family][1])
    P, n = world_size, 7
    x = torch.ones(n)
    calls = {
        "all_reduce": lambda: gpucomm.all_reduce(x),
        "reduce": lambda: gpucomm.reduce(x, dst=0),
        "broadcast": lambda: gpucomm.broadcast(x, src=0),
        "all_gather": lambda: gpucomm.all_gather([torch.empty(n) for _ in range(P)], x),
        "all_gather_into_tensor": lambda: gpucomm.all_gather_into_tensor(torch.empty(n * P), x),
        "reduce_scatter_tensor": lambda: gpucomm.reduce_scatter_tensor(torch.empty(n), torch.ones(n * P)),
        "gather": lambda: gpucomm.gather(x, [torch.empty(n) for _ in range(P)] if rank == 0 else None, dst=0),
        "scatter": lambda: gpucomm.scatter(x, [torch.ones(n) for _ in range(P)] if rank == 0 else None, src=0),
        "all_to_all_single": lambda: gpucomm.all_to_all_single(torch.empty(P), torch.ones(P)),
        "barrier": lambda: gpucomm.barrier(),
    }
    counts = {}
    for name, call in calls.items():
        call()
        launches.calls.clear()
        call()
        counts[name] = len(launches.calls)
    gpucomm.destroy_process_group()
    return counts


@pytest.mark.parametrize("family", ["triton", "cuda"])
def test_launches_per_collective(family: str) -> None:
    for rank, counts in enumerate(run_ranks(_launch_counts, 3, family, env=FAMILIES[family][0], timeout=600)):
        expected = {name: 1 for name in counts}
        expected["all_to_all_single"] = 2  # sizes announced, the host reads them, then delivery
        # Buffers made per call (all_gather's output list, gather's) are new addresses, hence new
        # programs, but never more launches.
        assert counts == expected, f"rank {rank}: {counts}"
