"""A call's fingerprint and identity words, which every rank compares at every SYNC.

gpucomm.ops.program's docstring ("Identity") says how the kernels use them; this module only
computes them from the call's description.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Sequence

import torch

from gpucomm.ops.instruction_set import FP_BITS

__all__ = ["fingerprint", "identity"]


def fingerprint(name: str, fields: Sequence[object], root: int | None) -> int:
    """The FP_BITS-bit fingerprint every flag of a call carries (collective, dtype, count, op,
    algorithm, root): ranks that disagree on any of them see each other's and raise."""
    text = "|".join(str(f) for f in (name, *fields, root))
    return zlib.crc32(text.encode()) & ((1 << FP_BITS) - 1)


# The dtypes a call's exact identity word names, by code (their place here, plus one; 0: no
# dtype, 127: one this list lacks). Names, not objects: a torch without one still numbers the rest.
_DTYPE_NAMES = (
    "float32", "float16", "bfloat16", "float64", "int32", "int64", "uint8", "int8", "int16",
    "uint16", "uint32", "uint64", "bool", "complex32", "complex64", "complex128", "float8_e4m3fn",
    "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2",
)  # fmt: skip
_COUNT_BITS = 40  # of the exact word: the element count; the 7 above it, the dtype's code
_PRESENT = 1 << 47  # set in both words: an identity is never 0, and a kernel argument always an int64


def identity(name: str, fields: Sequence[object], root: int | None) -> tuple[int, int]:
    """The call's two identity words (IDENT_BITS bits each), which every rank compares beside
    each flag: the first holds the caller's dtype and element count exactly (the dtype of
    ``fields[0]``, or the ``"caller"`` field's where the caller's differs from the wire's, and
    the count ``fields[1]``; counts of 2**40 elements and more share their low bits, the hash
    tells them apart); the second 47 bits of a BLAKE2b hash of the whole description
    (collective, dtype, count, op, algorithm, root and the rest of ``fields``). So calls that
    differ in dtype or count never match, and others only if 47 bits of a cryptographic hash
    collide (94 bits compared in all), against 20 bits of a CRC (linear: thousands of fp32
    counts shared their bits). The top bit of each word is always set (``_PRESENT``).
    """
    text = "|".join(str(f) for f in (name, *fields, root))
    digest = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") % _PRESENT
    dtype, count = None, 0
    if len(fields) >= 2 and isinstance(fields[0], torch.dtype) and isinstance(fields[1], int):
        dtype, count = str(fields[0]).removeprefix("torch."), fields[1]
    for key, value in zip(fields, fields[1:]):
        if key == "caller":
            dtype = value
    code = 0 if dtype is None else (_DTYPE_NAMES.index(dtype) + 1 if dtype in _DTYPE_NAMES else 127)
    exact = _PRESENT | code << _COUNT_BITS | count % (1 << _COUNT_BITS)
    return exact, _PRESENT | digest
