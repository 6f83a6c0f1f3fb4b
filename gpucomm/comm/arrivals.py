"""The arrival of an init's ranks in the store: each init's fresh key prefix, and waits that name
who is missing.

**Generations.** Every init of ``P`` ranks on a store (and every subgroup's, in its own prefixed
store) is a *generation* ``g`` under ``gpucomm/w<P>/gen<g>/``. A rank writes only keys of its own
(``rank<r>``: a random nonce of this attempt), never a shared counter, and a generation is
*closed* by one record, written with ``compare_set`` (first writer wins):

- rank 0, once every rank's arrival is there, writes the token record
  ``<token> <nonce of rank 0> ... <nonce of rank P-1>``: every rank whose nonce it holds takes
  the prefix ``gpucomm/<token>/``;
- a rank whose deadline passes writes an abort record, and raises :class:`NeverJoinedError`
  naming the ranks that never arrived ("rank 2 never joined (2 of 3 arrived after 300 s)"), or
  :class:`CommTimeoutError` where every rank arrived but rank 0 wrote no record. The abort
  names the ranks that never joined, so that the ranks waiting in the same generation raise the
  same error at once instead of moving on (rank 0, which serves the store outside torchrun,
  waits up to 2 s for them to have read it before it raises).

A rank joins the first generation without a record, and moves on to the next one whenever the
one it waits in is closed without it (another rank gave up without naming ranks that never
joined, or the record is not gpucomm's). So a
rank that retries after its own timeout meets the others in the next generation, however many
times each has tried, and two inits never share a prefix. The ranks of one init agree on ``P``;
inits of different sizes on one store count apart.

**A store others can write** (docs/reliability.md, ## Threats). Nothing here counts on a value
being what it was: no key is incremented, a value that is not in gpucomm's form is taken for
absent, a rank puts back its own arrival when it finds it changed or gone, and a record that is
not gpucomm's closes its generation (the ranks move on together). Where such writes were seen and
the deadline passes, every rank raises :class:`StoreInconsistentError` saying what it found,
never a timeout naming a rank.
"""

from __future__ import annotations

import datetime
import re
import secrets
import time
from collections.abc import Sequence

import torch.distributed as dist

from gpucomm.errors import CommTimeoutError, NeverJoinedError, StoreInconsistentError

__all__ = ["draw_prefix", "store_wait"]

# How often a waiting rank looks at the store: from 1 ms, doubling to this (an init seldom waits
# more than one poll for its last rank; 20 ms keeps a 8-rank init's polls under 1k RPC/s).
_POLL_MAX_S = 0.02
# How long rank 0 waits, before it raises NeverJoinedError, for the ranks beside it to read the
# abort record (they poll every _POLL_MAX_S: 20 ms; 2 s leaves room on a loaded 2-core host).
_TELL_S = 2.0
_NONCE = re.compile(r"n[0-9a-f]{16}")  # "n" first: TCPStore.add on it fails on the server
_TOKEN = re.compile(r"[0-9a-f]{16}")
_STORE_ERRORS = (RuntimeError, dist.DistError)


def draw_prefix(
    store: dist.Store,
    rank: int,
    world_size: int,
    timeout: float,
    fn: str = "init_process_group",
    global_ranks: Sequence[int] | None = None,
) -> str:
    """A fresh key prefix ``gpucomm/<token>/`` of this init (collective over the ``world_size``
    ranks on ``store``: it returns once all have arrived); ``fn`` names the call, and
    ``global_ranks`` the global rank of each group rank (None: the group is the world), in a
    timeout's error."""
    return _Arrival(store, rank, world_size, timeout, fn, global_ranks).meet()


class _Arrival:
    """One rank's attempt to meet the others (module docstring)."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        timeout: float,
        fn: str,
        global_ranks: Sequence[int] | None,
    ) -> None:
        self.store = store
        self.rank = rank
        self.size = world_size
        self.timeout = timeout
        self.fn = fn
        self.world = global_ranks is None
        self.global_ranks = list(global_ranks) if global_ranks is not None else list(range(world_size))
        self.root = f"gpucomm/w{world_size}/"
        self.nonce = "n" + secrets.token_hex(8)
        self.absent = "\x00absent " + secrets.token_hex(8)  # a value never written (_get)
        self.foreign: list[str] = []  # what was found that no gpucomm rank writes
        self.record: str | None = None  # the record of the generation last looked at

    def meet(self) -> str:
        deadline = time.monotonic() + self.timeout
        gen = self.first = self._join(self._first_open(0))
        pause = 0.001
        while True:
            taken = self._closed(gen)
            if taken is None and self.rank == 0:
                taken = self._close_if_all_arrived(gen)
            if taken is not None:
                if taken:
                    return taken
                self._told_never_joined(gen)  # raises where a peer gave up on a rank that never came
                gen = self._join(self._first_open(gen + 1, read=True))
                continue
            self._keep_own(gen)
            if time.monotonic() >= deadline:
                taken = self._give_up(gen)
                if taken:
                    return taken
            time.sleep(pause)
            pause = min(2 * pause, _POLL_MAX_S)

    # -- keys ---------------------------------------------------------------------------------
    def _key(self, gen: int, name: str) -> str:
        return f"{self.root}gen{gen}/{name}"

    def _get(self, key: str) -> str | None:
        """``key``'s value, None where it is absent, without waiting: ``get`` would wait for a
        key deleted since a ``check``. compare_set with a value never written returns the
        value there, or the expected one where there is none, and changes nothing."""
        found = self.store.compare_set(key, self.absent, self.absent).decode(errors="replace")
        return None if found == self.absent else found

    def _first_open(self, gen: int, read: bool = False) -> int:
        """The first generation from ``gen`` without a record; ``read``: note the records passed
        that are not gpucomm's (while this rank waits, they were written since it arrived)."""
        while self.store.check([self._key(gen, "record")]):
            if read:
                self._closed(gen)
            gen += 1
        return gen

    def _join(self, gen: int) -> int:
        self.store.set(self._key(gen, f"rank{self.rank}"), self.nonce)
        return gen

    def _keep_own(self, gen: int) -> None:
        """Put this rank's arrival back where it was changed or deleted."""
        key = self._key(gen, f"rank{self.rank}")
        found = self._get(key)
        if found != self.nonce:
            self._note(key, found)
            self.store.set(key, self.nonce)

    def _note(self, key: str, found: str | None) -> None:
        said = "deleted" if found is None else f"= {found[:40]!r}"
        if len(self.foreign) < 4:
            self.foreign.append(f"{key} {said}")

    # -- records ------------------------------------------------------------------------------
    def _closed(self, gen: int) -> str | None:
        """None while ``gen`` is open; the prefix where its record takes this rank, else ""."""
        key = self._key(gen, "record")
        self.record = record = self._get(key)
        return None if record is None else self._read(key, record)

    def _read(self, key: str, record: str) -> str:
        """The prefix a record gives this rank; "" where it leaves this rank out (an abort, a
        record of other nonces, or not gpucomm's)."""
        words = record.split()
        if words[:1] == ["abort"]:
            return ""
        if len(words) == self.size + 1 and _TOKEN.fullmatch(words[0]) and all(_NONCE.fullmatch(w) for w in words[1:]):
            return f"gpucomm/{words[0]}/" if words[1 + self.rank] == self.nonce else ""
        self._note(key, record)
        return ""

    def _close_if_all_arrived(self, gen: int) -> str | None:
        """Rank 0: write the token record once every rank's arrival is there and in gpucomm's
        form; None while some are not."""
        keys = [self._key(gen, f"rank{r}") for r in range(self.size)]
        if not self.store.check(keys):
            return None
        nonces = [self._get(key) for key in keys]
        odd = [(k, v) for k, v in zip(keys, nonces) if v is None or not _NONCE.fullmatch(v)]
        if odd or nonces[0] != self.nonce:
            for key, value in odd:
                self._note(key, value)
            return None  # a changed value counts as absent; its rank (or _keep_own) puts it back
        return self._settle(gen, " ".join([secrets.token_hex(8), *nonces]))  # type: ignore[list-item]

    def _arrived(self, gen: int, rank: int) -> bool:
        found = self._get(self._key(gen, f"rank{rank}"))
        return found is not None and _NONCE.fullmatch(found) is not None

    def _settle(self, gen: int, mine: str) -> str:
        key = self._key(gen, "record")
        record = self.store.compare_set(key, "", mine).decode(errors="replace")
        return self._read(key, record)

    def _give_up(self, gen: int) -> str:
        """The deadline passed: close ``gen`` with an abort record and raise, unless its
        record took this rank in just before (then its prefix)."""
        arrived = [self._get(self._key(gen, f"rank{r}")) for r in range(self.size)]
        missing = [r for r, v in enumerate(arrived) if v is None or not _NONCE.fullmatch(v)]
        # Never joined: absent from every generation this rank waited in (a peer that gave up
        # first closed an earlier one with its abort, and this rank moved on without it).
        never = [r for r in missing if not any(self._arrived(g, r) for g in range(self.first, gen))]
        # The abort names them, so that the ranks waiting beside this one raise the same error
        # now, while the store (served by rank 0 outside torchrun) is still there.
        told = f" never={','.join(map(str, never))} after={self.timeout:g}" if never and not self.foreign else ""
        taken = self._settle(gen, f"abort {self.rank} {self.nonce}{told}")
        if taken:
            return taken
        if self.foreign:
            absent = f"; the arrivals of rank(s) {missing} were not there at the end" if missing else ""
            raise StoreInconsistentError(
                f"gpucomm.{self.fn}: the rendezvous store holds values that no gpucomm rank wrote "
                f"({'; '.join(self.foreign)}): another process writes to this store, so this init could not "
                f"complete within {self.timeout:g} s{absent}. Give the job a store no one else reaches "
                "(docs/reliability.md, ## Threats)"
            )
        if never:
            self._never_joined(gen, never, self.timeout)
        # Every rank there, but no record: rank 0 writes it, and it is rank 0 that this rank waits for.
        raise CommTimeoutError(
            self.fn,
            None,
            self.rank,
            missing or [0],
            self.timeout,
            detail="the rendezvous in the store did not complete",
            global_ranks=self.global_ranks,
            world=self.world,
        )

    def _told_never_joined(self, gen: int) -> None:
        """``gen`` was closed by a peer's abort naming ranks that never joined, while this rank
        waited in it: raise the same :class:`NeverJoinedError` (a rank the abort names came
        after the peer looked, and moves on to the next generation instead)."""
        words = (self.record or "").split()
        if words[:1] != ["abort"] or len(words) != 5 or not words[3].startswith("never="):
            return
        never = [int(r) for r in words[3].removeprefix("never=").split(",") if r.isdigit()]
        after = words[4].removeprefix("after=")
        if never and self.rank not in never and after.replace(".", "", 1).isdigit():
            self._never_joined(gen, never, float(after))

    def _never_joined(self, gen: int, never: list[int], after: float) -> None:
        """Raise :class:`NeverJoinedError`; rank 0 first waits (briefly) for the others of
        ``gen`` to have read the abort: its exit may take the store they read with it."""
        self.store.set(self._key(gen, f"told{self.rank}"), "1")
        if self.rank == 0:
            keys = [self._key(gen, f"told{r}") for r in range(1, self.size) if r not in never and self._arrived(gen, r)]
            end = time.monotonic() + _TELL_S
            while keys and not self.store.check(keys) and time.monotonic() < end:
                time.sleep(_POLL_MAX_S)
        raise NeverJoinedError(
            self.fn, self.rank, never, self.size, after, global_ranks=self.global_ranks, world=self.world
        )


def store_wait(
    store: dist.Store,
    keys: list[str],
    timeout: float,
    *,
    op: str,
    rank: int,
    waited_ranks: list[int],
    epoch: int | None = None,
    global_ranks: Sequence[int] | None = None,
    world: bool = False,
) -> None:
    """``store.wait`` with a deadline that ends in :class:`CommTimeoutError` naming the absent ranks.

    ``waited_ranks[i]`` is the rank expected to write ``keys[i]``; ``global_ranks`` (optional)
    the global rank of each rank of the group, for the message (``world``: the group is the
    world). Keys that all arrived by the time the deadline's error is read count as arrived.
    """
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except _STORE_ERRORS as err:
        missing = [r for r, k in zip(waited_ranks, keys) if not store.check([k])]
        if missing:
            raise CommTimeoutError(op, epoch, rank, missing, timeout, global_ranks=global_ranks, world=world) from err
