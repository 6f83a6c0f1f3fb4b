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

ARCHS = (80, 90)
DTYPES = ("float32", "float16", "bfloat16", "float64", "int32", "int64")
OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AVG")
# Memory instructions and divisions, e.g. "atom.global.sys.release.exch.b64", "div.rn.f32".
_INSTRUCTION = re.compile(r"\b(?:atom|red|st|ld|fence|membar|div|bar)\.[\w.]+")


def _variants() -> dict[str, tuple]:
    """name -> (kernel, signature, constexprs, attrs)."""
    import triton.language as tl

    from gpucomm._kernels.triton import copy, flags, reduce

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
                    "OP": getattr(reduce, f"OP_{op}"),
                    "K": 3,
                    "ALIGNED": True,
                    "BLOCK": 1024,
                },
                divisible,
            )
    from gpucomm._kernels.triton import program

    program_signature = {
        "prog_ptr": "*i64", "n_instr": "i64", "opnd_ptr": "*i64", "peers_ptr": "*i64", "state_addr": "i64",
        "record_addr": "i64", "rank": "i32", "world": "i32", "fingerprint": "i64", "half_bytes": "i64",
        "granule": "i64", "timeout_ns": "i64",
    }
    program_variants = [(dtype, "SUM") for dtype in DTYPES] + [("float32", op) for op in ("PRODUCT", "MIN", "MAX")]
    program_variants.append(("bfloat16", "MIN"))
    for dtype, op in program_variants:
        constexprs = {
            "DTYPE": getattr(tl, dtype), "OP": getattr(reduce, f"OP_{op}"), "COPY_ELEM": tl.int64, "COPY_BYTES": 8,
            "ELEM_BYTES": {"float16": 2, "bfloat16": 2, "float64": 8, "int64": 8}.get(dtype, 4), "ALIGNED": True,
            "PEERS": 16, "BLOCK": 1024,
        }
        signature = {**program_signature, **{name: "constexpr" for name in constexprs}}
        variants[f"program-{op}-{dtype}"] = (program.program_kernel, signature, constexprs, {})
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
                compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32))
            except Exception as exc:  # reported per variant, so one failure does not hide others
                report[f"{name}-sm{arch}"] = f"{type(exc).__name__}: {exc}"
                continue
            ptx = compiled.asm["ptx"]
            markers = ["%globaltimer"] if "%globaltimer" in ptx else []
            report[f"{name}-sm{arch}"] = sorted(set(_INSTRUCTION.findall(ptx))) + markers
    return report


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


def _has(instructions: list[str], opcode: str, *qualifiers: str) -> bool:
    """Some instruction is ``opcode`` with all ``qualifiers`` (their order varies across versions)."""
    return any(i.split(".")[0] == opcode and set(qualifiers) <= set(i.split(".")) for i in instructions)


@pytest.mark.parametrize("arch", ARCHS)
def test_signal_is_a_release_at_system_scope(ptx, arch: int) -> None:
    seen = _instructions(ptx, f"signal-sm{arch}")
    # triton 3.9 emits atom.global.sys.release.exch.b64
    assert _has(seen, "atom", "sys", "release", "exch"), seen


@pytest.mark.parametrize("arch", ARCHS)
def test_wait_is_an_acquire_at_system_scope(ptx, arch: int) -> None:
    seen = _instructions(ptx, f"wait-sm{arch}")
    # triton 3.9 emits atom.global.sys.acquire.add.u64 (an atomic add of 0)
    assert _has(seen, "atom", "sys", "acquire"), seen


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", ("reduce-AVG-float32-divisor1", "signal-epoch1", "wait-epoch1"))
def test_kernels_compile_with_arguments_specialised_to_one(ptx, arch: int, name: str) -> None:
    _instructions(ptx, f"{name}-sm{arch}")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("aligned", (0, 1))
def test_copy_compiles_and_vectorises_aligned_addresses(ptx, arch: int, aligned: int) -> None:
    seen = _instructions(ptx, f"copy-aligned{aligned}-sm{arch}")
    # 16-byte accesses: ld.global.v2.b64 / st.global.v2.b64 for the int64 elements here.
    vector = _has(seen, "ld", "global", "v2") and _has(seen, "st", "global", "v2")
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
@pytest.mark.parametrize("variant", ["SUM-float32", "SUM-bfloat16", "SUM-float64", "SUM-int64", "MIN-bfloat16", "MAX-float32"])
def test_program_kernel_compiles_with_system_scope_flags_a_clock_and_vectors(ptx, arch: int, variant: str) -> None:
    seen = _instructions(ptx, f"program-{variant}-sm{arch}")
    assert _has(seen, "atom", "release", "sys", "exch"), seen  # SYNC's signal
    assert _has(seen, "atom", "acquire", "sys", "add"), seen  # SYNC's wait
    assert "%globaltimer" in seen, seen  # the deadline of every wait
    assert _has(seen, "bar", "sync"), seen  # the channel's threads line up around SYNC and moves
    assert any(i.startswith(("ld.global.v", "ld.global.nc.v")) for i in seen), seen  # 16-byte vectors
    if variant.endswith("float32"):
        # AVG's division is the IEEE one (the program's integer divisions are its own arithmetic).
        divisions = [i for i in seen if i.startswith("div.") and i.endswith("f32")]
        assert divisions == ["div.rn.f32"], seen


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("op", ["SUM", "PRODUCT", "MIN", "MAX"])
def test_program_kernel_compiles_every_fold(ptx, arch: int, op: str) -> None:
    _instructions(ptx, f"program-{op}-float32-sm{arch}")


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    print(json.dumps(_worker()))
