"""What a kernel's PTX declares it takes, set against what a launch handed the driver.

``entry_params`` reads the parameter list of one ``.entry``; ``mismatches`` compares it with the
layout gpucomm's launcher packed, the bytes the driver double recorded and the values the call
meant; ``run_ptx`` is the PTX of a shipped CUDA file as nvcc compiled it (the ``nvcc_fatbins``
fixture of tests/conftest.py).
"""

from __future__ import annotations

import re

__all__ = ["entry_params", "mismatches", "run_ptx"]

_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\((.*?)\)", re.S)
_PARAM = re.compile(r"\.param\s+(?:\.align\s+(\d+)\s+)?\.([a-z])(\d+)\b[^,]*?(?:\[(\d+)\])?\s*(?:,|$)")


def entry_params(ptx: str, name: str) -> list[tuple[int, int]]:
    """[(offset, size)] of the parameters of ``.entry name``: each at the next offset aligned to
    its alignment (the ``.align`` it names, else its element size)."""
    entries = {m.group(1): m.group(2) for m in _ENTRY.finditer(ptx)}
    found, end = [], 0
    for align, _, bits, count in _PARAM.findall(entries[name].strip() + ","):
        element = int(bits) // 8
        size = element * int(count or 1)
        alignment = int(align or element)
        offset = -(-end // alignment) * alignment
        found.append((offset, size))
        end = offset + size
    return found


def mismatches(
    declared: list[tuple[int, int]], bound_layout: list[list[int]], recorded: bytes, meant: list[int]
) -> list[str]:
    """What disagrees between a kernel's declared parameters, the launcher's layout, the bytes the
    driver got and the values the call meant (empty: nothing)."""
    found = []
    if [tuple(p) for p in bound_layout] != declared:
        found.append(f"packed as {bound_layout}, the kernel declares {declared}")
    end = declared[-1][0] + declared[-1][1] if declared else 0
    if len(recorded) != end:
        found.append(f"the driver got {len(recorded)} parameter bytes, the kernel takes {end}")
    if len(meant) != len(declared):
        found.append(f"{len(meant)} values meant, {len(declared)} parameters declared")
    for i, ((offset, size), value) in enumerate(zip(declared, meant)):
        got = int.from_bytes(recorded[offset : offset + size], "little")
        want = value % (1 << 8 * size)
        if got != want:
            found.append(f"parameter {i} at {offset} ({size} bytes) carries {got:#x}, the call meant {want:#x}")
    return found


def run_ptx(nvcc_fatbins, file: str, arch: int) -> str:
    """The PTX of the shipped CUDA file ``file`` for sm_<arch>, from nvcc's fatbin (cuobjdump)."""
    from cuda_tools import run, tool

    return run([tool("cuobjdump"), "-ptx", str(nvcc_fatbins.fatbin(file, arch))])
