"""Epoch flags: signal (release store) and bounded wait (acquire loads), at system scope.

Flags are monotonic int64 counters that live in a rank's workspace and are written by peers.
Atomics with ``sem``/``scope`` do the handoff, and the signal's system-scope fence is
:mod:`fence`'s (inline PTX on a GPU, nothing under the interpreter), so the same kernels run
under the Triton interpreter on POSIX shared memory. Both kernels run as a single program: programs of one
launch never wait on each other.
"""

import torch
import triton
import triton.language as tl

from gpucomm._kernels.triton.fence import fence_sys

__all__ = ["signal_kernel", "wait_kernel", "signal", "wait"]


@triton.jit(do_not_specialize=["n_flags", "epoch"])
def signal_kernel(
    addr_ptr,  # int64[n_flags]: addresses of the int64 flags to set
    n_flags,  # number of flags
    epoch,  # value stored into every flag
    BLOCK: tl.constexpr,  # power of two >= n_flags
):
    offs = tl.arange(0, BLOCK)
    mask = offs < n_flags
    flags = tl.load(addr_ptr + offs, mask=mask, other=0).to(tl.pointer_type(tl.int64))
    value = tl.full((BLOCK,), 0, tl.int64) + epoch  # int64 whether epoch came as a value or a constant
    # The data was written by this rank's earlier kernels, not by this thread: a system-scope
    # fence first, as CUDA's gpucomm_signal has (__threadfence_system).
    fence_sys(offs)
    # Release at system scope: the data this rank wrote before is visible to any peer (another
    # GPU, or the host) that acquire-loads the new epoch.
    tl.atomic_xchg(flags, value, mask=mask, sem="release", scope="sys")


@triton.jit(do_not_specialize=["n_flags", "epoch", "max_spins"])
def wait_kernel(
    addr_ptr,  # int64[n_flags]: addresses of the int64 flags to wait on
    status_ptr,  # int64[n_flags]: out, the last value seen in every flag
    n_flags,  # number of flags
    epoch,  # the wait ends when every flag is >= epoch
    max_spins,  # ... or after this many polls; the host decides what to do next
    BLOCK: tl.constexpr,  # power of two >= n_flags
):
    offs = tl.arange(0, BLOCK)
    mask = offs < n_flags
    flags = tl.load(addr_ptr + offs, mask=mask, other=0).to(tl.pointer_type(tl.int64))
    zero = tl.full((BLOCK,), 0, tl.int64)
    target = zero + epoch  # int64 whether epoch came as a value or a specialised constant
    # An atomic add of 0 is an acquire load that the interpreter and every GPU support: reads
    # after it see the data the peer wrote before its release.
    seen = tl.atomic_add(flags, zero, mask=mask, sem="acquire", scope="sys")
    seen = tl.where(mask, seen, target)
    spins = 1
    while (tl.sum((seen < target).to(tl.int32), axis=0) > 0) & (spins < max_spins):
        seen = tl.atomic_add(flags, zero, mask=mask, sem="acquire", scope="sys")
        seen = tl.where(mask, seen, target)
        spins += 1
    tl.store(status_ptr + offs, seen, mask=mask)


def _block(n_flags: int) -> int:
    return max(triton.next_power_of_2(n_flags), 16)


def signal(addrs: torch.Tensor, epoch: int) -> None:
    """Store ``epoch`` into every flag whose address is in ``addrs`` (int64, on the device)."""
    if addrs.dtype != torch.int64 or addrs.dim() != 1:
        raise ValueError(f"signal: addrs must be a 1-D int64 tensor, got {addrs.dtype} of shape {tuple(addrs.shape)}")
    if addrs.numel():
        signal_kernel[(1,)](addrs, addrs.numel(), epoch, BLOCK=_block(addrs.numel()))


def wait(addrs: torch.Tensor, status: torch.Tensor, epoch: int, max_spins: int) -> None:
    """Poll the flags at ``addrs`` until all are ``>= epoch`` or ``max_spins`` polls; values into ``status``."""
    if addrs.dtype != torch.int64 or addrs.dim() != 1 or status.dtype != torch.int64 or status.shape != addrs.shape:
        raise ValueError(
            f"wait: addrs and status must be 1-D int64 tensors of the same shape, got {addrs.dtype} "
            f"{tuple(addrs.shape)} and {status.dtype} {tuple(status.shape)}"
        )
    if max_spins < 1:
        raise ValueError(f"wait: max_spins must be >= 1, got {max_spins}")
    if addrs.numel():
        wait_kernel[(1,)](addrs, status, addrs.numel(), epoch, max_spins, BLOCK=_block(addrs.numel()))
