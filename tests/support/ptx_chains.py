"""How many global loads in series a kernel waits for before it reads a peer, read from its PTX.

A load whose address is the result of another load cannot issue before that load returns: a
chain of k such loads costs k round trips to memory before the first byte of a peer moves. This
module follows the register def-use chains of one ``.entry`` of a PTX text, from its ``ld.param``
of every parameter, and answers for every *peer load* (an ``ld`` of data from global memory whose
address derives from a peer pointer; flag polls, acquire loads and atomics, are not data) how many
global loads its address depends on, the longest chain.

What counts:

- on-chip memory carries chains through it: a store to shared or local memory passes its value's
  depth (and whether it is a peer pointer) to every load of that space;
- a *global load* is any ``ld``/``ldu`` that is not of the param, shared, local or const space
  (``ld.global``, ``ld.global.cg``, ``ld.acquire.sys.global``, a generic ``ld``) and any ``atom``
  (it returns a value read from memory);
- a *peer pointer* is a parameter named a peer's address (``peer_params``), or a value loaded from
  an address that derives from a parameter named a table of peer addresses (``peer_tables``), and
  anything computed from either;
- the depth of a register is, over every instruction that writes it (PTX registers are written
  in several places: loops, predicated moves), the largest of: 1 + the depth of the address, for
  a global load; the depth of its sources and of its guard predicate, otherwise. Parameters and
  special registers are 0. Loops are followed to a fixed point (capped: a pointer chase in a loop
  would grow without end, and reports the cap).

Control dependences through branches are not followed (a flag poll decides *when* a peer is
read, not *where*): this counts the address chain, which is what the instruction tables of the
program kernel lengthen.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["entry", "peer_load_depths", "Instruction", "parse"]

# A chain longer than this is reported as this (a load in a loop whose address is its own result).
DEPTH_CAP = 16
_ENTRY = re.compile(r"\.entry\s+(\w+)")
_REGISTER = re.compile(r"%[A-Za-z_][\w.]*")
_PARAM = re.compile(r"\[\s*(\w+_param_(\d+))\s*(?:\+\s*\d+\s*)?\]")
_NO_DESTINATION = (
    "st.",
    "red.",
    "bar.",
    "bar ",
    "barrier",
    "membar",
    "fence",
    "bra",
    "ret",
    "exit",
    "trap",
    "prefetch",
    "call",
)
_NOT_GLOBAL = (".param", ".shared", ".local", ".const")


@dataclass
class Instruction:
    """One PTX instruction, as the chains follow it."""

    opcode: str
    guard: str | None
    dests: list[str]
    sources: list[str]
    address: list[str]  # registers of the [address] operand of a load or atom
    param: int | None  # the parameter index an ld.param reads

    @property
    def global_load(self) -> bool:
        op = self.opcode
        if op.startswith("atom.") or op == "atom":
            return ".shared" not in op
        if op.startswith(("ld.", "ldu.")):
            return not any(space in op for space in _NOT_GLOBAL)
        return False

    @property
    def data_load(self) -> bool:
        """A load that reads data: not an atomic, and not a flag's acquire (or relaxed, or
        volatile) load, which decides when data is read, not where."""
        return (
            self.global_load
            and not self.opcode.startswith("atom")
            and not any(order in self.opcode for order in (".acquire", ".relaxed", ".volatile"))
        )


def entry(ptx: str, name: str) -> str:
    """The body of ``.entry name`` in a PTX text."""
    start = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\(", ptx)
    if start is None:
        raise KeyError(f"no .entry {name} in the PTX (entries: {_ENTRY.findall(ptx)})")
    body = ptx[start.end() :]
    following = re.search(r"\n\s*(?:\.visible\s+)?\.entry\s", body)
    return body if following is None else body[: following.start()]


def _operands(text: str) -> list[str]:
    """Top-level comma-separated operands (braces and brackets kept whole)."""
    found, depth, current = [], 0, ""
    for ch in text:
        if ch in "{[(":
            depth += 1
        elif ch in "}])":
            depth -= 1
        if ch == "," and depth == 0:
            found.append(current.strip())
            current = ""
        else:
            current += ch
    if current.strip():
        found.append(current.strip())
    return found


def parse(body: str) -> list[Instruction]:
    """The instructions of one entry's body (directives, labels and comments left out)."""
    text = re.sub(r"//[^\n]*", "", body)
    # Directives (.loc, .reg, .param, ...) take a line each, some without a semicolon.
    text = "\n".join(line for line in text.splitlines() if not line.strip().startswith("."))
    found = []
    for raw in text.split(";"):
        stmt = raw.strip()
        # Labels and scope braces (Triton's inline asm opens blocks) come before a statement.
        while True:
            stmt = stmt.lstrip("{}) \t\n")
            label = re.match(r"^[$\w]+:", stmt)
            if label is None:
                break
            stmt = stmt[label.end() :]
        if not stmt or stmt.startswith("."):
            continue
        guard = None
        if stmt.startswith("@"):
            head, stmt = re.split(r"\s+", stmt, maxsplit=1)
            guard = head.lstrip("@!")
        opcode, rest = (re.split(r"\s+", stmt, maxsplit=1) + [""])[:2]
        ops = _operands(rest.strip())
        if opcode.startswith(_NO_DESTINATION) or not ops:
            dests, srcs = [], ops
        else:
            dests, srcs = [ops[0]], ops[1:]
        dest_regs = [r for d in dests for r in _REGISTER.findall(d)]
        address = [r for s in srcs if s.startswith("[") for r in _REGISTER.findall(s)]
        src_regs = [r for s in srcs for r in _REGISTER.findall(s)]
        # On-chip memory is followed as one cell per space: what a store to shared (or local)
        # memory writes, any load of that space may read (the CUDA program kernel keeps its
        # operand addresses in shared memory; a spilled register goes to local memory).
        space = next((sp for sp in (".shared", ".local") if sp in opcode), None)
        if space and opcode.startswith("st"):
            dest_regs = [f"%memory{space}"]
            src_regs = [r for s in srcs if not s.startswith("[") for r in _REGISTER.findall(s)]
        elif space and opcode.startswith("ld"):
            src_regs = [*src_regs, f"%memory{space}"]
        param = None
        if opcode.startswith("ld.param"):
            match = _PARAM.search(rest)
            param = int(match.group(2)) if match else None
        found.append(Instruction(opcode, guard, dest_regs, src_regs, address, param))
    return found


def peer_load_depths(ptx: str, name: str, peer_params: set[int], peer_tables: set[int] = frozenset()) -> list[int]:
    """For every peer load of entry ``name`` (module docstring), in program order: how many global
    loads in series its address waits for. ``peer_params``: indices of the parameters that are
    peers' addresses; ``peer_tables``: of the parameters that point at tables of them."""
    code = parse(entry(ptx, name))
    depth: dict[str, int] = {}
    peer: set[str] = set()  # registers holding a peer pointer (or an address computed from one)
    table: set[str] = set()  # registers holding an address into a table of peer pointers
    changed = True
    while changed:
        changed = False
        for ins in code:
            if not ins.dests:
                continue
            if ins.param is not None:
                d, is_peer, is_table = 0, ins.param in peer_params, ins.param in peer_tables
            elif ins.global_load:
                d = min(
                    DEPTH_CAP,
                    1 + max((depth.get(r, 0) for r in ins.address + ([ins.guard] if ins.guard else [])), default=0),
                )
                # What a load from a table of peer pointers returns is a peer pointer; what a load
                # from a peer returns is data.
                is_peer, is_table = any(r in table for r in ins.address), False
            else:
                used = ins.sources + ([ins.guard] if ins.guard else [])
                d = max((depth.get(r, 0) for r in used), default=0)
                is_peer = any(r in peer for r in ins.sources)
                is_table = any(r in table for r in ins.sources)
            for r in ins.dests:
                if d > depth.get(r, 0):
                    depth[r] = d
                    changed = True
                if is_peer and r not in peer:
                    peer.add(r)
                    changed = True
                if is_table and r not in table:
                    table.add(r)
                    changed = True
    found = []
    for ins in code:
        if ins.data_load and any(r in peer for r in ins.address):
            used = ins.address + ([ins.guard] if ins.guard else [])
            found.append(max((depth.get(r, 0) for r in used), default=0))
    return found
