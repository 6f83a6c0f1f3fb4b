"""The CUDA C++ kernels compile for sm_80 and sm_90 and contain the instructions the protocol needs.

No GPU here: each shipped ``.cu`` file is compiled by nvcc with exactly the options the run-time
loader hands NVRTC (``compile_options``), from the text the package ships (``kernel_source``),
into a fatbin holding SASS and PTX; cuobjdump then reads both back.

nvcc and cuobjdump are required (CI has them): tests/support/cuda_tools.py finds them, compiles each file
once per session (shared with the launch tests) and says what a missing tool does.
"""

from __future__ import annotations

import importlib.resources
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from cuda_tools import run, tool

from gpucomm.errors import UnsupportedError
from gpucomm.ops.contract import SUPPORTED_DTYPES
from gpucomm.ops.cuda_ops import (
    HEADER,
    KERNEL_PACKAGE,
    PROGRAM_FOLDS,
    SMALL_OPS,
    SOURCES,
    CudaKernels,
    compile_options,
    kernel_source,
    program_kernel_name,
    reduce_kernel_name,
    small_kernel_name,
)
from gpucomm.ops.cuda_params import check_program
from gpucomm.ops.cuda_source import target
from gpucomm.ops.instruction_set import cuda_defines
from gpucomm.ops.launch_args import ProgramArgs
from gpucomm.reduce_op import ReduceOp

ARCHS = (80, 90)


def _split_ptx(ptx: str) -> dict[str, str]:
    """PTX body of every kernel, by name."""
    parts = re.split(r"\.entry\s+(\w+)\s*\(", ptx)
    return dict(zip(parts[1::2], parts[2::2]))


def _split_sass(sass: str) -> dict[str, list[tuple[int, str]]]:
    """The instructions (address, text before ';') of every kernel, by name."""
    functions: dict[str, list[tuple[int, str]]] = {}
    current: list[tuple[int, str]] = []
    for line in sass.splitlines():
        header = re.match(r"\s*Function\s*:\s*(\w+)", line)
        if header:
            current = functions.setdefault(header.group(1), [])
            continue
        instruction = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+([^;]+?)\s*;", line)
        if instruction:
            current.append((int(instruction.group(1), 16), instruction.group(2)))
    return functions


class Compiled:
    def __init__(self, ptx: dict[str, str], sass: dict[str, list[tuple[int, str]]]) -> None:
        self.ptx = ptx
        self.sass = {name: [ins for _, ins in lines] for name, lines in sass.items()}
        self.sass_at = sass  # with each instruction's address, for branch targets


@pytest.fixture(scope="module")
def compiled(nvcc_fatbins) -> dict[tuple[str, int], Compiled]:
    """Every (file, arch) compiled once, as the loader would have NVRTC compile it."""
    cuobjdump = tool("cuobjdump")

    def build(file: str, arch: int) -> Compiled:
        fatbin = nvcc_fatbins.fatbin(file, arch)
        return Compiled(
            _split_ptx(run([cuobjdump, "-ptx", str(fatbin)])),
            _split_sass(run([cuobjdump, "-sass", str(fatbin)])),
        )

    # nvcc spends much of its time in subprocesses and file I/O: two at a time halves the wait.
    jobs = [(file, arch) for file in SOURCES for arch in ARCHS]
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(jobs, pool.map(lambda job: build(*job), jobs)))


EXPECTED_KERNELS = {
    "copy.cu": {"gpucomm_copy"},
    "flags.cu": {"gpucomm_signal", "gpucomm_wait"},
    "reduce.cu": {reduce_kernel_name(dtype, op) for dtype in SUPPORTED_DTYPES for op in ReduceOp},
    "program.cu": {program_kernel_name(None, ReduceOp.SUM)}
    | {program_kernel_name(dtype, op) for dtype in SUPPORTED_DTYPES for op in PROGRAM_FOLDS},
    "small.cu": {small_kernel_name(dtype, op) for dtype in SUPPORTED_DTYPES for op in SMALL_OPS},
}
PROGRAM_KERNELS = sorted(EXPECTED_KERNELS["program.cu"])
SMALL_KERNELS = sorted(EXPECTED_KERNELS["small.cu"])


def test_every_shipped_source_is_compiled_here() -> None:
    shipped = {p.name for p in importlib.resources.files(KERNEL_PACKAGE).iterdir() if p.name.endswith(".cu")}
    assert shipped == set(SOURCES) == set(EXPECTED_KERNELS)


def test_sources_include_only_common_cuh() -> None:
    # NVRTC is handed common.cuh and finds no other header: no host standard library, and not
    # cuda_fp16.h or cuda_bf16.h either without the toolkit's include directory (NVRTC 13.5).
    allowed = {'"common.cuh"'}
    for file in (*SOURCES, HEADER):
        includes = set(re.findall(r"^\s*#\s*include\s+(\S+)", kernel_source(file), flags=re.MULTILINE))
        assert includes <= allowed, f"{file} includes {sorted(includes - allowed)}"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("file", SOURCES)
def test_exports_the_kernels_the_loader_launches(compiled, file: str, arch: int) -> None:
    result = compiled[file, arch]
    assert set(result.ptx) == EXPECTED_KERNELS[file]
    assert set(result.sass) == EXPECTED_KERNELS[file]


@pytest.mark.parametrize("arch", ARCHS)
def test_signal_stores_with_release_at_system_scope(compiled, arch: int) -> None:
    result = compiled["flags.cu", arch]
    assert "st.release.sys.global.b64" in result.ptx["gpucomm_signal"]
    sass = result.sass["gpucomm_signal"]
    # ptxas lowers st.release.sys to a system-wide fence followed by a strong system-scope store.
    stores = [i for i, ins in enumerate(sass) if ins.startswith("STG.E.64.STRONG.SYS ")]
    assert len(stores) == 1, sass
    assert "MEMBAR.ALL.SYS" in sass[: stores[0]], sass
    # __threadfence_system(): earlier kernels' writes become visible before any flag changes.
    assert "MEMBAR.SC.SYS" in sass[: stores[0]], sass


@pytest.mark.parametrize("arch", ARCHS)
def test_signal_fences_at_system_scope_before_it_releases(compiled, arch: int) -> None:
    """The memory contract's signal, in the PTX both families are checked in (docs/kernel-contract.md;
    tests/ops/test_triton_aot.py checks Triton's): membar.sys, then the release stores."""
    ptx = compiled["flags.cu", arch].ptx["gpucomm_signal"]
    order = re.findall(r"\b(?:membar|fence|st\.release|atom)\.[\w.]+|\bst\.release\b", ptx)
    releases = [i for i, op in enumerate(order) if op.startswith("st.release.sys")]
    assert "membar.sys" in order and releases and order.index("membar.sys") < releases[0], order


@pytest.mark.parametrize("arch", ARCHS)
def test_peer_data_loads_are_cg(compiled, arch: int) -> None:
    """The memory contract's loads (docs/kernel-contract.md; Triton's in tests/ops/test_triton_aot.py):
    data that may be a peer's is loaded ``.cg``, L2 only; the plain loads left are of the kernel's
    own tables (addresses, instruction words: 8 bytes, or 4 for the program's counts)."""
    kernels = [("copy.cu", "gpucomm_copy")] + [("reduce.cu", name) for name in EXPECTED_KERNELS["reduce.cu"]]
    kernels += [("program.cu", name) for name in PROGRAM_KERNELS] + [("small.cu", name) for name in SMALL_KERNELS]
    for file, name in kernels:
        loads = set(re.findall(r"\bld\.global(?:\.\w+)+", compiled[file, arch].ptx[name]))
        assert any(".cg." in load for load in loads), (name, loads)
        assert {load for load in loads if ".cg." not in load} <= {"ld.global.u64", "ld.global.u32"}, (name, loads)


def _sync_events(ptx: str) -> list[str]:
    """A kernel's barriers, fences, flag accesses, data stores and data loads in PTX order, each
    one word: barrier, fence, release, acquire, store, load (plain), load.cg."""
    events = []
    for op in re.findall(r"\b(?:bar|barrier|fence|membar|st|ld|atom|red)\.[\w.]+", ptx):
        parts = op.split(".")
        if parts[0] in ("bar", "barrier"):
            events.append("barrier")
        elif parts[0] in ("fence", "membar"):
            events.append("fence")
        elif "release" in parts or "acquire" in parts:
            events += [kind for kind in ("release", "acquire") if kind in parts and "sys" in parts]
        elif parts[0] == "st" and "global" in parts:
            events.append("store")
        elif parts[0] == "ld" and "global" in parts:
            events.append("load.cg" if "cg" in parts else "load")
    return events


@pytest.mark.parametrize("arch", ARCHS)
def test_sync_releases_after_a_block_barrier_and_fences_nothing(compiled, arch: int) -> None:
    """The memory contract's SYNC (docs/kernel-contract.md), the same in the small kernels as in the
    program kernels (tests/ops/test_triton_aot.py checks Triton's): the kernel signals data its own
    block wrote, so a block barrier, then the release stores, with no system-scope fence (that is
    gpucomm_signal's, whose data earlier kernels wrote, and a fenced SYNC's); the acquire polls, then
    a block barrier before any data is loaded."""
    for file, name in [("small.cu", name) for name in SMALL_KERNELS] + [
        ("program.cu", name) for name in PROGRAM_KERNELS
    ]:
        events = _sync_events(compiled[file, arch].ptx[name])
        # The program kernels' one fence is a fenced SYNC's (checked below); the small kernels have none.
        assert events.count("fence") == (1 if file == "program.cu" else 0), (name, events)
        # Between the block's last data store and the first release (the SYNC's signal), a barrier.
        before = [event for event in events[: events.index("release")] if event in ("store", "barrier")]
        assert before and before[-1] == "barrier", (name, events)
        acquired = False
        for event in events:
            if event == "acquire":
                acquired = True
            elif event == "barrier":
                acquired = False
            elif event == "load.cg":
                assert not acquired, (name, events)  # a load of data between the polls and the barrier


@pytest.mark.parametrize("arch", ARCHS)
def test_fenced_sync_fences_at_system_scope_before_it_releases(compiled, arch: int) -> None:
    """A SYNC with the fence word (the first SYNC of two-shot-symmetric and of the other in-place
    symmetric programs, whose data earlier kernels wrote) runs ``__threadfence_system()``
    (``membar.sys``) before its release stores, as gpucomm_signal (tests/ops/test_triton_aot.py
    checks Triton's; tests/workspace/test_sync_fences.py which SYNCs carry the word)."""
    for name in PROGRAM_KERNELS:
        ptx = compiled["program.cu", arch].ptx[name]
        order = re.findall(r"\b(?:membar|fence|st\.release|atom)\.[\w.]+|\bst\.release\b", ptx)
        releases = [i for i, op in enumerate(order) if op.startswith("st.release.sys")]
        assert order.count("membar.sys") == 1 and releases and order.index("membar.sys") < releases[0], (name, order)


@pytest.mark.parametrize("arch", ARCHS)
def test_program_kernels_release_flags_at_system_scope(compiled, arch: int) -> None:
    # A SYNC's signal, the error record's kind and the poison word: release stores at system
    # scope, each lowered to a system-wide fence and a strong system-scope store.
    for file, name in [("program.cu", name) for name in PROGRAM_KERNELS] + [
        ("small.cu", name) for name in SMALL_KERNELS
    ]:
        ptx = compiled[file, arch].ptx[name]
        assert ptx.count("st.release.sys.global.b64") >= 3, name  # signal, record kind, poison
        sass = compiled[file, arch].sass[name]
        stores = [i for i, ins in enumerate(sass) if ins.startswith("STG.E.64.STRONG.SYS ")]
        assert stores, (name, sass)
        for i in stores:
            fence = max((j for j in range(i) if sass[j].startswith("MEMBAR")), default=None)
            assert fence is not None and sass[fence] == "MEMBAR.ALL.SYS", (name, sass[: i + 1])


@pytest.mark.parametrize("arch", ARCHS)
def test_waits_load_with_acquire_at_system_scope_and_a_deadline(compiled, arch: int) -> None:
    waiting = [("flags.cu", "gpucomm_wait")] + [("program.cu", name) for name in PROGRAM_KERNELS]
    waiting += [("small.cu", name) for name in SMALL_KERNELS]
    for file, name in waiting:
        ptx = compiled[file, arch].ptx[name]
        assert "ld.acquire.sys.global.b64" in ptx, name
        assert "%globaltimer" in ptx, name
        sass = compiled[file, arch].sass[name]
        # ld.acquire.sys becomes a strong system-scope load followed by an L1 invalidation
        # (scheduled a few instructions later on sm_80) before any other load, so that later
        # loads of peer data cannot hit stale L1 lines.
        loads = [i for i, ins in enumerate(sass) if ins.startswith("LDG.E.64.STRONG.SYS ")]
        assert loads, (name, sass)
        for i in loads:
            following = sass[i + 1 :]
            next_load = next(
                (j for j, ins in enumerate(following) if re.match(r"(@!?P\d+\s+)?LDG?\.", ins)), len(following)
            )
            assert "CCTL.IVALL" in following[:next_load], (name, sass[i:])
        assert any("SR_GLOBALTIMER" in ins for ins in sass), name


@pytest.mark.parametrize("arch", ARCHS)
def test_reduces_contract_no_multiply_add(compiled, arch: int) -> None:
    # A fused multiply-add would round once where torch rounds twice. AVG's division is excluded:
    # IEEE division itself is computed with FMAs and is correctly rounded.
    for name, sass in compiled["reduce.cu", arch].sass.items():
        if "_avg_" in name:
            continue
        fmas = [ins for ins in sass if re.match(r"(@!?P\d+\s+)?(FFMA|DFMA)\b", ins)]
        assert not fmas, (name, fmas)


# Float arithmetic in PTX: add.rn.f32, mul.f64, fma.rn.f32, div.rn.f32, ...
_FLOAT_ARITHMETIC = re.compile(r"\b(add|sub|mul|fma|mad|div)((?:\.\w+)*)\.f(?:32|64)\b")


@pytest.mark.parametrize("arch", ARCHS)
def test_program_reduces_round_every_step(compiled, arch: int) -> None:
    # Every program kernel honours a REDUCE's divide flag, so its SASS holds the FMAs of IEEE
    # division whatever its fold; the check is on the PTX instead. ptxas may fuse a mul and an
    # add into an FMA only when neither names its rounding (PTX ISA, "add"/"mul"), so: no
    # fma/mad at all, every add/sub/mul with .rn, every division IEEE (div.rn).
    for name in PROGRAM_KERNELS:
        found = _FLOAT_ARITHMETIC.findall(compiled["program.cu", arch].ptx[name])
        unrounded = sorted({op + mods for op, mods in found if op in ("fma", "mad") or ".rn" not in mods})
        assert not unrounded, (name, unrounded)
        folds_floats = any(f"_{dtype}" in name for dtype in ("float32", "float64", "float16", "bfloat16"))
        assert any(op == "div" for op, _ in found) == folds_floats, (name, found[:5])
        if name.startswith("gpucomm_program_sum_") and folds_floats:
            assert ("add", ".rn") in found, name


@pytest.mark.parametrize("arch", ARCHS)
def test_bulk_paths_move_16_byte_vectors(compiled, arch: int) -> None:
    kernels = [("copy.cu", "gpucomm_copy")] + [("reduce.cu", name) for name in EXPECTED_KERNELS["reduce.cu"]]
    kernels += [("program.cu", name) for name in PROGRAM_KERNELS]
    for file, name in kernels:
        sass = compiled[file, arch].sass[name]
        assert any(ins.startswith("LDG.E.128") for ins in sass), name
        assert any(ins.startswith("STG.E.128") for ins in sass), name


def _loop_bodies(sass: list[tuple[int, str]]) -> list[list[str]]:
    """The instructions of every loop of a kernel's SASS, each without those of the loops nested
    in it: what one iteration of that loop issues. A loop is a branch back to an address above."""
    index = {address: i for i, (address, _) in enumerate(sass)}
    spans = []
    for i, (address, ins) in enumerate(sass):
        target = re.search(r"\bBRA\s+0x([0-9a-f]+)", ins)
        if target and int(target.group(1), 16) <= address and int(target.group(1), 16) in index:
            spans.append((index[int(target.group(1), 16)], i))
    bodies = []
    for lo, hi in spans:
        nested = [(a, b) for a, b in spans if lo <= a and b <= hi and (a, b) != (lo, hi)]
        bodies.append([sass[i][1] for i in range(lo, hi + 1) if not any(a <= i <= b for a, b in nested)])
    return bodies


_VECTOR_LOAD = re.compile(r"(@!?P\d+\s+)?LDG\.E\.128\b")
_LOCAL = re.compile(r"(@!?P\d+\s+)?(LDL|STL)\b")

# Measured (nvcc 13.0, sm_80 and sm_90): the REDUCE body of every program kernel issues 16
# LDG.E.128 per iteration (2 vectors of each of up to 8 sources, predicated on the count), with
# no local-memory access in that loop; the earlier kernel, one vector per source, issued 8.
# The floor is that count.
PROGRAM_REDUCE_LOADS_FLOOR = 16


@pytest.mark.parametrize("arch", ARCHS)
def test_program_reduce_keeps_two_vectors_of_every_source_in_flight(compiled, arch: int) -> None:
    # A REDUCE of up to 8 sources loads 2 16-byte vectors of each before it folds any; its loop
    # is the one with the most vector loads. A spill inside it would put local-memory round trips
    # between the loads and the folds.
    for name in PROGRAM_KERNELS:
        if name == program_kernel_name(None, ReduceOp.SUM):
            continue
        sass = compiled["program.cu", arch].sass_at[name]
        body = max(_loop_bodies(sass), key=lambda lines: sum(bool(_VECTOR_LOAD.search(i)) for i in lines))
        loads = sum(bool(_VECTOR_LOAD.search(ins)) for ins in body)
        assert loads >= PROGRAM_REDUCE_LOADS_FLOOR, (name, loads)
        assert not [ins for ins in body if _LOCAL.search(ins)], name


_VECTOR_STORE = re.compile(r"(@!?P\d+\s+)?STG\.E\.128\b")


def _loads_before_first_store(body: list[str]) -> int:
    first_store = next((i for i, ins in enumerate(body) if _VECTOR_STORE.search(ins)), len(body))
    return sum(bool(_VECTOR_LOAD.search(ins)) for ins in body[:first_store])


# Measured (nvcc 13.0, sm_80 and sm_90): the 16-byte COPY loop of every program kernel and of
# gpucomm_copy issues 4 LDG.E.128 before its first STG.E.128 (common.cuh's copy_span,
# COPY_WORDS_IN_FLIGHT), with no local-memory access in that loop; the earlier kernels
# issued 1. The floor is that count.
#
# Spill stores/loads in bytes per kernel (ptxas -v), 1 vector -> 4 vectors a COPY
# step; program kernels by fold and dtype, gpucomm_program_copy as "copy":
#   sm_80  0/0 -> 0/0    gpucomm_copy; max, min float64 int32; prod, sum bfloat16 float16 float32 int32
#          0/0 -> 6/4    max, min bfloat16 float32; prod, sum float64
#          0/0 -> 8/8    copy
#          0/0 -> 14/16  max, min, prod, sum int64
#          14/16 -> 22/28  max, min float16
#   sm_90  0/0 -> 0/0    gpucomm_copy
#          16/12 -> 4/4  copy
#          18/20 -> 4/4  max, min float64
#          0/0 -> 6/4    max, min, prod, sum int32
#          0/0 -> 10/8   max, min bfloat16; max, min, prod, sum float32
#          10/8 -> 10/8  prod, sum bfloat16 float16
#          18/20 -> 10/8 prod, sum float64
#          0/0 -> 18/20  max, min, prod int64
#          18/20 -> 18/20  sum int64
#          38/52 -> 30/44  max, min float16
# With a REDUCE's carried copies (program.cu's Carry: the plan in shared memory, each thread's share
# count in a register) and a COPY of one move only (no paired COPY), per program kernel (nvcc 13.0
# with compile_options and -Xptxas -v): sm_80 60/76 int32, 64/88 max, min float32, 68/100 max, min
# bfloat16, 72/100 prod, sum float32, 76/112 prod, sum bfloat16, float16 and int64, 88/132 float64,
# copy 0/0; sm_90 76/112 int32 and float32, 80/124 16-bit floats and sum int64, 88/132 max, min, prod
# int64, 96/140 float64, copy 0/0. With the paired COPY still in, every kernel but sm_80's copy spilled
# 4-46 bytes more stores (sm_90: copy 46/48, prod, sum float64 120/416). With each carried range's
# first granule worked out once (Range's g0, start0, len) and no carried copy compiled into the
# copy-only kernel: sm_80 50/56 int64 but prod, 52/60 float64, 58/64 max, min bfloat16 and int32,
# prod int32 and int64, 58/72 prod, sum 16-bit and float32 and sum int32, 62/72 max, min float16,
# 66/80 max, min float32, copy 8/8; sm_90 52/64 int64, 56/72 sum int32, 60/72 prod, sum bfloat16,
# 60/80 max, min, prod int32, 64/80 max, min float16, 66/80 max, min float32, 72/88 prod, sum
# float16 and float32, 72/92 prod, sum float64, 72/104 max, min float64, 74/88 max, min bfloat16,
# copy 0/0.
# None of these is in a COPY or REDUCE loop (this test and the one above check): the spilled
# values are reloaded once per instruction or per granule.
COPY_LOADS_FLOOR = 4


@pytest.mark.parametrize("arch", ARCHS)
def test_copy_keeps_four_vectors_in_flight(compiled, arch: int) -> None:
    # A COPY step of a thread loads 4 16-byte vectors before it stores any. The COPY loop is the
    # one that stores every vector it loads (a REDUCE's stores fewer), with the
    # most loads before its first store; the words past the last whole step go one at a time.
    kernels = [("copy.cu", "gpucomm_copy")] + [("program.cu", name) for name in PROGRAM_KERNELS]
    for file, name in kernels:
        bodies = [
            body
            for body in _loop_bodies(compiled[file, arch].sass_at[name])
            if sum(bool(_VECTOR_LOAD.search(i)) for i in body) == sum(bool(_VECTOR_STORE.search(i)) for i in body) > 0
        ]
        assert bodies, name
        body = max(bodies, key=_loads_before_first_store)
        assert _loads_before_first_store(body) >= COPY_LOADS_FLOOR, (name, body)
        assert not [ins for ins in body if _LOCAL.search(ins)], name


# Measured (nvcc 13.0, sm_90, gpucomm_program_sum_float32): the carried copies' loop (program.cu's
# Carry::share, one unit of 16, 8, 4, 2 or 1 bytes an iteration, so the only loop that loads every
# width) called the 64-bit division routine 4 times a unit, 268 instructions an iteration: each
# unit worked out its range's first granule again. With it worked out once (Range's g0, start0,
# len), 1 call and 147 instructions.
CARRY_DIVISIONS_PER_UNIT = 1
_UNIT_LOADS = [re.compile(rf"\bLDG\.E\.{width}\b") for width in ("128", "U16", "U8")]


@pytest.mark.parametrize("arch", ARCHS)
def test_carried_copies_divide_once_a_unit(compiled, arch: int) -> None:
    for name in PROGRAM_KERNELS:
        if name == program_kernel_name(None, ReduceOp.SUM):
            continue  # the copy-only kernel runs no REDUCE, so no carried copy
        bodies = [
            body
            for body in _loop_bodies(compiled["program.cu", arch].sass_at[name])
            if all(any(load.search(ins) for ins in body) for load in _UNIT_LOADS)
        ]
        assert bodies, name
        for body in bodies:
            calls = sum(bool(re.search(r"\bCALL\b", ins)) for ins in body)
            assert calls <= CARRY_DIVISIONS_PER_UNIT, (name, calls)


def test_compile_options_pin_the_rounding() -> None:
    options = compile_options("sm_90", {"B": 2, "A": 1})
    assert options[:6] == (
        "-std=c++17",
        "--gpu-architecture=sm_90",
        "--fmad=false",
        "-ftz=false",
        "-prec-div=true",
        "-prec-sqrt=true",
    )
    # The instruction set first (gpucomm.ops.instruction_set: the sources refuse to compile
    # without it), then the caller's, sorted, so the memo key and the options agree.
    instruction_set = tuple(f"-D{name}={value}" for name, value in sorted(cuda_defines().items()))
    assert options[6:] == (*instruction_set, "-DA=1", "-DB=2")


def test_target_prefers_a_cubin_and_falls_back_to_older_ptx() -> None:
    assert target((9, 0), (80, 86, 90)) == ("sm_90", "cubin")
    assert target((12, 0), (80, 86, 90, 100)) == ("compute_100", "ptx")
    with pytest.raises(UnsupportedError, match="none at or below this device's sm_75"):
        target((7, 5), (80, 90))


def test_cpu_device_is_unsupported_with_the_reason() -> None:
    with pytest.raises(UnsupportedError, match=r"GPUCOMM_KERNELS=cuda needs a CUDA device .*got device cpu"):
        CudaKernels(torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA")
def test_cuda_device_without_cuda_is_unsupported_with_the_reason() -> None:
    with pytest.raises(UnsupportedError, match=r"torch\.cuda\.is_available\(\) is False"):
        CudaKernels(torch.device("cuda", 0))


def _program_args(**changes: object) -> dict:
    """Valid run_program arguments for 2 ranks (tables on the CPU, the kernels' device here)."""
    args = {
        "device": torch.device("cpu"),
        "instructions": torch.zeros(16, dtype=torch.int64),
        "operands": torch.zeros(6, dtype=torch.int64),
        "peers": torch.zeros(4, dtype=torch.int64),
        "state_addr": 4096,
        "record_addr": 8192,
        "channels": 2,
        "rank": 1,
        "world": 2,
        "fingerprint": (1 << 20) - 1,
        "half_bytes": 1 << 20,
        "granule": 16,
        "timeout_ns": 10**9,
        "dtype": torch.bfloat16,
        "op": int(ReduceOp.MAX),
        "copy_bytes": 8,
        "aligned": True,
    }
    args.update(changes)
    return args


def _check(**changes: object) -> str:
    """check_program on the arguments of _program_args with ``changes``."""
    args = _program_args(**changes)
    return check_program(args.pop("device"), ProgramArgs(**args))


def test_run_program_picks_the_kernel_of_the_dtype_and_fold() -> None:
    assert _check() == "gpucomm_program_max_bfloat16"
    assert _check(dtype=torch.int64, op=0) == "gpucomm_program_sum_int64"
    # No REDUCE in the program: the copy kernel, whatever op the executor passes.
    assert _check(dtype=None, op=0) == "gpucomm_program_copy"
    # Every name it can pick is one program.cu exports.
    names = {_check(dtype=d, op=int(op)) for d in SUPPORTED_DTYPES for op in PROGRAM_FOLDS}
    assert names | {"gpucomm_program_copy"} == EXPECTED_KERNELS["program.cu"]


@pytest.mark.parametrize(
    "changes, error, words",
    [
        ({"op": int(ReduceOp.AVG)}, ValueError, r"op must be a fold.*AVG programs fold as SUM.*got 4"),
        ({"dtype": torch.uint8}, TypeError, r"dtype must be None or one of .*got torch.uint8"),
        (
            {"world": 64, "peers": torch.zeros(128, dtype=torch.int64)},
            ValueError,
            r"world must be in \[1, 63\], got 64",
        ),
        ({"rank": 2}, ValueError, r"rank must be in \[0, 1\], got 2"),
        ({"rank": 1.0}, TypeError, r"rank must be an int, got float"),
        ({"fingerprint": 1 << 20}, ValueError, r"fingerprint must be in \[0, 1048575\]"),
        ({"identity": (1 << 48, 1)}, ValueError, r"identity\[0\] must be in \[0, 281474976710655\]"),
        ({"identity": (1,)}, ValueError, r"identity must be two words, got 1"),
        ({"channels": 0}, ValueError, r"channels must be in \[1, "),
        ({"granule": 0}, ValueError, r"granule must be in \[1, "),
        ({"timeout_ns": -1}, ValueError, r"timeout_ns must be in \[0, "),
        ({"record_addr": 0}, ValueError, r"record_addr must be in \[1, "),
        (
            {"instructions": torch.zeros(12, dtype=torch.int64)},
            ValueError,
            r"instructions must hold a positive multiple of 8 int64, got 12",
        ),
        (
            {"operands": torch.zeros(0, dtype=torch.int64)},
            ValueError,
            r"operands must hold a positive multiple of 3 int64, got 0",
        ),
        (
            {"operands": torch.zeros(6, dtype=torch.int32)},
            TypeError,
            r"operands must be an int64 tensor, got torch.int32",
        ),
        (
            {"instructions": torch.zeros(2, 8, dtype=torch.int64)},
            ValueError,
            r"instructions must be a contiguous 1-D tensor, got shape \(2, 8\)",
        ),
        ({"peers": torch.zeros(3, dtype=torch.int64)}, ValueError, r"peers must hold 2 \* world = 4 addresses, got 3"),
        ({"peers": [0, 0, 0, 0]}, TypeError, r"peers must be a torch.Tensor, got list"),
        ({"device": torch.device("cuda", 0)}, ValueError, r"instructions is on cpu, expected cuda:0"),
    ],
)
def test_run_program_rejects_bad_arguments_before_launching(changes: dict, error: type, words: str) -> None:
    with pytest.raises(error, match=r"CudaKernels\.run_program: " + words):
        _check(**changes)
