"""Message sizes as nccl-tests writes them: ``8``, ``1K``, ``4M``, ``1G`` (binary multiples)."""

from __future__ import annotations

__all__ = ["parse_size", "size_sweep", "linear_sweep"]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """``"4M"`` -> 4194304; a plain number is bytes; a trailing ``B`` is allowed (``4MB``)."""
    raw = str(text).strip().upper()
    if raw.endswith("B") and len(raw) > 1:
        raw = raw[:-1]
    unit = raw[-1] if raw and raw[-1] in "KMGT" else ""
    digits = raw[: len(raw) - len(unit)]
    try:
        value = float(digits)
    except ValueError:
        raise ValueError(f"parse_size: expected a size such as 8, 1K, 4M or 1G, got {text!r}") from None
    nbytes = int(value * _UNITS[unit])
    if nbytes < 0 or nbytes != value * _UNITS[unit]:
        raise ValueError(f"parse_size: expected a whole, non-negative number of bytes, got {text!r}")
    return nbytes


def size_sweep(min_bytes: int, max_bytes: int, factor: float) -> list[int]:
    """``min, min*f, min*f^2, ... <= max`` (nccl-tests' ``-b/-e/-f``); factor 1 means min only."""
    if min_bytes <= 0 or max_bytes < min_bytes:
        raise ValueError(f"size_sweep: expected 0 < min <= max, got min={min_bytes} max={max_bytes}")
    if factor < 1:
        raise ValueError(f"size_sweep: expected a step factor >= 1, got {factor}")
    if factor == 1:
        return [min_bytes]
    sizes = []
    size = float(min_bytes)
    while size <= max_bytes:
        sizes.append(int(size))
        size *= factor
    return sizes


def linear_sweep(min_bytes: int, max_bytes: int, step_bytes: int) -> list[int]:
    """``min, min+i, min+2i, ... <= max`` (nccl-tests' ``-i/--stepbytes``)."""
    if min_bytes <= 0 or max_bytes < min_bytes:
        raise ValueError(f"linear_sweep: expected 0 < min <= max, got min={min_bytes} max={max_bytes}")
    if step_bytes <= 0:
        raise ValueError(f"linear_sweep: expected a step of at least 1 byte, got {step_bytes}")
    return list(range(min_bytes, max_bytes + 1, step_bytes))
