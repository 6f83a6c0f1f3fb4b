"""The residency check: no block may spin on a block that cannot become resident.

A launch is described by where it runs (device, stream, its place on the stream), its grid, what
one of its blocks takes (:class:`gpucomm.ops.residency.Footprint`) and the launches its blocks
spin on. :func:`violations` fails a launch X that spins on a launch Y when Y can be shut out:

- Y is on X's own stream after X (it starts only when X has ended): always;
- otherwise, when the launches that may spin on Y's device while Y waits to be scheduled (every
  spinning launch there but those on Y's own stream, which end before Y starts or start after
  it ends) hold enough blocks to leave no SM with room for one block of Y, placed as badly as
  the GPU may place them (gpucomm.ops.residency.blocks_to_shut). A launch Y on X's stream before
  X has ended when X starts: never a problem.

Y itself must never spin (a chain of waits is not modelled: the check fails it).

:func:`compiled_footprints` compiles all_gather_matmul's two kernels for sm_90 ahead of time (no
GPU) in a subprocess without the interpreter, and reads registers and static shared memory from
the cubin (cuobjdump --dump-resource-usage) and the dynamic shared memory from Triton.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

from gpucomm.ops.residency import H100, Footprint, SMLimits, blocks_to_shut

__all__ = ["Launch", "violations", "compiled_footprints"]


@dataclass(frozen=True)
class Launch:
    name: str  # unique, e.g. "rank 3 ag_matmul_kernel"
    device: int
    stream: str
    seq: int  # place on its stream
    grid: int
    footprint: Footprint
    waits_on: tuple[str, ...] = field(default=())  # names of the launches its blocks spin on


def violations(launches: list[Launch], limits: SMLimits = H100) -> list[str]:
    """Every (spinning launch, waited launch) pair that may deadlock, in words; empty: none."""
    by_name = {launch.name: launch for launch in launches}
    found = []
    for x in launches:
        for name in x.waits_on:
            y = by_name[name]
            if y.waits_on:
                found.append(f"{x.name} waits on {y.name}, which spins itself (a chain of waits)")
                continue
            if y.stream == x.stream:
                if y.seq > x.seq:
                    found.append(f"{x.name} waits on {y.name}, after it on its stream")
                continue  # before it on its stream: ended before x started
            spinning = [s for s in launches if s.waits_on and s.device == y.device and s.stream != y.stream]
            if not spinning:
                continue  # nothing on y's device may spin while y waits to be scheduled
            worst = Footprint(
                threads=max(s.footprint.threads for s in spinning),
                registers=max(s.footprint.registers for s in spinning),
                shared=max(s.footprint.shared for s in spinning),
            )
            shut = blocks_to_shut(worst, y.footprint, limits)
            blocks = sum(s.grid for s in spinning)
            if shut is not None and blocks >= limits.sms * shut:
                found.append(
                    f"{x.name} waits on {y.name}: {blocks} spinning blocks of {len(spinning)} launch(es) on "
                    f"device {y.device} can fill its {limits.sms} SMs ({shut} an SM shut out a block of "
                    f"{y.footprint}; at most {limits.sms * shut - 1} leave it a place)"
                )
    return found


_RESOURCES = re.compile(r"REG:(\d+)\s.*?SHARED:(\d+)\s")


def compiled_footprints(dtype: str) -> dict[str, Footprint]:
    """{"publish": ..., "matmul": ...}: all_gather_matmul's kernels compiled for sm_90 at m = n =
    k = 8192 in ``dtype`` ("bfloat16", "float16", "float32"), with the largest tiles."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run(
        [sys.executable, __file__, dtype], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"compiled_footprints({dtype}) failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
    return {name: Footprint(**fp) for name, fp in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


def _worker(dtype: str) -> dict[str, dict[str, int]]:
    import triton
    import triton.language as tl
    from cuda_tools import run, tool
    from triton.backends.compiler import GPUTarget

    from gpucomm._kernels.triton import fused_matmul as fm

    size = {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]
    ptr = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32"}[dtype]
    common = {
        "G": fm.CHUNKS,
        "DTYPE": getattr(tl, dtype),
        "PRECISION": "ieee" if size == 4 else "tf32",
        "WIDEN": False,
        "ALIGNED": True,
        "BLOCK_M": 64,
        "BLOCK_N": 64,
        "BLOCK_K": 32,
        "LANES": 32 * fm._NUM_WARPS,
    }
    args = {"ctx": "*i64", "a_ptr": ptr, "b_ptr": ptr, "c_ptr": ptr, "stage_addr": "i64", "stage_half": "i64"}
    args |= {"m": "i32", "n": "i32", "k": "i32"}
    kernels = {
        "publish": (
            fm.ag_publish_kernel,
            args,
            {**common, "COPY": {2: tl.int16, 4: tl.int32}[size], "BLOCK": 2048 // size},
        ),
        "matmul": (fm.ag_matmul_kernel, {k: v for k, v in args.items() if k != "a_ptr"}, common),
    }
    out = {}
    for name, (kernel, signature, constexprs) in kernels.items():
        # Every pointer and m, n, k divisible by 16, as the launcher specialises them at 8192.
        attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(signature) if arg != "stage_half"}
        source = triton.compiler.ASTSource(
            fn=kernel,
            signature={**signature, **dict.fromkeys(constexprs, "constexpr")},
            constexprs=constexprs,
            attrs=attrs,
        )
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": fm._NUM_WARPS})
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(compiled.asm["cubin"])
            cubin.flush()
            usage = run([tool("cuobjdump"), "--dump-resource-usage", cubin.name])
        registers, static = (int(x) for x in _RESOURCES.search(usage).groups())
        out[name] = {"threads": 32 * fm._NUM_WARPS, "registers": registers, "shared": static + compiled.metadata.shared}
    return out


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    print(json.dumps(_worker(sys.argv[1])))
