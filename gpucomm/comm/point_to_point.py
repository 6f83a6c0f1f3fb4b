"""Point-to-point calls of a communicator: send, recv and their asynchronous forms.

A send is matched by the ``recv`` with the same tag on its destination; neither is numbered
among the collectives nor checked against the other ranks' calls.
"""

from __future__ import annotations

import torch

from gpucomm.comm import dtypes
from gpucomm.comm.call import Call, sent_as
from gpucomm.comm.lazy_views import resolving
from gpucomm.comm.route import Router
from gpucomm.comm.validation import check_rank, check_tensor
from gpucomm.work import Work

__all__ = ["PointToPoint"]


class PointToPoint(Router):
    """send/recv of :class:`gpucomm.comm.communicator.Communicator` (its base)."""

    world_size: int
    device: torch.device | None

    @resolving
    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Send ``tensor`` to ``dst``; matched by a ``recv`` with the same tag on ``dst``."""
        self._p2p("send", tensor, dst, tag).wait()

    @resolving
    def recv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> int:
        """Receive into ``tensor`` from ``src`` (any rank if None); returns the sender's rank."""
        work = self._p2p("recv", tensor, src, tag)
        work.wait()
        return work.source if work.source is not None else src  # type: ignore[return-value]

    @resolving
    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        """Start sending ``tensor`` to ``dst`` and return at once; ``wait()`` on the Work completes it."""
        return self._p2p("isend", tensor, dst, tag)

    @resolving
    def irecv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> Work:
        """Post a receive into ``tensor`` and return at once; after ``wait()``, ``source`` names the sender."""
        return self._p2p("irecv", tensor, src, tag)

    def _p2p(self, fn: str, tensor: torch.Tensor, peer: int | None, tag: int) -> Work:
        sending = fn.endswith("send")
        self._check_p2p(fn, tensor, peer, "dst" if sending else "src", tag)
        wire = dtypes.as_bytes(tensor)
        extra = sent_as(tensor, wire)
        if sending:
            return self._route(
                Call(
                    fn,
                    wire,
                    lambda path: path.send(wire, peer, tag),
                    async_op=True,
                    outputs=[tensor],
                    fields={"peer": peer, "tag": tag, **extra},
                )
            )  # type: ignore[return-value]
        return self._route(
            Call(
                fn,
                wire,
                lambda path: path.recv(wire, peer, tag),
                async_op=True,
                outputs=[tensor],
                fields={"peer": peer, "tag": tag, **extra},
            )
        )  # type: ignore[return-value]

    def _check_p2p(self, fn: str, tensor: torch.Tensor, peer: int | None, name: str, tag: int) -> None:
        self._check_usable(fn)
        check_tensor(tensor, fn, device=self.device)
        if peer is not None or name == "dst":
            check_rank(peer, self.world_size, fn, name)
            if peer == self.rank:
                raise ValueError(f"gpucomm.{fn}: {name} must be another rank, got this rank's own {peer}")
        if isinstance(tag, bool) or not isinstance(tag, int) or tag < 0:
            raise ValueError(f"gpucomm.{fn}: tag must be a non-negative int, got {tag!r}")
