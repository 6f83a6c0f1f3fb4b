"""Shared @triton.jit helpers: pointers from raw addresses, loads into the accumulation type,
the reduction operators, stores with one rounding.

bf16 is handled as raw 16-bit patterns with integer arithmetic. The Triton interpreter converts
fp32 to bf16 by truncation while torch and the GPU round to nearest even, so converting with
explicit bit operations is the only way to get the same bits on every backend.
"""

import triton
import triton.language as tl

from gpucomm.ops import instruction_set as isa

# The reduce ops as constexprs (Triton reads only constexpr globals): gpucomm.ReduceOp's values,
# from the instruction set.
OP_SUM = tl.constexpr(isa.OP_SUM)
OP_PRODUCT = tl.constexpr(isa.OP_PRODUCT)
OP_MIN = tl.constexpr(isa.OP_MIN)
OP_MAX = tl.constexpr(isa.OP_MAX)
OP_AVG = tl.constexpr(isa.OP_AVG)


@triton.jit
def as_pointer(addr, T: tl.constexpr, ALIGNED: tl.constexpr):
    """A pointer to ``T`` at the integer address ``addr``.

    An address read from a table carries no alignment information, so the compiler would emit
    scalar loads; ALIGNED (every address of the launch is a multiple of 16 bytes, checked by the
    launcher) lets it use 16-byte vector loads and stores.
    """
    ptr = addr.to(tl.pointer_type(T))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def bf16_bits_to_f32(bits):
    """Widen bf16 bit patterns (uint16) to fp32 exactly: bf16 is the top half of an fp32."""
    return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_bf16_bits(x):
    """Round fp32 to bf16 (nearest, ties to even) and return the uint16 bit patterns."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    # The carry of the rounding could turn a NaN payload into an infinity; keep NaN a quiet NaN.
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return tl.where(is_nan, (bits >> 16) | 0x0040, rounded).to(tl.uint16)


@triton.jit
def load_acc(addr, offs, mask, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """Load ``DTYPE`` elements ``offs`` of the region at integer ``addr`` in the accumulation type.

    16-bit floats widen to fp32 (exact); every other type accumulates in itself. The region may be
    a peer's: loads are ``.cg`` (L2, not L1, which peers' writes do not keep coherent), as the CUDA
    kernels' ``__ldcg`` (docs/kernel-contract.md, "One memory contract").
    """
    if DTYPE == tl.bfloat16:
        ptr = as_pointer(addr, tl.uint16, ALIGNED)
        return bf16_bits_to_f32(tl.load(ptr + offs, mask=mask, cache_modifier=".cg"))
    elif DTYPE == tl.float16:
        ptr = as_pointer(addr, tl.float16, ALIGNED)
        return tl.load(ptr + offs, mask=mask, cache_modifier=".cg").to(tl.float32)
    else:
        ptr = as_pointer(addr, DTYPE, ALIGNED)
        return tl.load(ptr + offs, mask=mask, cache_modifier=".cg")


@triton.jit
def store_rounded(addr, offs, acc, mask, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """Store accumulation-type values as ``DTYPE``, rounding once to nearest even."""
    if DTYPE == tl.bfloat16:
        ptr = as_pointer(addr, tl.uint16, ALIGNED)
        tl.store(ptr + offs, f32_to_bf16_bits(acc), mask=mask)
    elif DTYPE == tl.float16:
        ptr = as_pointer(addr, tl.float16, ALIGNED)
        tl.store(ptr + offs, acc.to(tl.float16, fp_downcast_rounding="rtne"), mask=mask)
    else:
        ptr = as_pointer(addr, DTYPE, ALIGNED)
        tl.store(ptr + offs, acc, mask=mask)


@triton.jit
def combine(acc, x, OP: tl.constexpr):
    """``acc OP x`` in the accumulation type; OP is a gpucomm.ReduceOp value (AVG sums)."""
    if OP == OP_PRODUCT:
        return acc * x
    elif OP == OP_MIN:
        # NaN wins, like torch.minimum.
        return tl.minimum(acc, x, propagate_nan=tl.PropagateNan.ALL)
    elif OP == OP_MAX:
        return tl.maximum(acc, x, propagate_nan=tl.PropagateNan.ALL)
    else:
        return acc + x  # SUM and AVG


@triton.jit
def divide(acc, divisor):
    """AVG's one division: IEEE for floats, truncating for integers."""
    # Broadcasting the divisor into acc's type works whether the launcher passed it as a value
    # or Triton specialised it into a constant.
    d = tl.zeros_like(acc) + divisor
    if acc.dtype == tl.float32:
        # Plain `/` on fp32 compiles to an approximate division on NVIDIA GPUs; div_rn is the
        # IEEE-correct one that torch (and the interpreter's numpy) compute.
        return tl.math.div_rn(acc, d)
    elif acc.dtype == tl.float64:
        return acc / d
    else:
        # Integer `//` in Triton truncates towards zero (C semantics), as AVG promises.
        return acc // d
