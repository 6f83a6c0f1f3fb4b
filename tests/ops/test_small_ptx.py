"""The small-message all_reduce reaches a peer's data after at most one global load, in the sm_90
PTX of both its kernels (Triton's kernels/triton/small.py, CUDA C++'s kernels/cuda/small.cu),
where the program kernel waits for three (the instruction row, the operand, the peer's base).

The counting is tests/support/ptx_chains.py's: register def-use chains from each ``ld.param`` to every
load of a peer's data. Triton compiles ahead of time in a subprocess started without
TRITON_INTERPRET (this file run as a script, as tests/ops/test_triton_aot.py does); nvcc makes the
CUDA C++ kernels' PTX with the options the run-time loader gives NVRTC.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "support"))

import ptx_chains  # noqa: E402
from cuda_tools import run, tool  # noqa: E402

ARCH = 90
# The small kernels' parameters: x, n, stage0..7 (the peers' halves), flags0..7 (their flag areas).
_SMALL_PEER_PARAMS = set(range(2, 18))
# The program kernels' peer table: prog, n_instr, operands, peers (both kernels' fourth parameter).
_PROGRAM_PEER_TABLES = {3}
# Of the program kernel: the instruction row, its operand, the peer's base address.
_PROGRAM_CHAIN = 3


def _small_variants() -> dict[str, tuple]:
    import triton.language as tl

    from gpucomm._kernels.triton import small

    signature = {
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
        "ident_word": "i32",
        "ident0": "i64",
        "ident1": "i64",
    }
    variants = {}
    for world in (2, 8):
        for dtype, elem in (("float32", 4), ("bfloat16", 2), ("int32", 4)):
            for op, value in (("SUM", 0), ("AVG", 4)):
                lanes = 32 * small.NUM_WARPS
                constexprs = {
                    "DTYPE": getattr(tl, dtype),
                    "OP": value,
                    "COPY": {4: tl.int32, 2: tl.int16}[elem],
                    "ELEM": elem,
                    "ALIGNED": True,
                    "WORLD": world,
                    "BLOCK": lanes * 16 // elem,
                    "LANES": lanes,
                }
                sig = {**signature, **{name: "constexpr" for name in constexprs}}
                variants[f"small-{op}-{dtype}-world{world}"] = (
                    small.small_kernel,
                    sig,
                    constexprs,
                    {"num_warps": small.NUM_WARPS},
                )
    return variants


def _program_variant() -> tuple:
    import triton.language as tl

    from gpucomm._kernels.triton import program

    signature = {
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
        "ident_word": "i32",
        "ident0": "i64",
        "ident1": "i64",
    }
    constexprs = {
        "DTYPE": tl.float32,
        "OP": 0,
        "COPY_ELEM": tl.int64,
        "COPY_BYTES": 8,
        "ELEM_BYTES": 4,
        "ALIGNED": True,
        "SOURCES": 8,
        "LANES": 32 * program.NUM_WARPS,
    }
    sig = {**signature, **{name: "constexpr" for name in constexprs}}
    return program.program_kernel, sig, constexprs, {"num_warps": program.NUM_WARPS, "maxnreg": program.MAX_REGISTERS}


def _worker() -> dict[str, str]:
    """Every variant compiled for sm_90: name -> its PTX (or the error)."""
    import triton
    from triton.backends.compiler import GPUTarget

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("test_small_ptx worker: run without TRITON_INTERPRET")
    variants = {**_small_variants(), "program-SUM-float32": _program_variant()}
    report = {}
    for name, (kernel, signature, constexprs, options) in variants.items():
        source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs={})
        compiled = triton.compile(source, target=GPUTarget("cuda", ARCH, 32), options=options)
        report[name] = compiled.asm["ptx"]
    return report


@pytest.fixture(scope="module")
def triton_ptx() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # silences triton 3.9's warning; fusion is its default
    proc = subprocess.run([sys.executable, __file__, "--worker"], env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"PTX worker failed (exit {proc.returncode}):\n{proc.stderr[-8000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cuda_ptx(tmp_path_factory) -> dict[str, str]:
    """small.cu and program.cu compiled to sm_90 PTX by nvcc with the loader's options."""
    from gpucomm.ops.cuda_ops import HEADER, THREADS, compile_options, kernel_source

    root = tmp_path_factory.mktemp("small_ptx")
    (root / HEADER).write_text(kernel_source(HEADER))
    found = {}
    for file in ("small.cu", "program.cu"):
        (root / file).write_text(kernel_source(file))
        out = root / f"{file}.ptx"
        run(
            [
                tool("nvcc"),
                *compile_options(f"sm_{ARCH}", {"GPUCOMM_THREADS": THREADS}),
                "-ptx",
                "-o",
                str(out),
                str(root / file),
            ]
        )
        found[file] = out.read_text()
    return found


def _triton_entry(ptx: str) -> str:
    return ptx_chains._ENTRY.findall(ptx)[0]


def test_triton_small_kernel_reads_peers_after_one_load(triton_ptx) -> None:
    variants = [name for name in triton_ptx if name.startswith("small-")]
    assert len(variants) == 12, variants
    for name in variants:
        ptx = triton_ptx[name]
        depths = ptx_chains.peer_load_depths(ptx, _triton_entry(ptx), _SMALL_PEER_PARAMS)
        world = int(name.rsplit("world", 1)[1])
        # Every rank's staged share is read (the body's vectors and the tail's), each after at
        # most the one load of the channel's epoch.
        assert len(depths) >= world, (name, depths)
        assert max(depths) <= 1, (name, depths)


def test_cuda_small_kernels_read_peers_after_one_load(cuda_ptx) -> None:
    from gpucomm.ops.contract import SUPPORTED_DTYPES
    from gpucomm.ops.cuda_ops import SMALL_OPS, small_kernel_name

    ptx = cuda_ptx["small.cu"]
    names = [small_kernel_name(dtype, op) for op in SMALL_OPS for dtype in SUPPORTED_DTYPES]
    assert sorted(names) == sorted(ptx_chains._ENTRY.findall(ptx))
    for name in names:
        depths = ptx_chains.peer_load_depths(ptx, name, _SMALL_PEER_PARAMS)
        assert depths and max(depths) <= 1, (name, depths)


def test_the_count_sees_the_program_kernels_chain(triton_ptx, cuda_ptx) -> None:
    # The same counting on the program kernel finds its three loads in series before every read
    # of a peer's data, in both implementations: the helper follows tables, not only parameters.
    ptx = triton_ptx["program-SUM-float32"]
    depths = ptx_chains.peer_load_depths(ptx, _triton_entry(ptx), set(), _PROGRAM_PEER_TABLES)
    assert depths and min(depths) >= _PROGRAM_CHAIN > 1, depths
    for name in ("gpucomm_program_sum_float32", "gpucomm_program_min_bfloat16"):
        depths = ptx_chains.peer_load_depths(cuda_ptx["program.cu"], name, set(), _PROGRAM_PEER_TABLES)
        assert depths and min(depths) >= _PROGRAM_CHAIN > 1, (name, depths)


def test_chains_through_registers_shared_memory_and_loops() -> None:
    # A hand-written entry: an index loaded from an instruction table (1 load), the peer's base
    # loaded from the peer table at that index (2), kept in shared memory and read back, then the
    # peer's data (a peer load 2 loads deep). A flag's acquire load is not data. A loop that
    # chases its own pointer stops at the cap.
    ptx = """
    .visible .entry k(.param .u64 k_param_0, .param .u64 k_param_1, .param .u64 k_param_2)
    {
        ld.param.u64 %rd1, [k_param_0];
        ld.param.u64 %rd10, [k_param_1];
        ld.param.u64 %rd9, [k_param_2];
        ld.global.u64 %rd2, [%rd1];
        mad.lo.s64 %rd3, %rd2, 8, %rd10;
        ld.global.u64 %rd4, [%rd3];
        st.shared.u64 [%r1], %rd4;
        ld.shared.u64 %rd5, [%r1];
        ld.global.cg.f32 %f1, [%rd5];
        ld.acquire.sys.global.u64 %rd7, [%rd9];
        ld.global.f32 %f2, [%rd9+16];
        mov.u64 %rd8, %rd9;
    $L__loop:
        ld.global.u64 %rd8, [%rd8];
        @%p1 bra $L__loop;
        ret;
    }
    """
    assert ptx_chains.peer_load_depths(ptx, "k", set(), {1}) == [2]
    # Parameter 2 a peer's address: its data 0 loads deep, the chase at the cap.
    assert ptx_chains.peer_load_depths(ptx, "k", {2}) == [0, ptx_chains.DEPTH_CAP]


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    print(json.dumps(_worker()))
