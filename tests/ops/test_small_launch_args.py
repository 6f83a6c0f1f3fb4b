"""The small-message all_reduce's launches, bound through gpucomm's launcher, hand the driver the
parameters their ``.entry`` declares, carrying the values the call meant, one launch per call and
the same bytes every time (what a CUDA graph captures). No GPU: the driver double
(tests/support/cuda_double) records the launches (tests/ops/test_program_launch_args.py does the same for the
program kernel).

Triton: kernels/triton/small.py compiled for sm_90 as its JIT dispatch specialises it and bound by
``HostOnlyTritonKernels``, in a worker started without TRITON_INTERPRET (this file run as a
script). CUDA C++: kernels/cuda/small.cu compiled by nvcc as NVRTC compiles it, bound by
``CudaKernels.prepare_small``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import cuda_double
from cuda_kernels_double import cuda_kernels_on_the_double
from ptx_params import entry_params, mismatches, run_ptx

from gpucomm.ops.launch_args import SmallArgs

# A 2-rank call's values (addresses as a CPU's), then 8 ranks with a 1 s timeout (an i32 in Triton).
CASES = {
    "world2": {"world": 2, "rank": 1, "timeout_ns": 120 * 10**9, "n": 4099, "channels": 2},
    "world8": {"world": 8, "rank": 5, "timeout_ns": 10**9, "n": 7, "channels": 1},
}
_BASE = 0x7F12_0000_0000


def _values(case: dict) -> dict:
    world = case["world"]
    return {
        "x": _BASE + 0x10_0000,
        "n": case["n"],
        "stages": [_BASE + (p + 1) * 0x100_0000 for p in range(world)],
        "flags": [_BASE + (p + 1) * 0x100_0000 + 0x80_0000 for p in range(world)],
        "half_bytes": 1 << 20,
        "state_addr": _BASE + 0x2000,
        "record_addr": _BASE + 0x3000,
        "rank": case["rank"],
        "fingerprint": 0xABCDE,
        "timeout_ns": case["timeout_ns"],
        "channels": case["channels"],
        "all_channels": 4,
        "divisor": world,
        "ident_word": 77,  # the flag area's first identity slot
        "identity": ((1 << 47) | (7 << 40) | case["n"], (1 << 47) | 0x0BAD_CAFE_F00D),
    }


def _args(v: dict, dtype, op) -> SmallArgs:  # noqa: ANN001
    return SmallArgs(
        x=v["x"],
        n=v["n"],
        stages=v["stages"],
        flags=v["flags"],
        half_bytes=v["half_bytes"],
        state_addr=v["state_addr"],
        record_addr=v["record_addr"],
        rank=v["rank"],
        fingerprint=v["fingerprint"],
        timeout_ns=v["timeout_ns"],
        channels=v["channels"],
        all_channels=v["all_channels"],
        divisor=v["divisor"],
        dtype=dtype,
        op=op,
        ident_word=v["ident_word"],
        identity=v["identity"],
    )


def _prepare(kernels, v: dict, dtype, op):  # noqa: ANN001, ANN202
    return kernels.prepare_small(_args(v, dtype, op))


def _meant(v: dict, world: int) -> list[int]:
    """The values of every parameter, in order, as small.cu and small.py declare them."""
    pad = [0] * (8 - world)
    return [
        v["x"],
        v["n"],
        *v["stages"],
        *pad,
        *v["flags"],
        *pad,
        v["half_bytes"],
        v["state_addr"],
        v["record_addr"],
        v["rank"],
    ]


def _worker(double: str, log: str) -> dict:
    import torch
    from triton.backends.compiler import GPUTarget

    from gpucomm._kernels.triton import small
    from gpucomm.ops import triton_launch
    from gpucomm.ops.triton_ops import HostOnlyTritonKernels
    from gpucomm.reduce_op import ReduceOp

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("test_small_launch worker: run without TRITON_INTERPRET")
    cuda_double.log_to(double, log)
    kernels = HostOnlyTritonKernels(GPUTarget("cuda", 90, 32), double)
    found, stream = {}, 0x100
    for name, case in CASES.items():
        v = _values(case)
        bound = _prepare(kernels, v, torch.bfloat16, ReduceOp.AVG)
        stream += 1
        for _ in range(2):
            bound.launch(stream)
        grid, values, constexprs, options = small.arguments(_args(v, torch.bfloat16, ReduceOp.AVG))
        ptx = triton_launch.compile_for(small.small_kernel, kernels._target(), values, constexprs, options).asm["ptx"]
        params = [p for p in small.small_kernel.params if not p.is_constexpr]
        # Triton turns an integer argument equal to 1 into a constant, unless told not to specialise it.
        meant = [value for p, value in zip(params, values) if not (value == 1 and not p.do_not_specialize)]
        found[name] = {"stream": stream, "layout": bound.layout, "meant": meant, "ptx": ptx, "grid": grid[0]}
    return found


def test_triton_small_launch_carries_the_parameters_its_entry_declares(tmp_path) -> None:
    double, log = cuda_double.build(), tmp_path / "calls.log"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", double, str(log)], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-8000:]
    cases = json.loads(proc.stdout.strip().splitlines()[-1])
    launches = cuda_double.records(log, "cuLaunchKernel")
    for name, bound in cases.items():
        mine = [r for r in launches if int(r["stream"], 16) == bound["stream"]]
        assert len(mine) == 2 and mine[0]["params"] == mine[1]["params"], name  # the same bytes each call
        declared = entry_params(bound["ptx"], "small_kernel")
        # The hidden scratch pointers Triton 3.9 appends (global, profile): null, as no scratch is used.
        assert mismatches(declared, bound["layout"], bytes.fromhex(mine[0]["params"]), bound["meant"] + [0, 0]) == [], (
            name
        )
        assert (mine[0]["name"], mine[0]["grid"], mine[0]["block"]) == (
            "small_kernel",
            f"{bound['grid']},1,1",
            "128,1,1",
        )
    # The meant values are the call's: every rank's half and flag area by rank, zeros past the world.
    v = _values(CASES["world2"])
    assert cases["world2"]["meant"][:18] == _meant(v, 2)[:18]


def test_cuda_small_launch_carries_the_parameters_its_entry_declares(nvcc_fatbins, tmp_path) -> None:
    import torch

    from gpucomm.ops.cuda_ops import THREADS, small_kernel_name
    from gpucomm.reduce_op import ReduceOp

    double = cuda_double.build()
    kernels = cuda_kernels_on_the_double(nvcc_fatbins, double, 90)
    ptx = run_ptx(nvcc_fatbins, "small.cu", 90)
    for name, case in CASES.items():
        v = _values(case)
        bound = _prepare(kernels, v, torch.float16, ReduceOp.MIN)
        cuda_double.log_to(double, tmp_path / f"{name}.log")
        try:
            for _ in range(3):
                bound.launch(0xCAFE)
        finally:
            cuda_double.log_to(double, None)
        launches = cuda_double.records(tmp_path / f"{name}.log", "cuLaunchKernel")
        kernel = small_kernel_name(torch.float16, ReduceOp.MIN)
        assert [r["name"] for r in launches] == [kernel] * 3 and len({r["params"] for r in launches}) == 1
        assert (launches[0]["grid"], launches[0]["block"]) == (f"{case['channels']},1,1", f"{THREADS},1,1")
        meant = _meant(v, case["world"]) + [
            case["world"],
            v["fingerprint"],
            v["timeout_ns"],
            v["all_channels"],
            v["divisor"],
            v["ident_word"],
            *v["identity"],
        ]
        declared = entry_params(ptx, kernel)
        assert (
            mismatches(declared, [list(p) for p in bound.layout], bytes.fromhex(launches[0]["params"]), meant) == []
        ), name


if __name__ == "__main__" and sys.argv[1] == "--worker":
    print(json.dumps(_worker(sys.argv[2], sys.argv[3])))
