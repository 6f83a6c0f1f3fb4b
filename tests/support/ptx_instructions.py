"""Reading a Triton kernel's compiled forms for the instructions its contract rests on: shared by
tests/ops/test_triton_aot.py (the program kernel and the others gpucomm launches) and
tests/language/test_language_aot.py (the device API's kernels).

- ``INSTRUCTION`` finds the memory instructions and divisions of a PTX text;
- ``has`` says whether one of them is an opcode with given qualifiers;
- ``timer_facts`` says, from the TTGIR, how a kernel reads %globaltimer and what its readings decide;
- ``narrow_products`` finds, in the TTGIR, products computed in 32 bits and then widened to 64.
"""

from __future__ import annotations

import re

__all__ = ["INSTRUCTION", "has", "timer_facts", "narrow_products"]

# Memory instructions and divisions, e.g. "atom.global.sys.release.exch.b64", "div.rn.f32".
INSTRUCTION = re.compile(r"\b(?:atom|red|st|ld|fence|membar|div|bar)\.[\w.]+")


def has(instructions: list[str], opcode: str, *qualifiers: str) -> bool:
    """Some instruction is ``opcode`` with all ``qualifiers`` (their order varies across versions)."""
    return any(i.split(".")[0] == opcode and set(qualifiers) <= set(i.split(".")) for i in instructions)


_DEF = re.compile(r"^\s*(%[\w.$-]+)(?::\d+)?\s*=\s*(.*)$")
_USE = re.compile(r"%[\w.$-]+")
_LAYOUT = re.compile(
    r"^(#\w+) = #ttg\.blocked<\{sizePerThread = \[(\d+)\], threadsPerWarp = \[(\d+)\], warpsPerCTA = \[(\d+)\]"
)
_TIMER = re.compile(r"globaltimer.*->\s*(tensor<(\d+)x\w+, (#\w+)>|\w+)")


def timer_facts(ttgir: str) -> dict:
    """How the kernel reads %globaltimer and what its readings reach (from the TTGIR).

    ``per_thread``: every reading is a tensor laid out one element per thread of the block (a
    scalar, or a replicated tensor, would be read by each thread on its own with nothing to make
    the threads agree). ``branch_sees_raw``: some loop exit or branch depends on a reading through
    no reduction; ``branch_sees_reduced``: some does through a ``tt.reduce`` (a block-wide value).
    """
    layouts = {
        m.group(1): [int(x) for x in m.groups()[1:]] for line in ttgir.splitlines() if (m := _LAYOUT.match(line))
    }
    defs: dict[str, str] = {}
    for line in ttgir.splitlines():
        line = re.sub(r"\bloc\(.*$", "", line)
        if m := _DEF.match(line):
            defs[m.group(1)] = m.group(2)
        # scf.while's loop-carried values start from their initial ones: (%arg = %init, ...).
        for name, init in re.findall(r"(%[\w.$-]+) = (%[\w.$-]+)(?=[,)])", line.split("=", 1)[-1]):
            defs.setdefault(name, init)
    per_thread = True
    for line in ttgir.splitlines():
        if m := _TIMER.search(line):
            shape, layout = m.group(2), m.group(3)
            spt, tpw, wpc = layouts.get(layout, (0, 0, 0))
            per_thread &= shape is not None and spt == 1 and int(shape) == tpw * wpc

    def reaches_timer(name: str, through_reduce: bool, seen: set) -> tuple[bool, bool]:
        """(a raw reading reaches name, a reduced reading does)."""
        if name in seen or name not in defs:
            return False, False
        seen.add(name)
        # A loop's induction variable is no use of the loop: Triton names values after the source's
        # variables, and a region may reuse a name another region defines (an index ``start`` and a
        # wait's clock reading ``start``), which would make a loop over data seem to read the clock.
        text = re.sub(r"\bscf\.for\s+%[\w.$-]+\s*=", "scf.for", defs[name])
        if "globaltimer" in text:
            return (not through_reduce, through_reduce)
        reduces = text.startswith('"tt.reduce"')
        raw = reduced = False
        for use in _USE.findall(text):
            r, d = reaches_timer(use.split("#")[0], through_reduce or reduces, seen)
            raw, reduced = raw or r, reduced or d
        return raw, reduced

    raw = reduced = False
    for line in ttgir.splitlines():
        m = re.search(r"\b(?:scf\.condition|scf\.if)\s*\(?\s*(%[\w.$-]+)", line)
        if m:
            r, d = reaches_timer(m.group(1), False, set())
            raw, reduced = raw or r, reduced or d
    return {"per_thread": per_thread, "branch_sees_raw": raw, "branch_sees_reduced": reduced}


_WIDEN = re.compile(r"arith\.extsi (%[\w.$-]+) : (?:tensor<[\dx]*)?i32\b")
_INT_ARITH = re.compile(r"arith\.(?:addi|subi|muli|shli)\b")


def narrow_products(ttgir: str) -> list[str]:
    """The values (by the source's variable name, Triton's SSA names without their ``_N`` suffix)
    that widen to 64 bits (``arith.extsi`` from i32) an i32 product, through i32 adds and products.

    Triton types an int argument below 2**31 as i32, and ``x + i * ELEM`` with an i64 address ``x``
    computes ``i * ELEM`` in 32 bits before widening it: past 2**31 bytes it has already wrapped.
    Such a product is safe only where its factors are bounded well below (a flag's index, a row).
    """
    defs = {}
    for line in ttgir.splitlines():
        line = re.sub(r"\bloc\(.*$", "", line)
        if m := _DEF.match(line):
            defs[m.group(1)] = m.group(2)
    found = set()
    for name, text in defs.items():
        widen = _WIDEN.match(text)
        if not widen:
            continue
        stack, seen = [widen.group(1)], set()
        while stack:
            value = stack.pop()
            if value in seen or value not in defs:
                continue
            seen.add(value)
            if _INT_ARITH.match(defs[value]):
                if defs[value].startswith("arith.muli") and re.search(r":\s*(?:tensor<[\dx]*)?i32\b", defs[value]):
                    found.add(re.sub(r"_\d+$", "", name.lstrip("%")))
                    break
                stack += _USE.findall(defs[value].split(":")[0])
    return sorted(found)
