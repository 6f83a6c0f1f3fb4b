"""What one rank of ``python -m gpucomm._bench.breakdown`` measures (the module docstring there says
what and why); it sends back every round's samples and every check's count of wrong elements.

Every program runs through the engine's own executor (``DeviceExecutor.run``): on a GPU captured
into a CUDA graph and replayed (:func:`timing.time_graph`, after one eager run that puts its tables
on the device, as tests/gpu/test_program_cache_gpu.py and bench/gpu_latency.py do before a capture),
on the CPU timed call by call (:func:`timing.time_calls`). Between measurements every rank waits
for its device and meets the others (:func:`_settle`), so that no rank's programs without a SYNC
run beside another's of the measurement before. Checks follow the timed calls
(:func:`timing.check_after`): inputs refilled, outputs poisoned, one more call, compared exactly
(small integers, exact in float32).
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
import traceback
from collections.abc import Callable
from functools import partial

from . import breakdown_programs as bp
from .ranks import rank_env
from .timing import check_after, count_wrong, time_calls, time_graph

__all__ = ["rank_main", "workspace_for", "pattern"]

_ALIGN = 1 << 20  # workspaces of whole MiB


def workspace_for(nbytes: int) -> int:
    """The smallest whole-MiB ``workspace_bytes`` whose halves hold ``nbytes``
    (gpucomm.workspace.layout.DataLayout: a quarter for send/recv, then two halves)."""
    from gpucomm.workspace.layout import DataLayout

    size = -(-8 * nbytes // 3 // _ALIGN) * _ALIGN
    while DataLayout(size).half_bytes < nbytes:
        size += _ALIGN
    return size


def pattern(rank: int, n: int, device: object) -> object:
    """Rank ``rank``'s data: ``(rank + 1) * (i % 7 + 1)``, small integers whose sums are exact."""
    import torch

    return (torch.arange(n, device=device) % 7 + 1).float() * (rank + 1)


def _calls(nbytes: int, iters: int) -> int:
    """Calls per graph (or timed calls on the CPU): fewer where one call moves much."""
    return iters if nbytes <= 4 << 20 else max(2, iters // 4)


class _Rank:
    """One rank's state: its device, its world communicator and how it times a call."""

    def __init__(self, rank: int, world: int, args: argparse.Namespace) -> None:
        import torch

        import gpucomm

        self.torch, self.rank, self.world, self.args = torch, rank, world, args
        if args.device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        transport = "cuda_ipc" if args.device == "cuda" else "shm"
        gpucomm.init_process_group(transport=transport, kernels=args.kernels, timeout=args.timeout)
        self.comm = gpucomm.get_default_communicator()
        self.started = time.monotonic()

    def settle(self) -> None:
        """This rank's device idle, then every rank here: a measurement starts on all at once."""
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)
        self.comm.barrier()

    def timed(self, call: Callable[[], None], nbytes: int) -> list[float]:
        """Seconds per call of ``call``: a sample per graph replay on a GPU, per call on the CPU."""
        calls = _calls(nbytes, self.args.iters)
        self.settle()
        if self.device.type == "cuda":
            return time_graph(call, self.device, self.args.warmup, calls, self.args.replays)
        return time_calls(call, self.device, self.args.warmup, calls)

    def progress(self, what: str) -> None:
        """Rank 0 says how far it got (a step that runs out of time shows where)."""
        if self.rank == 0:
            print(f"# breakdown: {what} ({time.monotonic() - self.started:.1f} s)", flush=True)

    def pattern(self, rank: int, n: int) -> object:
        return pattern(rank, n, self.device)


def _rounds(me: _Rank, calls: dict[str, Callable[[], None]], nbytes: int) -> dict[str, list[list[float]]]:
    """``args.rounds`` rounds of every call in ``calls``, in alternating order round after round."""
    names = list(calls)
    samples: dict[str, list[list[float]]] = {name: [] for name in names}
    for r in range(me.args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            samples[name].append(me.timed(calls[name], nbytes))
    return samples


def _steps(me: _Rank, variants: Callable) -> dict:
    """(a): the all_reduce's program and its variants at each of ``args.step_sizes``."""
    torch, engine = me.torch, me.comm._engines[me.device.type]
    run, out = engine.executor.run, {}
    P = me.world
    for nbytes in me.args.step_sizes:
        n = max(1, nbytes // 4)
        t = torch.empty(n, device=me.device)
        algo, full = bp.all_reduce_program(engine, t)
        progs, addrs = variants(full), (t.data_ptr(),)
        mine = me.pattern(me.rank, n)
        want = me.pattern(0, n) * (P * (P + 1) // 2)
        t.copy_(mine)
        for prog in progs.values():  # each program's tables on the device, its kernel compiled
            me.settle()
            run(prog, addrs)
        samples = _rounds(me, {name: partial(run, prog, addrs) for name, prog in progs.items()}, nbytes)
        me.settle()
        # In place: the refilled input stands for the poison (a call that does nothing leaves it,
        # and it differs from the sum at every element for P >= 2).
        check_after(partial(t.copy_, mine), partial(run, progs["full"], addrs), me.device)
        engine.executor.check()
        out[str(nbytes)] = {
            "algo": algo,
            "instructions": {name: bp.moves(prog) for name, prog in progs.items()},
            "rounds": samples,
            "wrong": count_wrong(t, want),
        }
        me.progress(f"(a) {nbytes} B done")
    return out


def _reduce_and_copy(me: _Rank) -> tuple[dict, dict]:
    """(b) one REDUCE of every rank's half at each channel count and size; (c) at ``args.copy_channels``,
    a COPY pulled from the next rank's half against one pushed into it."""
    torch, args, P = me.torch, me.args, me.world
    peer, source = (me.rank + 1) % P, (me.rank - 1) % P  # I push to peer; source pushes to me
    workspace = workspace_for(max(args.sizes))
    reduced: dict[str, dict] = {}
    copied: dict[str, dict] = {}
    for g in args.channels:
        sub = me.comm.new_subgroup(list(range(P)), channels=g, workspace_bytes=workspace)
        engine = sub._engines[me.device.type]
        run = engine.executor.run
        reduced[str(g)] = {}
        for nbytes in args.sizes:
            n = nbytes // 4
            data, out = me.pattern(me.rank, n), torch.empty(n, device=me.device)
            staged, red = bp.stage(engine, data), bp.reduce_halves(engine, out)
            at_data, at_out = (data.data_ptr(),), (out.data_ptr(),)
            me.settle()
            run(staged, at_data)
            me.settle()
            run(red, at_out)
            samples = _rounds(me, {"reduce": partial(run, red, at_out)}, nbytes)["reduce"]
            me.settle()
            check_after(partial(out.fill_, float("nan")), partial(run, red, at_out), me.device)
            engine.executor.check()
            want = me.pattern(0, n) * (P * (P + 1) // 2)
            reduced[str(g)][str(nbytes)] = {"rounds": samples, "wrong": count_wrong(out, want)}
            me.progress(f"(b) {g} channels, {nbytes} B done")
            if g == args.copy_channels:
                copied[str(nbytes)] = _pull_push(me, engine, data, out, peer, source)
                me.progress(f"(c) {nbytes} B done")
        me.settle()
        sub.close()
    return reduced, copied


def _pull_push(me: _Rank, engine: object, data: object, out: object, peer: int, source: int) -> dict:
    """(c) on the staged halves: pull from ``peer``'s into ``out``, push ``data`` into ``peer``'s
    half of the current round; then each checked."""
    torch, run = me.torch, engine.executor.run
    nbytes = data.numel() * data.element_size()
    pulled, pushed = bp.pull(engine, out, peer), bp.push(engine, data, peer)
    at_data, at_out = (data.data_ptr(),), (out.data_ptr(),)
    for prog, addrs in ((pulled, at_out), (pushed, at_data)):
        me.settle()
        run(prog, addrs)
    samples = _rounds(me, {"pull": partial(run, pulled, at_out), "push": partial(run, pushed, at_data)}, nbytes)
    me.settle()
    check_after(partial(out.fill_, float("nan")), partial(run, pulled, at_out), me.device)
    pull_wrong = count_wrong(out, me.pattern(peer, out.numel()))
    # A push is checked where it lands: this rank's half of the round, poisoned first by this rank
    # (every rank's poison is in before any rank pushes), then the push of ``source``, then a
    # program whose SYNC waits for every rank's push and copies the half out.
    poison = torch.full_like(data, float("nan"))
    filled, landed = bp.fill(engine, poison), bp.land(engine, out)
    me.settle()
    run(filled, (poison.data_ptr(),))
    me.settle()
    run(pushed, at_data)
    out.fill_(float("nan"))
    run(landed, at_out)
    me.settle()
    engine.executor.check()
    push_wrong = count_wrong(out, me.pattern(source, out.numel()))
    return {
        "pull": {"rounds": samples["pull"], "wrong": pull_wrong},
        "push": {"rounds": samples["push"], "wrong": push_wrong},
    }


def rank_main(
    rank: int,
    world: int,
    port: int,
    args: argparse.Namespace,
    results: multiprocessing.Queue,
    variants: Callable | None = None,
) -> None:
    """One rank: (a), then (b) and (c); ``(rank, measured)`` or ``(rank, {"error": traceback})`` on
    ``results``. ``variants``: what makes the variants of a program (:func:`breakdown_programs.variants`)."""
    rank_env(rank, world, port)
    try:
        me = _Rank(rank, world, args)
        steps = _steps(me, variants or bp.variants)
        reduced, copied = _reduce_and_copy(me) if args.sizes else ({}, {})
        me.settle()
        import gpucomm

        gpucomm.destroy_process_group()
        results.put((rank, {"steps": steps, "reduce": reduced, "copy": copied}))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))
        raise
