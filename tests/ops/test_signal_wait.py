"""signal / wait between two processes over shared memory, for torch and Triton (interpreter) kernels.

The shared memory is a file in pytest's tmp_path mapped by every rank with
``torch.from_file(..., shared=True)`` (a MAP_SHARED mapping), independent of gpucomm's transports.
Layout, in int64 words: FLAGS flag words, then DATA_WORDS words of data.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from spawn import run_ranks

from gpucomm.ops import Region, get_kernels

FLAGS = 4
DATA_WORDS = 4099
ROUNDS = 8
LONG_WAIT_S = 60.0  # for a peer that is merely slow to start (spawned ranks import torch)
SHORT_DEADLINE_S = 0.5
IMPL_ENV = {"torch": {}, "triton": {"TRITON_INTERPRET": "1"}}


def _map(path: str) -> tuple[torch.Tensor, list[Region], Region]:
    words = torch.from_file(path, shared=True, size=FLAGS + DATA_WORDS, dtype=torch.int64)
    whole = Region.of(words)
    flags = [whole.sub(8 * i, 8) for i in range(FLAGS)]
    return words, flags, whole.sub(8 * FLAGS, 8 * DATA_WORDS)


def _deadline(seconds: float) -> float:
    return time.monotonic() + seconds


def _payload(seed: int, epoch: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + epoch)
    return torch.randint(-(2**62), 2**62, (DATA_WORDS,), generator=gen, dtype=torch.int64)


def _handoff_rank(rank: int, world_size: int, impl: str, path: str, seed: int) -> int:
    """Rank 0 copies a fresh payload into the shared data and signals flag 0; rank 1 waits on
    flag 0, checks every word, then acknowledges on flag 1 so that rank 0 may overwrite."""
    kernels = get_kernels(impl, torch.device("cpu"))
    _, flags, data = _map(path)
    checked = 0
    for epoch in range(1, ROUNDS + 1):
        payload = _payload(seed, epoch)  # fresh each epoch; both ranks know it
        if rank == 0:
            kernels.copy(data, Region.of(payload))
            kernels.signal([flags[0]], epoch)
            missing = kernels.wait([flags[1]], epoch, _deadline(LONG_WAIT_S))
        else:
            missing = kernels.wait([flags[0]], epoch, _deadline(LONG_WAIT_S))
            if not missing:
                got = data.view(torch.int64)
                if not torch.equal(got, payload):
                    bad = int((got != payload).nonzero()[0])
                    raise AssertionError(f"epoch {epoch}: word {bad} is {int(got[bad])}, expected {int(payload[bad])}")
                checked += 1
                kernels.signal([flags[1]], epoch)
        if missing:
            raise AssertionError(f"rank {rank}, epoch {epoch}: flags {missing} never arrived")
    return checked


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_data_written_before_signal_is_seen_after_wait(impl: str, tmp_path) -> None:
    path = str(tmp_path / "shared.bin")
    with open(path, "wb") as f:
        f.write(bytes(8 * (FLAGS + DATA_WORDS)))
    seed = int.from_bytes(os.urandom(4), "little")
    results = run_ranks(_handoff_rank, 2, impl, path, seed, env=IMPL_ENV[impl], timeout=300.0)
    assert results == [0, ROUNDS]


def _deadline_rank(rank: int, world_size: int, impl: str, path: str) -> tuple[list[int], float, list[int]]:
    """Rank 0 sets flag 0 past the epoch and flag 2 below it; rank 1 waits on flags 0..2."""
    kernels = get_kernels(impl, torch.device("cpu"))
    _, flags, _ = _map(path)
    epoch = 3
    if rank == 0:
        kernels.signal([flags[0]], epoch + 2)  # flags are counters: a later epoch satisfies an earlier one
        kernels.signal([flags[2]], epoch - 1)
        return [], 0.0, []
    # Wait for rank 0 to have signalled at all (it may still be importing torch).
    first = kernels.wait([flags[2]], epoch - 1, _deadline(LONG_WAIT_S))
    start = time.monotonic()
    missing = kernels.wait(flags[:3], epoch, start + SHORT_DEADLINE_S)
    elapsed = time.monotonic() - start
    past = kernels.wait(flags[:3], epoch, time.monotonic() - 1.0)  # deadline already gone
    return first, elapsed, missing + [-1] + past


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_wait_returns_the_missing_flags_at_the_deadline(impl: str, tmp_path) -> None:
    path = str(tmp_path / "shared.bin")
    with open(path, "wb") as f:
        f.write(bytes(8 * (FLAGS + DATA_WORDS)))
    _, (first, elapsed, missing) = run_ranks(_deadline_rank, 2, impl, path, env=IMPL_ENV[impl], timeout=300.0)
    assert first == []
    assert missing == [1, 2, -1, 1, 2]
    assert SHORT_DEADLINE_S <= elapsed <= SHORT_DEADLINE_S + 1.0
