"""Kernels that test gpucomm.language's device functions one by one (imported inside the ranks:
triton must be imported after TRITON_INTERPRET is set)."""

import triton
import triton.language as tl

import gpucomm.language as gl

# A user slot (after the channels): the ring below signals on it.
RING_SLOT = tl.constexpr(40)


@triton.jit
def ring_put(ctx, x_ptr, inbox_ptr, out_ptr, n, value, BLOCK: tl.constexpr, LANES: tl.constexpr):
    """Store this rank's x into the next rank's inbox (a symmetric tensor), signal ``value`` to
    it, wait for the previous rank's ``value``, copy the inbox to out."""
    me = gl.rank(ctx)
    P = gl.world(ctx)
    nxt = (me + 1) % P
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    gl.store(inbox_ptr + offs, tl.load(x_ptr + offs, mask=mask), nxt, ctx, mask=mask)
    gl.signal(ctx, RING_SLOT, nxt, value)
    ok = gl.wait(ctx, RING_SLOT, (me + P - 1) % P, value, LANES)
    if ok:
        tl.store(out_ptr + offs, tl.load(inbox_ptr + offs, mask=mask), mask=mask)


@triton.jit
def translate_addresses(ctx, x_ptr, out_ptr, P: tl.constexpr):
    """out[p] = the address of x in rank p's copy, as translate gives it."""
    for p in tl.static_range(P):
        tl.store(out_ptr + p, gl.translate(x_ptr, p, ctx).to(tl.int64))
