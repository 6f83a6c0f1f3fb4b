"""Every Triton kernel compiles ahead of time for sm_80 and sm_90 without a GPU, and the PTX has
the memory-ordering and arithmetic instructions the contract relies on.

Compiling needs the real compiler, not the interpreter: the kernels are imported and compiled in
one subprocess started without TRITON_INTERPRET (this file run as a script), which reports the
instructions of interest of every variant.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from ptx_instructions import INSTRUCTION, has, narrow_products, timer_facts

ARCHS = (80, 90)
# Sources a REDUCE loads at once, as the launcher picks them for 2, 4 and 8 ranks.
LOAD_SOURCES = (2, 4, 8)
DTYPES = ("float32", "float16", "bfloat16", "float64", "int32", "int64")
OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AVG")
# Fences and atomics, in the order the PTX has them.
_ORDERING = re.compile(r"\b(?:atom|red|fence|membar)\.[\w.]+")
# The PTX's file table and line comments name the sources (fence.py among them): not instructions.
_FILE_LINE = re.compile(r"^\s*\.file\b.*$|//.*$", re.MULTILINE)
# What a SYNC's order is made of, in the order the PTX has them: barriers, fences, atomics, global
# stores and loads (flag polls are atomics; data loads are ld.global).
_SYNC_EVENTS = re.compile(r"\b(?:bar|barrier|fence|membar|atom|red|st\.global|ld\.global)\b[\w.]*")
# The small all_reduce's variants: (op, dtype, ranks, the tensor 16-byte aligned).
SMALL_VARIANTS = (
    ("SUM", "float32", 8, True),
    ("AVG", "bfloat16", 2, True),
    ("MIN", "float16", 4, True),
    ("SUM", "int64", 8, True),
    ("SUM", "float32", 2, False),
)


def _variants() -> dict[str, tuple]:
    """name -> (kernel, signature, constexprs, attrs)."""
    import triton.language as tl

    from gpucomm._kernels.triton import copy, flags, reduce
    from gpucomm.ops import instruction_set

    variants = {
        "signal": (
            flags.signal_kernel,
            {"addr_ptr": "*i64", "n_flags": "i32", "epoch": "i64", "BLOCK": "constexpr"},
            {"BLOCK": 16},
            {},
        ),
        "wait": (
            flags.wait_kernel,
            {
                "addr_ptr": "*i64",
                "status_ptr": "*i64",
                "n_flags": "i32",
                "epoch": "i64",
                "max_spins": "i32",
                "BLOCK": "constexpr",
            },
            {"BLOCK": 16},
            {},
        ),
    }
    # n_elements divisible by 16, as the launcher's specialisation marks it for such sizes.
    divisible = {(1,): [["tt.divisibility", 16]]}
    for aligned in (False, True):
        variants[f"copy-aligned{int(aligned)}"] = (
            copy.copy_kernel,
            {
                "addr_ptr": "*i64",
                "n_elements": "i64",
                "ELEM": "constexpr",
                "ALIGNED": "constexpr",
                "BLOCK": "constexpr",
            },
            {"ELEM": tl.int64, "ALIGNED": aligned, "BLOCK": 2048},
            divisible,
        )
    for dtype in DTYPES:
        for op in OPS:
            variants[f"reduce-{op}-{dtype}"] = (
                reduce.reduce_kernel,
                {
                    "addr_ptr": "*i64",
                    "n_elements": "i64",
                    "divisor": "i32",
                    "DTYPE": "constexpr",
                    "OP": "constexpr",
                    "K": "constexpr",
                    "ALIGNED": "constexpr",
                    "BLOCK": "constexpr",
                },
                {
                    "DTYPE": getattr(tl, dtype),
                    "OP": getattr(instruction_set, f"OP_{op}"),
                    "K": 3,
                    "ALIGNED": True,
                    "BLOCK": 1024,
                },
                divisible,
            )
    from gpucomm._kernels.triton import program

    program_signature = {
        "prog_ptr": "*i64",
        "n_instr": "i64",
        "opnd_ptr": "*i64",
        "peers_ptr": "*i64",
        "state_addr": "i64",
        "record_addr": "i64",
        "rank": "i32",
        "world": "i32",
        "fingerprint": "i64",
        "half_bytes": "i64",
        "granule": "i64",
        "timeout_ns": "i64",
        "all_channels": "i32",
        "ident_word": "i64",
        "ident0": "i64",
        "ident1": "i64",
    }
    program_variants = [(dtype, "SUM") for dtype in DTYPES] + [("float32", op) for op in ("PRODUCT", "MIN", "MAX")]
    program_variants.append(("bfloat16", "MIN"))
    for dtype, op in program_variants:
        constexprs = {
            "DTYPE": getattr(tl, dtype),
            "OP": getattr(instruction_set, f"OP_{op}"),
            "COPY_ELEM": tl.int64,
            "COPY_BYTES": 8,
            "ELEM_BYTES": {"float16": 2, "bfloat16": 2, "float64": 8, "int64": 8}.get(dtype, 4),
            "ALIGNED": True,
            "SOURCES": 8,
            "LANES": 32 * program.NUM_WARPS,
        }
        signature = {**program_signature, **{name: "constexpr" for name in constexprs}}
        variants[f"program-{op}-{dtype}"] = (program.program_kernel, signature, constexprs, {})
    from gpucomm._kernels.triton import small

    small_signature = {
        "x_addr": "i64",
        "n": "i64",
        **{f"stage{p}": "i64" for p in range(8)},
        **{f"flags{p}": "i64" for p in range(8)},
        "half_bytes": "i64",
        "state_addr": "i64",
        "record_addr": "i64",
        "rank": "i32",
        "fingerprint": "i64",
        "timeout_ns": "i64",
        "all_channels": "i32",
        "divisor": "i32",
        "ident_word": "i64",
        "ident0": "i64",
        "ident1": "i64",
    }
    for op, dtype, world, aligned in SMALL_VARIANTS:
        elem = {"float16": 2, "bfloat16": 2, "float64": 8, "int64": 8}.get(dtype, 4)
        lanes = 32 * small.NUM_WARPS
        constexprs = {
            "DTYPE": getattr(tl, dtype),
            "OP": getattr(instruction_set, f"OP_{op}"),
            "COPY": {8: tl.int64, 4: tl.int32, 2: tl.int16}[elem],
            "ELEM": elem,
            "ALIGNED": aligned,
            "WORLD": world,
            "BLOCK": lanes * 16 // elem,
            "LANES": lanes,
        }
        signature = {**small_signature, **{name: "constexpr" for name in constexprs}}
        variants[_small_name(op, dtype, world, aligned)] = (small.small_kernel, signature, constexprs, {})
    from gpucomm._kernels.triton import multimem

    multimem_signature = {
        **{name: "i64" for name in ("mc_base", "offset", "signal_offset", "state_addr", "record_addr")},
        "peers_ptr": "*i64",
        "rank": "i32",
        "world": "i32",
        **{name: "i64" for name in ("lo", "hi", "timeout_ns")},
        **{name: "constexpr" for name in ("DTYPE", "OP", "UNIT_ELEMS", "LANES")},
    }
    variants["multimem-SUM-bfloat16"] = (
        multimem.multimem_all_reduce_kernel,
        multimem_signature,
        {"DTYPE": tl.bfloat16, "OP": instruction_set.OP_SUM, "UNIT_ELEMS": 8, "LANES": 32 * multimem.NUM_WARPS},
        {},
    )
    # The REDUCE body at fewer sources loaded at once (a workspace of 2 or 4 ranks).
    for sources in LOAD_SOURCES[:-1]:
        kernel, signature, constexprs, attrs = variants["program-SUM-float32"]
        variants[f"program-SUM-float32-sources{sources}"] = (
            kernel,
            signature,
            {**constexprs, "SOURCES": sources},
            attrs,
        )
    # The sizes as Triton's dispatch types them below 2**31: i32 (a workspace under 2 GiB).
    kernel, signature, constexprs, attrs = variants["program-SUM-float32"]
    narrow = {name: "i32" for name in ("n_instr", "half_bytes", "granule", "timeout_ns", "ident_word")}
    variants["program-SUM-float32-int32"] = (kernel, {**signature, **narrow}, constexprs, attrs)
    # Copies of byte granularity (COPY_BYTES 1: a uint8 tensor of odd size), positions still aligned.
    kernel, signature, constexprs, attrs = variants["program-SUM-float32"]
    variants["program-SUM-float32-bytes1"] = (
        kernel,
        signature,
        {**constexprs, "COPY_ELEM": tl.uint8, "COPY_BYTES": 1},
        attrs,
    )
    kernel, signature, constexprs, attrs = variants["multimem-SUM-bfloat16"]
    narrow = {name: "i32" for name in ("offset", "signal_offset", "lo", "hi", "timeout_ns")}
    variants["multimem-SUM-bfloat16-int32"] = (kernel, {**signature, **narrow}, constexprs, attrs)
    # Triton may turn an int argument equal to 1 into a constant; the kernels must compile then too.
    kernel, signature, constexprs, attrs = variants["reduce-AVG-float32"]
    variants["reduce-AVG-float32-divisor1"] = (
        kernel,
        {**signature, "divisor": "constexpr"},
        {**constexprs, "divisor": 1},
        attrs,
    )
    for name in ("signal", "wait"):
        kernel, signature, constexprs, attrs = variants[name]
        variants[f"{name}-epoch1"] = (kernel, {**signature, "epoch": "constexpr"}, {**constexprs, "epoch": 1}, attrs)
    return variants


def _small_name(op: str, dtype: str, world: int, aligned: bool) -> str:
    return f"small-{op}-{dtype}-world{world}" + ("" if aligned else "-unaligned")


SMALL_NAMES = [_small_name(*variant) for variant in SMALL_VARIANTS]


def _options(name: str) -> dict:
    """Compile options as the launchers pass them to the program and small kernels."""
    from gpucomm._kernels.triton import program, small

    if name.startswith("small"):
        return {"num_warps": small.NUM_WARPS}
    if name.startswith("multimem"):
        from gpucomm._kernels.triton import multimem

        return {"num_warps": multimem.NUM_WARPS}
    return {"num_warps": program.NUM_WARPS, "maxnreg": program.MAX_REGISTERS} if name.startswith("program") else {}


def _sync_events(ptx: str) -> list[str]:
    """The kernel's barriers, fences, flag atomics, data stores and data loads in PTX order, each
    one word: barrier, fence, release, acquire, store, load (plain), load.cg."""
    events = []
    for op in _SYNC_EVENTS.findall(ptx):
        parts = op.split(".")
        if parts[0] in ("bar", "barrier"):
            events.append("barrier")
        elif parts[0] in ("fence", "membar"):
            events.append("fence")
        elif parts[0] in ("atom", "red"):
            events += [kind for kind in ("release", "acquire") if kind in parts and "sys" in parts]
        elif parts[0] == "st":
            events.append("store")
        else:
            events.append("load.cg" if "cg" in parts else "load")
    return events


def _worker() -> dict[str, list[str] | str]:
    """Compile every variant for every arch; the sorted instructions seen, or the error text."""
    import triton
    from triton.backends.compiler import GPUTarget

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("test_triton_aot worker: run without TRITON_INTERPRET")
    report: dict[str, list[str] | str] = {}
    for name, (kernel, signature, constexprs, attrs) in _variants().items():
        for arch in ARCHS:
            source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
            try:
                compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=_options(name))
            except Exception as exc:  # reported per variant, so one failure does not hide others
                report[f"{name}-sm{arch}"] = f"{type(exc).__name__}: {exc}"
                continue
            ptx = _FILE_LINE.sub("", compiled.asm["ptx"])
            markers = ["%globaltimer"] if "%globaltimer" in ptx else []
            report[f"{name}-sm{arch}"] = sorted(set(INSTRUCTION.findall(ptx))) + markers
            if name.startswith(("signal", "multimem", "program")):
                report[f"{name}-sm{arch}-order"] = _ORDERING.findall(ptx)
            if name.startswith(("small", "program")):
                report[f"{name}-sm{arch}-sync"] = _sync_events(ptx)
            if name.startswith(("program", "multimem")):
                report[f"{name}-sm{arch}-narrow"] = narrow_products(compiled.asm["ttgir"])
            if name.startswith("program"):
                report[f"{name}-sm{arch}-loops"] = _loop_loads(ptx)
                report[f"{name}-sm{arch}-carry"] = _carry_loops(ptx)
                report[f"{name}-sm{arch}-timer"] = timer_facts(compiled.asm["ttgir"])
    return report


# -- what the PTX's loops load ------------------------------------------------------------------
_LABEL = re.compile(r"^\s*(\$L__\w+):")
_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$L__\w+);")
# A 16-byte load from global memory: ld.global.v4.b32 (4-byte elements), ld.global.v2.b64 (8-byte).
_VECTOR_LOAD = re.compile(r"\bld\.global(?:\.\w+)*\.v(?:4\.[bfsu]32|2\.[bfsu]64)\b")
# What folds or stores: a float32 fold (the variants these counts are asserted on), a global store.
_FOLD_OR_STORE = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:(?:add|mul|min|max)(?:\.\w+)*\.f32|st\.global)\b")


def _own_loop_lines(ptx: str) -> list[list[str]]:
    """The lines of every loop of the PTX that are its own (not those of loops nested in it)."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL.match(line))}
    # A loop is a branch back to a label above it.
    spans = [
        (labels[m.group(1)], i)
        for i, line in enumerate(lines)
        if (m := _BRANCH.search(line)) and labels.get(m.group(1), i + 1) <= i
    ]
    loops = []
    for lo, hi in spans:
        nested = [(a, b) for a, b in spans if lo <= a and b <= hi and (a, b) != (lo, hi)]
        loops.append([lines[i] for i in range(lo, hi + 1) if not any(a <= i <= b for a, b in nested)])
    return loops


def _loop_loads(ptx: str) -> list[list[int]]:
    """[16-byte loads, folds or stores between the first and the last of them] of every loop of
    the PTX, counting only a loop's own lines (not those of loops nested in it): what one
    iteration issues, and whether it waits for a load's data before it has issued them all."""
    found = []
    for own in _own_loop_lines(ptx):
        loads = [k for k, line in enumerate(own) if _VECTOR_LOAD.search(line)]
        between = own[loads[0] : loads[-1]] if loads else []
        found.append([len(loads), sum(bool(_FOLD_OR_STORE.match(line)) for line in between)])
    return found


# What a carried copy's loop is made of: the owned offsets' 64-bit divisions, the .cg loads of its
# 8-byte units (int64 here: 16-byte vectors or single words), and no 16-byte load of 4-byte elements
# (a float32 REDUCE body's, which inlines the carry's one-off tails).
_DIVISION = re.compile(r"\bdiv\.s64\b")
_UNIT_LOAD = re.compile(r"\bld\.global\.cg(\.v2)?\.b64\b")
_F32_VECTOR_LOAD = re.compile(r"\bld\.global\.cg\.v4\.b32\b")


def _carry_loops(ptx: str) -> list[list[int]]:
    """[16-byte loads of 8-byte units, single 8-byte loads, 64-bit divisions] of every loop of the
    PTX (its own lines) that divides and loads 8-byte units but no float32 vector: the carried
    copies' loops (kernels/triton/carry.py) of a float32 program kernel."""
    found = []
    for own in _own_loop_lines(ptx):
        text = "\n".join(own)
        units = _UNIT_LOAD.findall(text)
        divisions = len(_DIVISION.findall(text))
        if divisions and units and not _F32_VECTOR_LOAD.search(text):
            found.append([units.count(".v2"), units.count(""), divisions])
    return found


@pytest.fixture(scope="module")
def ptx() -> dict[str, list[str] | str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # silences triton 3.9's warning; fusion is its default
    proc = subprocess.run([sys.executable, __file__, "--worker"], env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"AOT worker failed (exit {proc.returncode}):\n{proc.stderr[-8000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _instructions(ptx: dict, name: str) -> list[str]:
    seen = ptx[name]
    if isinstance(seen, str):
        pytest.fail(f"{name} did not compile: {seen}", pytrace=False)
    return seen


@pytest.mark.parametrize("arch", ARCHS)
def test_signal_is_a_release_at_system_scope(ptx, arch: int) -> None:
    seen = _instructions(ptx, f"signal-sm{arch}")
    # triton 3.9 emits atom.global.sys.release.exch.b64
    assert has(seen, "atom", "sys", "release", "exch"), seen


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", ("signal", "signal-epoch1"))
def test_signal_fences_at_system_scope_before_it_releases(ptx, arch: int, name: str) -> None:
    """The memory contract's signal (docs/kernel-contract.md): ``membar.sys``, CUDA's
    ``__threadfence_system()``, then the release stores; the data was written by earlier kernels."""
    order = ptx[f"{name}-sm{arch}-order"]
    releases = [i for i, op in enumerate(order) if has([op], "atom", "release", "sys")]
    assert "membar.sys" in order and releases and order.index("membar.sys") < releases[0], order


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "name",
    [
        "copy-aligned0",
        "copy-aligned1",
        "reduce-SUM-float32",
        "reduce-MAX-bfloat16",
        "reduce-SUM-float16",
        "program-SUM-float32",
        "program-MIN-bfloat16",
        "program-SUM-int64",
        *SMALL_NAMES,
    ],
)
def test_peer_data_loads_are_cg(ptx, arch: int, name: str) -> None:
    """The memory contract's loads (docs/kernel-contract.md): data that may be a peer's is loaded
    ``.cg`` (L2 only), as the CUDA kernels' ``__ldcg``; no 16-byte load of data goes through L1."""
    seen = _instructions(ptx, f"{name}-sm{arch}")
    assert has(seen, "ld", "global", "cg"), seen
    vectors = [i for i in seen if i.startswith("ld.global") and any(q in ("v2", "v4") for q in i.split("."))]
    assert all("cg" in i.split(".") for i in vectors), vectors
    if name.startswith("small"):
        # Its only plain loads are of its own state words (the channel's epoch, the poison): the
        # copy-in's and the fold's loads, vectors and tails, are all .cg, as CUDA's small kernels.
        plain = {i for i in seen if i.startswith("ld.global") and "cg" not in i.split(".")}
        assert plain == {"ld.global.b64"}, seen


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", [*SMALL_NAMES, "program-SUM-float32", "program-MIN-bfloat16"])
def test_sync_releases_after_a_block_barrier_and_fences_nothing(ptx, arch: int, name: str) -> None:
    """The memory contract's SYNC (docs/kernel-contract.md), the same in the small kernel as in the
    program kernel (tests/ops/test_cuda_compile.py checks CUDA's): the kernel signals data its own block
    wrote, so a block barrier, then the release stores, with no system-scope fence (that is the
    signal kernel's, whose data earlier kernels wrote, and a fenced SYNC's: one ``membar.sys`` in
    the program kernel, checked below); the acquire polls, then a block barrier before any data is
    loaded."""
    events = ptx[f"{name}-sm{arch}-sync"]
    assert events.count("fence") == (1 if name.startswith("program") else 0), events
    # Between the block's last data store and the first release (the SYNC's signal), a barrier.
    before = [event for event in events[: events.index("release")] if event in ("store", "barrier")]
    assert before and before[-1] == "barrier", events
    acquired = False
    for event in events:
        if event == "acquire":
            acquired = True
        elif event == "barrier":
            acquired = False
        elif event == "load.cg":
            assert not acquired, events  # a load of data between the polls and the barrier


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", ["program-SUM-float32", "program-MIN-bfloat16", "program-SUM-int64"])
def test_fenced_sync_fences_at_system_scope_before_it_releases(ptx, arch: int, name: str) -> None:
    """A SYNC with the fence word (the first SYNC of two-shot-symmetric and of the other in-place
    symmetric programs: the data it announces was written by earlier kernels) runs ``membar.sys``
    before its release stores, as the signal kernel; the kernel has one such fence, on the SYNC's
    path (tests/workspace/test_sync_fences.py checks which SYNCs carry the word)."""
    order = ptx[f"{name}-sm{arch}-order"]
    releases = [i for i, op in enumerate(order) if has([op], "atom", "release", "sys")]
    assert order.count("membar.sys") == 1 and releases and order.index("membar.sys") < releases[0], order


def test_multimem_start_barrier_fences_at_system_scope_and_the_end_barrier_does_not(ptx) -> None:
    """multimem's start barrier announces the tensor's input, written by earlier kernels:
    ``membar.sys``, then the multicast add with release (``multimem.red.release.sys``); its end
    barrier announces the block's own stores through the switch and fences nothing. sm_90 only
    (multimem needs it)."""
    order = ptx["multimem-SUM-bfloat16-sm90-order"]
    adds = [i for i, op in enumerate(order) if op.startswith("red.release.sys")]
    fences = [i for i, op in enumerate(order) if op == "membar.sys"]
    assert len(adds) == 2 and fences and all(i < adds[0] for i in fences), order


@pytest.mark.parametrize("arch", ARCHS)
def test_wait_is_an_acquire_at_system_scope(ptx, arch: int) -> None:
    seen = _instructions(ptx, f"wait-sm{arch}")
    # triton 3.9 emits atom.global.sys.acquire.add.u64 (an atomic add of 0)
    assert has(seen, "atom", "sys", "acquire"), seen


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", ("reduce-AVG-float32-divisor1", "signal-epoch1", "wait-epoch1"))
def test_kernels_compile_with_arguments_specialised_to_one(ptx, arch: int, name: str) -> None:
    _instructions(ptx, f"{name}-sm{arch}")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("aligned", (0, 1))
def test_copy_compiles_and_vectorises_aligned_addresses(ptx, arch: int, aligned: int) -> None:
    seen = _instructions(ptx, f"copy-aligned{aligned}-sm{arch}")
    # 16-byte accesses: ld.global.v2.b64 / st.global.v2.b64 for the int64 elements here.
    vector = has(seen, "ld", "global", "v2") and has(seen, "st", "global", "v2")
    # Only the 16-byte alignment promise lets the compiler use them.
    assert vector == bool(aligned), seen


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_reduce_compiles(ptx, arch: int, dtype: str, op: str) -> None:
    seen = _instructions(ptx, f"reduce-{op}-{dtype}-sm{arch}")
    if op == "AVG" and dtype in ("float32", "float16", "bfloat16"):
        # fp32 division must be the IEEE one (the bitwise contract), never div.full/div.approx.
        divisions = [i for i in seen if i.startswith("div.")]
        assert divisions == ["div.rn.f32"], seen


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "variant", ["SUM-float32", "SUM-bfloat16", "SUM-float64", "SUM-int64", "MIN-bfloat16", "MAX-float32"]
)
def test_program_kernel_compiles_with_system_scope_flags_a_clock_and_vectors(ptx, arch: int, variant: str) -> None:
    seen = _instructions(ptx, f"program-{variant}-sm{arch}")
    assert has(seen, "atom", "release", "sys", "exch"), seen  # SYNC's signal
    assert has(seen, "atom", "acquire", "sys", "add"), seen  # SYNC's wait
    assert "%globaltimer" in seen, seen  # the deadline of every wait
    assert has(seen, "bar", "sync"), seen  # the channel's threads line up around SYNC and moves
    assert any(i.startswith(("ld.global.cg.v", "ld.global.v")) for i in seen), seen  # 16-byte vectors
    if variant.endswith("float32"):
        # AVG's division is the IEEE one (the program's integer divisions are its own arithmetic).
        divisions = [i for i in seen if i.startswith("div.") and i.endswith("f32")]
        assert divisions == ["div.rn.f32"], seen


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("op", ["SUM", "PRODUCT", "MIN", "MAX"])
def test_program_kernel_compiles_every_fold(ptx, arch: int, op: str) -> None:
    _instructions(ptx, f"program-{op}-float32-sm{arch}")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant", ["SUM-float32", "SUM-bfloat16", "MIN-bfloat16"])
def test_program_wait_decides_its_timeout_once_per_block(ptx, arch: int, variant: str) -> None:
    # Issue 21, item 5. Threads read %globaltimer at different moments: if each decided the
    # deadline for itself, warps would leave the wait at different iterations and meet different
    # barriers. The kernel reads the clock one lane per thread and decides by a reduction over
    # the block, so every warp leaves together and sees the same outcome.
    facts = ptx[f"program-{variant}-sm{arch}-timer"]
    assert facts == {"per_thread": True, "branch_sees_raw": False, "branch_sees_reduced": True}, facts


# Measured on the sm_90 PTX (Triton 3.9): 16 loads of 16 bytes per thread in one iteration of the
# REDUCE body at 2, 4 and 8 sources, all issued before the first fold or store (the earlier
# kernel issued 1 per iteration of a loop over the sources). The floor is that count.
REDUCE_LOADS_FLOOR = 16
# COPY: 8 loads of 16 bytes per thread per iteration before it stores (2 before).
COPY_LOADS_FLOOR = 8


@pytest.mark.parametrize("sources", LOAD_SOURCES)
def test_program_reduce_keeps_every_source_in_flight_before_folding(ptx, sources: int) -> None:
    name = "program-SUM-float32" + ("" if sources == LOAD_SOURCES[-1] else f"-sources{sources}")
    loops = ptx[f"{name}-sm90-loops"]
    # float32 sources load as ld.global.v4.b32; the REDUCE body is the loop with the most of them.
    loads, interleaved = max(loops)
    assert loads >= REDUCE_LOADS_FLOOR, loops
    assert interleaved == 0, loops  # no fold or store until every load of the iteration is issued


def test_program_copy_keeps_several_loads_in_flight_before_storing(ptx) -> None:
    # The COPY body moves int64 units here: ld.global.v2.b64. Its loop is the only one with a
    # number of loads other than the REDUCE's.
    loops = [loop for loop in ptx["program-SUM-float32-sm90-loops"] if 0 < loop[0] < REDUCE_LOADS_FLOOR]
    assert loops and all(loads >= COPY_LOADS_FLOOR and interleaved == 0 for loads, interleaved in loops), loops


# The 32-bit products the program kernel widens into an address: offsets in the flag area (a flag,
# an identity slot, an error record: channel, rank and lane indices under the flag area's size).
# Every data offset is computed in 64 bits: positions, sizes and epochs come from int64 tables.
FLAG_AREA_PRODUCTS = {"at_peers", "mine", "slots", "ids_at_peers", "ids_mine", "rec"}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", ["program-SUM-float32", "program-SUM-float32-int32"])
def test_program_data_offsets_are_computed_in_64_bits(ptx, arch: int, name: str) -> None:
    _instructions(ptx, f"{name}-sm{arch}")
    narrow = ptx[f"{name}-sm{arch}-narrow"]
    assert set(narrow) <= FLAG_AREA_PRODUCTS, narrow


# multimem's: its signal pad's word (block x 8 bytes) and error record (block x 64 bytes); its units'
# addresses are 64-bit (multimem.py's _unit_address).
MULTIMEM_BOUNDED_PRODUCTS = {"pad", "own_word", "rec"}


@pytest.mark.parametrize("name", ["multimem-SUM-bfloat16", "multimem-SUM-bfloat16-int32"])
def test_multimem_data_offsets_are_computed_in_64_bits(ptx, name: str) -> None:
    _instructions(ptx, f"{name}-sm90")  # sm_90 only: multimem needs it
    narrow = ptx[f"{name}-sm90-narrow"]
    assert set(narrow) <= MULTIMEM_BOUNDED_PRODUCTS, narrow


# Measured on the sm_90 PTX (Triton 3.9), float32 SUM program kernel, ALIGNED, int64 units: the
# carried copies' loops moved one 8-byte word per owned offset, both copies' lanes in every
# iteration: 32 single loads and 48 div.s64 a thread per iteration, 255 registers and 496 bytes
# spilled (ptxas 13.4 -v, sm_90a). One owned offset per 16-byte vector, each copy in a loop of its
# own: 8 vector loads and 8 div.s64, 44 bytes spilled. The floor is that count.
CARRY_VECTORS_FLOOR = 8


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", ["program-SUM-float32", "program-SUM-float32-bytes1"])
def test_program_carried_copies_move_16_byte_vectors(ptx, arch: int, name: str) -> None:
    """The carried copies (kernels/triton/carry.py) of an ALIGNED launch load 16-byte vectors (as
    int64 pairs, whatever the copies' unit), at most one owned offset's division each, never single
    words: on a GPU the loop is otherwise bound by its 64-bit divisions, not by memory. (In one-byte
    units the vectors' elements and offsets filled the registers: 41856 bytes spilled, sm_90a.)"""
    loops = ptx[f"{name}-sm{arch}-carry"]
    # The carries' loops issue a step's loads, the floor or more; the loops that merely inline a
    # copy's last bytes, short of a vector (a load or two), are not theirs.
    carriers = [loop for loop in loops if loop[0] + loop[1] >= CARRY_VECTORS_FLOOR]
    assert carriers, loops
    for vectors, singles, divisions in carriers:
        assert singles == 0 and divisions <= vectors, loops


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    print(json.dumps(_worker()))
