"""Rendezvous on an unlucky or unfriendly store: a retry after a timeout meets the others, and
another user's writes make an init succeed or fail as an inconsistent store, never blaming a rank."""

from __future__ import annotations

import datetime
import threading
import time

import torch.distributed as dist
from spawn import run_ranks

from gpucomm.comm.arrivals import draw_prefix
from gpucomm.errors import StoreInconsistentError


def _store(rank: int) -> dist.TCPStore:
    """The job's store, served by rank 0 on MASTER_PORT (every process of the run is a client)."""
    import os

    return dist.TCPStore(
        "127.0.0.1",
        int(os.environ["MASTER_PORT"]),
        1,
        rank == 0,
        timeout=datetime.timedelta(seconds=30),
        wait_for_workers=False,
    )


def _init_and_sum(store: dist.TCPStore, rank: int, timeout: float) -> float:
    import torch

    import gpucomm

    gpucomm.init_process_group(backend="gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    try:
        t = torch.full((4,), float(rank + 1))
        gpucomm.all_reduce(t)
        return t[0].item()
    finally:
        gpucomm.destroy_process_group()


def _retry_after_timeout(rank: int, world_size: int) -> str:
    import gpucomm

    store = _store(rank)
    if rank == 0:
        store.wait(["test/first_try_failed"])  # arrive only once rank 1's first try has timed out
        return f"sum {_init_and_sum(store, 0, 10)}"
    try:
        gpucomm.init_process_group(backend="gloo", store=store, rank=1, world_size=2, timeout=1)
    except gpucomm.CommTimeoutError as err:
        first = str(err)
    else:
        return "the first try did not time out"
    store.set("test/first_try_failed", "1")
    return f"sum {_init_and_sum(store, 1, 10)} after: {first}"


def test_a_rank_that_retries_after_its_timeout_meets_the_others() -> None:
    """Rank 1 gives up waiting for rank 0 (1 s), then tries again while rank 0 arrives: both
    meet. Before, each try counted one more arrival in the store: the retry and rank 0 landed in
    two generations, and both timed out although both were there."""
    results = run_ranks(_retry_after_timeout, 2, timeout=90)
    assert results[0] == "sum 3.0", results
    assert results[1].startswith("sum 3.0 after: "), results
    assert "rank 0 never joined (1 of 2 arrived after 1 s)" in results[1], results


def _intruded(rank: int, world_size: int) -> str:
    """Ranks 0 and 1 init a 2-rank job; process 2 is another user of the store who writes first."""
    store = _store(rank)
    if rank == 2:
        store.add("gpucomm/arrivals", 1)  # the counter gpucomm kept: every later init was one off
        store.add("gpucomm/w2/gen0/record", 1)  # a record that is not gpucomm's
        store.set("gpucomm/w2/gen1/rank1", "1")  # an arrival in rank 1's name, not in gpucomm's form
        store.set("test/intruded", "1")
        return "intruded"
    store.wait(["test/intruded"])
    try:
        return f"sum {_init_and_sum(store, rank, 6)}"
    except StoreInconsistentError as err:
        return f"inconsistent: {err}"
    except Exception as err:  # noqa: BLE001 - anything else fails the test with its message
        return f"{type(err).__name__}: {err}"


def test_another_users_writes_make_init_succeed_or_fail_as_an_inconsistent_store() -> None:
    """The add to ``gpucomm/arrivals`` of the report, and writes to the keys gpucomm uses now.
    Before, rank 1 was told that rank 0, alive and waiting, was missing (a CommTimeoutError)."""
    results = run_ranks(_intruded, 3, timeout=90)
    for rank in (0, 1):
        assert results[rank] == "sum 3.0" or results[rank].startswith("inconsistent: "), results


def _threads(server: dist.TCPStore, ranks: list[int], timeout: float, intrude) -> dict[int, object]:
    """``draw_prefix`` of a 2-rank job by ``ranks`` (threads, each its own client of ``server``,
    rank 1 0.2 s after rank 0) beside ``intrude(store, done)``: each rank's prefix or error."""

    def client() -> dist.TCPStore:
        return dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=datetime.timedelta(seconds=30))

    done = threading.Event()
    outcome: dict[int, object] = {}

    def rank(r: int) -> None:
        time.sleep(0.2 * r)
        try:
            outcome[r] = draw_prefix(client(), r, 2, timeout)
        except Exception as err:  # noqa: BLE001 - kept for the assertion
            outcome[r] = err

    intruder = threading.Thread(target=intrude, args=(client(), done))
    threads = [threading.Thread(target=rank, args=(r,)) for r in ranks]
    intruder.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    done.set()
    intruder.join(30)
    return outcome


def _tcp_server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)


def test_an_intruder_closing_the_generations_never_makes_a_rank_blame_the_other() -> None:
    """Another user who closes each generation the ranks wait in with a record of its own: the
    ranks move on together, and either meet or, at their deadline, each raises
    StoreInconsistentError saying what it found; never a CommTimeoutError naming the other."""

    def intrude(store: dist.TCPStore, done: threading.Event) -> None:
        gen = 0
        while not done.is_set():
            key = f"gpucomm/w2/gen{gen}/"
            if store.check([key + "record"]):
                gen += 1
            elif store.check([key + "rank0"]) or store.check([key + "rank1"]):
                store.compare_set(key + "record", "", "not gpucomm's")
            time.sleep(0.0005)

    start = time.monotonic()
    outcome = _threads(_tcp_server(), [0, 1], 1.5, intrude)
    assert time.monotonic() - start < 10
    if all(isinstance(v, str) for v in outcome.values()):
        assert outcome[0] == outcome[1], outcome  # met in a generation the intruder was too slow for
        return
    for err in outcome.values():
        assert isinstance(err, StoreInconsistentError), outcome
        assert isinstance(err, dist.DistStoreError)  # torch's type of a store's failure, as well
        assert "init_process_group: the rendezvous store holds values that no gpucomm rank wrote" in str(err)
        assert "not gpucomm's" in str(err), err


def test_a_waiting_ranks_arrival_changed_by_another_user_ends_as_an_inconsistent_store() -> None:
    """Rank 0 waits for rank 1, which never comes, while another user deletes rank 0's arrival
    and writes one in rank 1's name: rank 0 puts its own back, takes the other for absent, and
    at its deadline says the store is inconsistent (before: a raw wait on a counter's generation)."""

    def intrude(store: dist.TCPStore, done: threading.Event) -> None:
        store.wait(["gpucomm/w2/gen0/rank0"])
        store.delete_key("gpucomm/w2/gen0/rank0")
        store.set("gpucomm/w2/gen0/rank1", "n-not-a-nonce")

    start = time.monotonic()
    outcome = _threads(_tcp_server(), [0], 1.0, intrude)
    assert time.monotonic() - start < 10
    err = outcome[0]
    assert isinstance(err, StoreInconsistentError), outcome
    assert "gpucomm/w2/gen0/rank0 deleted" in str(err), err
    assert "gpucomm/w2/gen0/rank1 = 'n-not-a-nonce'" in str(err), err
    assert "the arrivals of rank(s) [1] were not there at the end" in str(err), err
