"""Several threads calling one communicator: their calls are serialised in call order, never mixed.

Each rank runs two threads; each thread makes blocking all_reduces, each on a fresh tensor of the
same size whose every element says whose it is (the rank, the thread, the call). A call that ran
alone gives every element the sum of exactly one tensor per rank: this rank's own and one tensor
of the peer's. Calls that mixed (two threads' epochs or halves interleaved) leave some elements
with another sum, or this rank's part missing: before the communicator serialised its calls, 17
of 60 results on the shared-memory path were half-reduced, and the gloo path deadlocked until the
timeout.

Ranks serialise in the order each issues its calls (torch's rule, as with NCCL): which thread's
tensor meets which tensor of the peer is up to the threads' timing, so the test checks that each
result is whole, not which peer tensor it met; across a rank's results every peer tensor is met
exactly once.
"""

from __future__ import annotations

import pytest
from spawn import run_ranks

PATHS = {
    "gloo": {"transport": "gloo"},
    "shm": {"transport": "shm", "kernels": "torch"},
    "triton": {"transport": "shm", "kernels": "triton", "channels": 2},
}
ENV = {"triton": {"TRITON_INTERPRET": "1"}}
# Elements per tensor and calls per thread: smaller and fewer under the interpreter, where
# they still mixed before (12 of 16 results at 16 Ki elements, 8 calls a thread).
SIZES = {"gloo": (1 << 20, 30), "shm": (1 << 20, 30), "triton": (1 << 14, 8)}
THREADS = 2
# A tensor's code: rank r's tensors are r-th digits in base BASE, so a sum of one tensor per rank
# decodes into each rank's part (exact in fp32: codes stay below 2**24).
BASE = 1000


def _code(rank: int, thread: int, call: int) -> int:
    return (1 + thread * 100 + call) * BASE**rank


def _threads(
    rank: int, world_size: int, knobs: dict, numel: int, calls: int, asynchronous: bool
) -> list[tuple[int, int, list]]:
    import threading

    import torch

    import gpucomm

    gpucomm.init_process_group(timeout=60, **knobs)
    results: list[tuple[int, int, list]] = []
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS)

    def loop(thread: int) -> None:
        try:
            start.wait()
            for call in range(calls):
                t = torch.full((numel,), float(_code(rank, thread, call)))
                if asynchronous and thread == 1:  # the other thread's calls wait in call order
                    gpucomm.all_reduce(t, async_op=True).wait()
                else:
                    gpucomm.all_reduce(t)
                values = torch.unique(t).tolist()
                results.append((thread, call, values))
        except BaseException as exc:  # noqa: BLE001 - sent back to the test as it is
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    gpucomm.destroy_process_group()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("calls", ["blocking", "one_async"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_two_threads_calling_one_group_get_whole_reductions(path: str, calls: str) -> None:
    """Both threads blocking (the repeat fast path serves the later calls), or one of them
    asynchronous (the progress thread runs its calls on the shared-memory path)."""
    numel, calls_per_thread = SIZES[path]
    per_rank = run_ranks(
        _threads, 2, PATHS[path], numel, calls_per_thread, calls == "one_async", timeout=240, env=ENV.get(path)
    )
    calls = calls_per_thread
    for rank, results in enumerate(per_rank):
        assert len(results) == THREADS * calls
        peer = 1 - rank
        met = []
        mixed = []
        for thread, call, values in results:
            if len(values) != 1:
                mixed.append((thread, call, values[:4]))
                continue
            value = int(values[0])
            own = _code(rank, thread, call)
            rest = value - own
            whole = rest > 0 and rest % BASE**peer == 0 and rest // BASE**peer < BASE
            if not whole:
                mixed.append((thread, call, values))
            else:
                met.append(rest)
        assert not mixed, f"{path}, rank {rank}: {len(mixed)} of {len(results)} results mixed, e.g. {mixed[:3]}"
        peer_codes = sorted(_code(peer, t, c) for t in range(THREADS) for c in range(calls))
        assert sorted(met) == peer_codes, f"{path}, rank {rank}: the peer's tensors were not each met once"
