"""
One-shot all_reduce with gpucomm.language
==========================================

A whole all_reduce, written as one Triton kernel: every rank sums every rank's tensor, reading
the peers' copies straight from their memory. It shows the device API's core:

- symmetric tensors (``comm.empty``): every rank has one at the same offset, so a pointer into
  this rank's tensor names any peer's copy (``gl.translate(ptr, peer, ctx)``);
- ``gl.barrier``: every rank meets there, with release/acquire at system scope and gpucomm's
  deadline (a rank that never comes raises ``CommTimeoutError`` on the host, naming it);
- epochs kept on the device (``gl.epoch`` / ``gl.store_epoch``): nothing to reset between calls.

Run it on CPU, every rank a process, the kernel under Triton's interpreter::

    TRITON_INTERPRET=1 GPUCOMM_TRANSPORT=shm torchrun --nproc-per-node 2 docs/tutorials/one_shot_all_reduce.py

and on a GPU (several ranks may share one)::

    torchrun --nproc-per-node 2 docs/tutorials/one_shot_all_reduce.py

docs/language.md walks through it line by line.
"""

import torch
import triton
import triton.language as tl

import gpucomm
import gpucomm.language as gl


@triton.jit
def one_shot_all_reduce(
    ctx,  # the communicator's device context (comm.device_context().table)
    x_ptr,  # this rank's copy of a symmetric tensor
    out_ptr,  # the sum of every rank's x (an ordinary tensor)
    n,  # elements
    BLOCK: tl.constexpr,  # elements per step
    LANES: tl.constexpr,  # threads of the block (32 * num_warps): a barrier's lanes are threads
):
    e = gl.epoch(ctx, 0)  # channel 0's epoch, where the last launch left it
    e, ok = gl.barrier(ctx, 0, e, LANES)  # every rank has written its x
    if ok:
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            acc = tl.load(gl.translate(x_ptr, 0, ctx) + offs, mask=mask)  # rank 0's x ...
            for peer in range(1, gl.world(ctx)):  # ... then the others', in rank order
                acc += tl.load(gl.translate(x_ptr, peer, ctx) + offs, mask=mask)
            tl.store(out_ptr + offs, acc, mask=mask)
    e, ok = gl.barrier(ctx, 0, e, LANES)  # every rank is done reading this rank's x
    gl.store_epoch(ctx, e)  # the next launch starts from here


def all_reduce(x: torch.Tensor, out: torch.Tensor, comm: gpucomm.Communicator) -> None:
    """``out`` = the sum over ranks of the symmetric tensor ``x`` (every rank calls it)."""
    ctx = comm.device_context(x.device)
    launch = lambda: one_shot_all_reduce[(1,)](ctx.table, x, out, x.numel(), BLOCK=512, LANES=128, num_warps=4)  # noqa: E731
    ctx.launch("one_shot_all_reduce", launch)  # checks for a timeout once it has run


if __name__ == "__main__":
    gpucomm.init_process_group()  # torchrun's environment (env://)
    comm = gpucomm.get_default_communicator()
    rank, world = comm.rank, comm.world_size
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    x = comm.empty(4099, dtype=torch.float32, device=device)  # symmetric: the same offset on every rank
    out = torch.empty_like(x)
    for step in range(3):
        x.copy_(torch.arange(4099, dtype=torch.float32, device=device) * (rank + 1) + step)
        all_reduce(x, out, comm)
        expected = torch.arange(4099, dtype=torch.float32, device=device) * (world * (world + 1) // 2) + step * world
        torch.testing.assert_close(out, expected)
    print(f"rank {rank}: one-shot all_reduce of {world} ranks on {device}: correct")
    gpucomm.destroy_process_group()
