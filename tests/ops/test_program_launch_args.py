"""Every program kernel's launch, bound through gpucomm's launcher, hands the driver the parameters
its ``.entry`` declares (count, size, alignment of each; Triton's hidden scratch pointers
included) carrying the values the call meant. No GPU: the driver double (tests/support/cuda_double)
records the launch, and the PTX of the same compiled kernel says what it takes.

Triton: the program kernel compiled for sm_90 and sm_80 as its JIT dispatch specialises it
(``gpucomm.ops.triton_launch.compile_for``) and bound by ``HostOnlyTritonKernels`` (the GPU path's
binding, on the double), in one worker process started without TRITON_INTERPRET (this file run as
a script). Its constexprs (dtype, fold, copy width, alignment, sources) change the code, never the
parameter list; what changes the list is how Triton types the integer arguments by value (a value
that fits 32 bits is an i32, a value of 1 in a specialised argument is a constant and no
parameter at all). The cases cover each of those, at both archs.

CUDA C++: program.cu's kernels and gpucomm_copy compiled by nvcc as NVRTC compiles them
(tests/support/cuda_tools.py), bound by the packing ``CudaKernels`` uses (``program_params``,
``copy_params``); and ``CudaKernels``' own reduce, signal and wait launches, which reach the
driver through the launcher too, never CuPy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import cuda_double
import pytest
from cuda_kernels_double import OnTheGpu, RecordingCupy, cuda_kernels_on_the_double
from ptx_params import entry_params, mismatches, run_ptx

from gpucomm.ops.launch_args import ProgramArgs

ARCHS = (90, 80)
# (case, dtype, op, copy_bytes, aligned, world, overrides of the typical values below)
TRITON_CASES = {
    # A DDP job's fp32 gradients: typical values (the 120 s timeout does not fit 32 bits).
    "fp32-sum": ("float32", 0, 8, True, 2, {}),
    # bf16 gradients, one instruction (n_instr = 1 becomes a constant), a half of 4 GiB (an i64), a
    # 1 s timeout (an i32), 4 ranks.
    "bf16-sum-one-instruction": (
        "bfloat16",
        0,
        2,
        True,
        4,
        {"n_instr": 1, "half_bytes": 1 << 32, "timeout_ns": 10**9, "rank": 3},
    ),
    # A copy-only program (all_gather, broadcast) of unaligned bytes, 8 ranks, a 1 s timeout (an i32).
    "copy-unaligned": (None, 0, 1, False, 8, {"rank": 5, "all_channels": 8, "channels": 4, "timeout_ns": 10**9}),
}
# Values a 2-rank call has (addresses as a CPU's, sizes as gpucomm's defaults).
TYPICAL = {
    "n_instr": 3,
    "state_addr": 0x7F12_3456_0008,
    "record_addr": 0x7F12_3456_1000,
    "rank": 1,
    "fingerprint": 0xABCDE,
    "half_bytes": 1 << 20,
    "granule": 4096,
    "timeout_ns": 120 * 10**9,
    "all_channels": 4,
    "channels": 2,
    # The flag area's first identity slot, and a call's identity words (both >= 2**47: i64).
    "ident_word": 93,
    "ident0": (1 << 47) | (1 << 40) | 4096,
    "ident1": (1 << 47) | 0x1234_5678_9AB,
}


# -- Triton, in a worker without TRITON_INTERPRET ----------------------------------------------------
def _worker(double: str, log: str, broken: bool) -> dict:
    import torch
    from triton.backends.compiler import GPUTarget

    from gpucomm._kernels.triton import program
    from gpucomm.ops import triton_launch
    from gpucomm.ops.triton_ops import HostOnlyTritonKernels

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("test_program_launch_args worker: run without TRITON_INTERPRET")
    if broken:  # pack Triton's i32 parameters as 8 bytes: the check below must catch it
        triton_launch._SIZES["i32"] = 8
    cuda_double.log_to(double, log)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, None: None}
    # The kernel's runtime arguments in order, as it declares them (constexprs are not passed).
    params = [p for p in program.program_kernel.params if not p.is_constexpr]
    cases = {}
    stream = 0x100
    for arch in ARCHS:
        kernels = HostOnlyTritonKernels(GPUTarget("cuda", arch, 32), double)
        for case, (dtype, op, copy_bytes, aligned, world, overrides) in TRITON_CASES.items():
            if broken and (arch, case) != (90, "fp32-sum"):
                continue
            v = {**TYPICAL, **overrides}
            prog = torch.zeros(v["n_instr"] * program.WORDS, dtype=torch.int64)
            operands = torch.zeros(3 * 4, dtype=torch.int64)
            peers = torch.zeros(2 * world, dtype=torch.int64)
            bound = kernels.prepare_program(
                ProgramArgs(
                    prog,
                    operands,
                    peers,
                    v["state_addr"],
                    v["record_addr"],
                    channels=v["channels"],
                    rank=v["rank"],
                    world=world,
                    fingerprint=v["fingerprint"],
                    half_bytes=v["half_bytes"],
                    granule=v["granule"],
                    timeout_ns=v["timeout_ns"],
                    dtype=dtypes[dtype],
                    op=op,
                    copy_bytes=copy_bytes,
                    aligned=aligned,
                    all_channels=v["all_channels"],
                    ident_word=v["ident_word"],
                    identity=(v["ident0"], v["ident1"]),
                )
            )
            stream += 1
            bound.launch(stream)
            values = {
                "prog_ptr": prog.data_ptr(),
                "n_instr": v["n_instr"],
                "opnd_ptr": operands.data_ptr(),
                "peers_ptr": peers.data_ptr(),
                "state_addr": v["state_addr"],
                "record_addr": v["record_addr"],
                "rank": v["rank"],
                "world": world,
                "fingerprint": v["fingerprint"],
                "half_bytes": v["half_bytes"],
                "granule": v["granule"],
                "timeout_ns": v["timeout_ns"],
                "all_channels": v["all_channels"],
                "ident_word": v["ident_word"],
                "ident0": v["ident0"],
                "ident1": v["ident1"],
            }
            # Triton turns an integer argument equal to 1 into a constant, unless told not to specialise it.
            meant = [values[p.name] for p in params if not (values[p.name] == 1 and not p.do_not_specialize)]
            cases[f"{case}-sm{arch}"] = {
                "stream": stream,
                "layout": bound.layout,
                "meant": meant,
                "grid": v["channels"],
                "ptx": _ptx_of(kernels, arch, prog, operands, peers, v, world, dtypes[dtype], op, copy_bytes, aligned),
            }
    return cases


def _ptx_of(kernels, arch, prog, operands, peers, v, world, dtype, op, copy_bytes, aligned) -> str:  # noqa: ANN001
    """The PTX of the kernel the binding above compiled (the same specialisation, from the cache)."""

    from gpucomm._kernels.triton import program
    from gpucomm.ops import triton_launch

    grid, values, constexprs, options = program.arguments(
        ProgramArgs(
            prog,
            operands,
            peers,
            v["state_addr"],
            v["record_addr"],
            channels=v["channels"],
            rank=v["rank"],
            world=world,
            fingerprint=v["fingerprint"],
            half_bytes=v["half_bytes"],
            granule=v["granule"],
            timeout_ns=v["timeout_ns"],
            dtype=dtype,
            op=op,
            copy_bytes=copy_bytes,
            aligned=aligned,
            all_channels=v["all_channels"],
            ident_word=v["ident_word"],
            identity=(v["ident0"], v["ident1"]),
        )
    )
    return triton_launch.compile_for(program.program_kernel, kernels._target(), values, constexprs, options).asm["ptx"]


def _run_worker(tmp_path, broken: bool = False) -> tuple[dict, list]:
    double, log = cuda_double.build(), tmp_path / f"calls-{int(broken)}.log"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # silences triton 3.9's warning; fusion is its default
    cmd = [sys.executable, __file__, "--worker", double, str(log), "--broken" if broken else "--sound"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"worker failed (exit {proc.returncode}):\n{proc.stderr[-8000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), cuda_double.records(log, "cuLaunchKernel")


@pytest.fixture(scope="module")
def triton_bound(tmp_path_factory) -> tuple[dict, dict]:
    cases, launches = _run_worker(tmp_path_factory.mktemp("triton"))
    by_stream = {int(r["stream"], 16): r for r in launches}
    return cases, by_stream


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", TRITON_CASES)
def test_triton_program_launch_carries_the_parameters_its_entry_declares(triton_bound, case: str, arch: int) -> None:
    cases, by_stream = triton_bound
    bound = cases[f"{case}-sm{arch}"]
    launch = by_stream[bound["stream"]]
    declared = entry_params(bound["ptx"], "program_kernel")
    # The hidden scratch pointers Triton 3.9 appends (global, profile): null, as no scratch is used.
    meant = bound["meant"] + [0, 0]
    assert mismatches(declared, bound["layout"], bytes.fromhex(launch["params"]), meant) == []
    assert (launch["name"], launch["grid"], launch["block"], launch["form"]) == (
        "program_kernel",
        f"{bound['grid']},1,1",
        "256,1,1",
        "buffer",
    )
    assert (
        launch["loaded"] == "1"
    )  # loaded when its launch was bound, not by this launch (tests/ops/test_kernel_load.py)


def test_the_cases_cover_each_way_triton_types_the_parameters(triton_bound) -> None:
    """The value classes above give distinct parameter lists: else one case would do."""
    cases, _ = triton_bound
    lists = {json.dumps(entry_params(c["ptx"], "program_kernel")) for c in cases.values()}
    assert len(lists) == len(TRITON_CASES)


def test_a_parameter_packed_wrong_is_caught(tmp_path) -> None:
    """The check above fails when Triton's i32 parameters are packed as 8 bytes (worker --broken)."""
    cases, launches = _run_worker(tmp_path, broken=True)
    (bound,) = cases.values()
    (launch,) = launches
    found = mismatches(
        entry_params(bound["ptx"], "program_kernel"),
        bound["layout"],
        bytes.fromhex(launch["params"]),
        bound["meant"] + [0, 0],
    )
    assert found and found[0].startswith("packed as"), found


# -- CUDA C++ ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_program_and_copy_launches_carry_the_parameters_their_entries_declare(
    nvcc_fatbins, tmp_path, arch: int
) -> None:
    import torch
    from cuda_tools import run, tool

    from gpucomm.ops import launcher
    from gpucomm.ops.cuda_ops import THREADS, copy_params, program_kernel_name, program_params

    double = cuda_double.build()
    drv = launcher.driver(double)
    cuda_double.log_to(double, tmp_path / "calls.log")
    try:
        ptx = {
            file: run([tool("cuobjdump"), "-ptx", str(nvcc_fatbins.fatbin(file, arch))])
            for file in ("program.cu", "copy.cu")
        }
        prog, operands, peers = (
            torch.zeros(16, dtype=torch.int64),
            torch.zeros(6, dtype=torch.int64),
            torch.zeros(4, dtype=torch.int64),
        )
        args = ProgramArgs(
            prog,
            operands,
            peers,
            0x7F00_0000_1000,
            0x7F00_0000_2000,
            channels=3,
            rank=1,
            world=2,
            fingerprint=0xABCDE,
            half_bytes=1 << 33,
            granule=4096,
            timeout_ns=2**64 - 1,
            dtype=None,
            op=0,
            copy_bytes=1,
            aligned=False,
            all_channels=4,
            ident_word=93,
            identity=((1 << 47) | 4096, (1 << 48) - 1),
        )
        meant_program = [
            prog.data_ptr(),
            2,
            operands.data_ptr(),
            peers.data_ptr(),
            0x7F00_0000_1000,
            0x7F00_0000_2000,
            1,
            2,
            0xABCDE,
            1 << 33,
            4096,
            2**64 - 1,
            4,
            93,
            (1 << 47) | 4096,
            (1 << 48) - 1,
        ]
        names = [
            program_kernel_name(None, 0),
            program_kernel_name(torch.float32, 0),
            program_kernel_name(torch.bfloat16, 0),
        ]
        for stream, name in enumerate(names, start=1):
            function = drv.load(nvcc_fatbins.cubin("program.cu", arch), name, 0)
            bound = launcher.bind(drv, function, program_params(args), grid=(3, 1, 1), block=(THREADS, 1, 1))
            bound.launch(stream)
        copy = launcher.bind(
            drv,
            drv.load(nvcc_fatbins.cubin("copy.cu", arch), "gpucomm_copy", 0),
            copy_params(0x7F00_0000_3000, 0x7F00_0000_4000, 12345),
            grid=(1, 1, 1),
            block=(THREADS, 1, 1),
        )
        copy.launch(len(names) + 1)
    finally:
        cuda_double.log_to(double, None)
    launches = {int(r["stream"], 16): r for r in cuda_double.records(tmp_path / "calls.log", "cuLaunchKernel")}
    for stream, name in enumerate(names, start=1):
        launch = launches[stream]
        assert launch["name"] == name and launch["block"] == f"{THREADS},1,1"
        found = mismatches(
            entry_params(ptx["program.cu"], name),
            [list(p) for p in launcher.layout([s for _, s, _ in program_params(args)])],
            bytes.fromhex(launch["params"]),
            meant_program,
        )
        assert found == [], (name, found)
    launch = launches[len(names) + 1]
    assert launch["name"] == "gpucomm_copy"
    found = mismatches(
        entry_params(ptx["copy.cu"], "gpucomm_copy"),
        copy.layout,
        bytes.fromhex(launch["params"]),
        [0x7F00_0000_3000, 0x7F00_0000_4000, 12345],
    )
    assert found == []


def test_entry_params_reads_ptx_parameter_lists() -> None:
    ptx = """
.visible .entry k(
	.param .u64 .ptr .global .align 1 k_param_0,
	.param .u32 k_param_1,
	.param .align 8 .b8 k_param_2[16],
	.param .u16 k_param_3,
	.param .u64 k_param_4
)
"""
    assert entry_params(ptx, "k") == [(0, 8), (8, 4), (16, 16), (32, 2), (40, 8)]


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support"))
    print(json.dumps(_worker(sys.argv[2], sys.argv[3], sys.argv[4] == "--broken")))


# -- CudaKernels' own launches, CuPy out of reach ---------------------------------------------------
def test_cuda_kernels_repeated_launches_are_bound_and_never_reach_cupy(nvcc_fatbins, tmp_path) -> None:
    import torch

    from gpucomm.ops.contract import Region
    from gpucomm.ops.cuda_ops import THREADS

    OnTheGpu.device = torch.device("cuda", 0)
    double = cuda_double.build()
    kernels = cuda_kernels_on_the_double(nvcc_fatbins, double, 90)
    prog, operands, peers = (
        torch.zeros(16, dtype=torch.int64),
        torch.zeros(6, dtype=torch.int64),
        torch.zeros(4, dtype=torch.int64),
    )
    bound = kernels.prepare_program(
        ProgramArgs(
            prog,
            operands,
            peers,
            0x7F00_0000_1000,
            0x7F00_0000_2000,
            channels=3,
            rank=1,
            world=2,
            fingerprint=77,
            half_bytes=1 << 20,
            granule=4096,
            timeout_ns=10**9,
            dtype=torch.bfloat16,
            op=0,
            copy_bytes=8,
            aligned=True,
            all_channels=4,
            ident_word=93,
            identity=((1 << 47) | 64, (1 << 47) | 5),
        )
    )
    cuda_double.log_to(double, tmp_path / "calls.log")
    try:
        for _ in range(3):
            bound.launch(kernels._raw_stream())
        copies = [(0x7F00_0001_0000, 0x7F00_0002_0000, 64), (0x7F00_0001_0008, 0x7F00_0002_0010, 1 << 22)]
        for dst, src, nbytes in copies:
            kernels.copy(Region(dst, nbytes, OnTheGpu()), Region(src, nbytes, OnTheGpu()))
    finally:
        cuda_double.log_to(double, None)
    launches = cuda_double.records(tmp_path / "calls.log", "cuLaunchKernel")
    programs, copied = launches[:3], launches[3:]
    assert {r["name"] for r in programs} == {"gpucomm_program_sum_bfloat16"} and len(
        {r["params"] for r in programs}
    ) == 1
    meant = [
        prog.data_ptr(),
        2,
        operands.data_ptr(),
        peers.data_ptr(),
        0x7F00_0000_1000,
        0x7F00_0000_2000,
        1,
        2,
        77,
        1 << 20,
        4096,
        10**9,
        4,
        93,
        (1 << 47) | 64,
        (1 << 47) | 5,
    ]
    declared = entry_params(run_ptx(nvcc_fatbins, "program.cu", 90), "gpucomm_program_sum_bfloat16")
    assert mismatches(declared, [list(p) for p in bound.layout], bytes.fromhex(programs[0]["params"]), meant) == []
    assert {(r["grid"], r["block"], r["stream"]) for r in programs} == {("3,1,1", f"{THREADS},1,1", "0xcafe")}
    for record, (dst, src, nbytes) in zip(copied, copies):
        assert record["name"] == "gpucomm_copy" and record["stream"] == "0xcafe"
        assert bytes.fromhex(record["params"]) == b"".join(v.to_bytes(8, "little") for v in (dst, src, nbytes))
        assert record["grid"] == f"{kernels._blocks(-(-nbytes // 16))},1,1"


def test_cuda_kernels_reduce_signal_and_wait_are_bound_and_carry_what_their_entries_declare(
    nvcc_fatbins, tmp_path
) -> None:
    """CudaKernels' launches that CuPy's Function once made go through gpucomm's launcher: each on
    torch's stream, its words where the kernel's PTX declares them, carrying the call's values,
    CuPy never touched."""
    import torch

    from gpucomm.ops.contract import Region
    from gpucomm.ops.cuda_ops import THREADS, reduce_kernel_name
    from gpucomm.reduce_op import ReduceOp

    OnTheGpu.device = torch.device("cuda", 0)
    double = cuda_double.build()
    kernels = cuda_kernels_on_the_double(nvcc_fatbins, double, 90)
    out, a, b = (Region(0x7F00_0001_0000 + i * (1 << 24), 4096 * 2, OnTheGpu()) for i in range(3))
    flags = [Region(0x7F00_0100_0000 + 8 * i, 8, OnTheGpu()) for i in range(3)]
    cuda_double.log_to(double, tmp_path / "calls.log")
    try:
        kernels.reduce(out, [a, b], torch.bfloat16, ReduceOp.AVG, 2)
        kernels.reduce(out, [a, b, out], torch.bfloat16, ReduceOp.AVG, 3)  # the same function, other words
        kernels.signal(flags, 2**40 + 5)
        # The double runs no kernel: the host reads the record as the host initialised it.
        assert kernels.wait(flags, 2**40 + 5, time.monotonic() + 30.0) == []
    finally:
        cuda_double.log_to(double, None)
    launches = cuda_double.records(tmp_path / "calls.log", "cuLaunchKernel")
    reduce_name = reduce_kernel_name(torch.bfloat16, ReduceOp.AVG)
    assert [r["name"] for r in launches] == [reduce_name, reduce_name, "gpucomm_signal", "gpucomm_wait"]
    assert {(r["block"], r["stream"]) for r in launches} == {(f"{THREADS},1,1", "0xcafe")}
    tables = [
        kernels._table([a.addr, b.addr]),
        kernels._table([a.addr, b.addr, out.addr]),
        kernels._table([f.addr for f in flags]),
    ]
    meant = {
        0: [out.addr, tables[0].data_ptr(), 2, 4096, 2],
        1: [out.addr, tables[1].data_ptr(), 3, 4096, 3],
        2: [tables[2].data_ptr(), 3, 2**40 + 5],
    }
    ptx = {file: run_ptx(nvcc_fatbins, file, 90) for file in ("reduce.cu", "flags.cu")}
    for index, values in meant.items():
        file, name = ("reduce.cu", reduce_name) if index < 2 else ("flags.cu", "gpucomm_signal")
        declared = entry_params(ptx[file], name)
        found = mismatches(declared, declared, bytes.fromhex(launches[index]["params"]), values)
        assert found == [], (name, found)
        assert launches[index]["grid"] == (f"{kernels._blocks(-(-out.nbytes // 16))},1,1" if index < 2 else "1,1,1")
    declared = entry_params(ptx["flags.cu"], "gpucomm_wait")
    wait_words = bytes.fromhex(launches[3]["params"])
    status = int.from_bytes(wait_words[declared[4][0] : declared[4][0] + 8], "little")
    timeout = int.from_bytes(wait_words[declared[3][0] : declared[3][0] + 8], "little")
    assert 20e9 < timeout <= 30e9, timeout  # what was left of the deadline at the launch
    assert mismatches(declared, declared, wait_words, [tables[2].data_ptr(), 3, 2**40 + 5, timeout, status]) == []


def test_without_the_launcher_cupy_gets_torchs_stream_and_each_words_bits(nvcc_fatbins) -> None:
    import numpy as np
    import torch

    from gpucomm.ops.contract import Region
    from gpucomm.ops.cuda_ops import REDUCE_PARAMS, SIGNAL_PARAMS, THREADS, reduce_kernel_name
    from gpucomm.reduce_op import ReduceOp

    OnTheGpu.device = torch.device("cuda", 0)
    kernels = cuda_kernels_on_the_double(nvcc_fatbins, cuda_double.build(), 90)
    kernels._driver, kernels._cupy = None, RecordingCupy()
    name = reduce_kernel_name(torch.float16, ReduceOp.AVG)
    for file, kernel in (("reduce.cu", name), ("flags.cu", "gpucomm_signal")):
        kernels._functions[(file, kernel)] = kernels._cupy.function(kernel)
    out, a = Region(0x7F00_0001_0000, 64, OnTheGpu()), Region(0x7F00_0002_0000, 64, OnTheGpu())
    flag = Region(0x7F00_0100_0000, 8, OnTheGpu())
    kernels.reduce(out, [a], torch.float16, ReduceOp.AVG, 2**31 + 1)
    kernels.signal([flag], 2**63 - 1)
    (reduce_call, signal_call) = kernels._cupy.calls
    table = kernels._table([a.addr]).data_ptr()
    assert reduce_call[:3] == (name, (1,), (THREADS,)) and reduce_call[4] == 0xCAFE
    packed = [
        np.dtype(f"<u{size}").type(v).tobytes()
        for (_, size), v in zip(REDUCE_PARAMS, (out.addr, table, 1, 32, 2**31 + 1))
    ]
    assert reduce_call[3] == packed
    table = kernels._table([flag.addr]).data_ptr()
    packed = [np.dtype(f"<u{size}").type(v).tobytes() for (_, size), v in zip(SIGNAL_PARAMS, (table, 1, 2**63 - 1))]
    assert signal_call[3] == packed and signal_call[4] == 0xCAFE


def test_a_prepared_copy_is_one_launch_of_its_words_each_time(nvcc_fatbins, tmp_path) -> None:
    import torch

    from gpucomm.ops.contract import Region

    OnTheGpu.device = torch.device("cuda", 0)
    double = cuda_double.build()
    kernels = cuda_kernels_on_the_double(nvcc_fatbins, double, 90)
    dst, src = Region(0x7F00_0001_0000, 1 << 20, OnTheGpu()), Region(0x7F00_0002_0000, 1 << 20, OnTheGpu())
    launch = kernels.prepare_copy(dst, src)
    with pytest.raises(ValueError, match=r"CudaKernels.prepare_copy: expected a copy of at least 1 byte"):
        kernels.prepare_copy(Region(dst.addr, 0, OnTheGpu()), Region(src.addr, 0, OnTheGpu()))
    cuda_double.log_to(double, tmp_path / "calls.log")
    try:
        launch.launch(0xBEEF)
        launch.launch(0xBEEF)
    finally:
        cuda_double.log_to(double, None)
    records = cuda_double.records(tmp_path / "calls.log", "cuLaunchKernel")
    words = b"".join(v.to_bytes(8, "little") for v in (dst.addr, src.addr, 1 << 20))
    assert [(r["name"], r["stream"], bytes.fromhex(r["params"])) for r in records] == [
        ("gpucomm_copy", "0xbeef", words)
    ] * 2
    assert records[0]["grid"] == f"{kernels._blocks((1 << 20) // 16)},1,1"
