"""The CUDA C++ kernels compile for sm_80 and sm_90 and contain the instructions the protocol needs.

No GPU here: each shipped ``.cu`` file is compiled by nvcc with exactly the options the run-time
loader hands NVRTC (``compile_options``), from the text the package ships (``kernel_source``),
into a fatbin holding SASS and PTX; cuobjdump then reads both back.

nvcc and cuobjdump are required (CI has them): a missing tool fails the module, unless
GPUCOMM_ALLOW_NO_NVCC=1 says this machine is known to lack them, in which case it skips.
cuobjdump is looked for on PATH, in $CUDA_HOME/bin, then in the copy Triton ships.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from gpucomm.errors import UnsupportedError
from gpucomm.ops.contract import SUPPORTED_DTYPES
from gpucomm.ops.cuda_ops import (
    HEADER,
    KERNEL_PACKAGE,
    SOURCES,
    THREADS,
    CudaKernels,
    _target,
    compile_options,
    kernel_source,
    reduce_kernel_name,
)
from gpucomm.reduce_op import ReduceOp

ARCHS = (80, 90)
_DEFINES = {"GPUCOMM_THREADS": THREADS}


def _tool(name: str) -> str:
    candidates = [shutil.which(name)]
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home:
        candidates.append(str(Path(cuda_home, "bin", name)))
    candidates.append(str(Path(importlib.util.find_spec("triton").origin).parent / "backends/nvidia/bin" / name))
    for path in candidates:
        if path and os.access(path, os.X_OK):
            return path
    message = f"{name} not found (PATH, $CUDA_HOME/bin, Triton's bundled tools)"
    if os.environ.get("GPUCOMM_ALLOW_NO_NVCC") == "1":
        pytest.skip(message + "; skipped because GPUCOMM_ALLOW_NO_NVCC=1")
    pytest.fail(message + "; set GPUCOMM_ALLOW_NO_NVCC=1 to skip these tests on a machine without CUDA tools")


def _run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done.stdout


def _split_ptx(ptx: str) -> dict[str, str]:
    """PTX body of every kernel, by name."""
    parts = re.split(r"\.entry\s+(\w+)\s*\(", ptx)
    return dict(zip(parts[1::2], parts[2::2]))


def _split_sass(sass: str) -> dict[str, list[str]]:
    """The instructions (text before ';', without address) of every kernel, by name."""
    functions: dict[str, list[str]] = {}
    current: list[str] = []
    for line in sass.splitlines():
        header = re.match(r"\s*Function\s*:\s*(\w+)", line)
        if header:
            current = functions.setdefault(header.group(1), [])
            continue
        instruction = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+([^;]+?)\s*;", line)
        if instruction:
            current.append(instruction.group(1))
    return functions


class Compiled:
    def __init__(self, ptx: dict[str, str], sass: dict[str, list[str]]) -> None:
        self.ptx = ptx
        self.sass = sass


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], Compiled]:
    """Every (file, arch) compiled once, as the loader would have NVRTC compile it."""
    nvcc, cuobjdump = _tool("nvcc"), _tool("cuobjdump")
    root = tmp_path_factory.mktemp("cuda")
    # NVRTC gets common.cuh as an in-memory header; nvcc finds it next to the source.
    (root / HEADER).write_text(kernel_source(HEADER))
    for file in SOURCES:
        (root / file).write_text(kernel_source(file))

    def build(file: str, arch: int) -> Compiled:
        fatbin = root / f"{Path(file).stem}.sm_{arch}.fatbin"
        # --gpu-architecture=sm_XY makes nvcc embed both sm_XY SASS and compute_XY PTX.
        _run([nvcc, *compile_options(f"sm_{arch}", _DEFINES), "-fatbin", "-o", str(fatbin), str(root / file)])
        return Compiled(
            _split_ptx(_run([cuobjdump, "-ptx", str(fatbin)])),
            _split_sass(_run([cuobjdump, "-sass", str(fatbin)])),
        )

    # nvcc spends much of its time in subprocesses and file I/O: two at a time halves the wait.
    jobs = [(file, arch) for file in SOURCES for arch in ARCHS]
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(jobs, pool.map(lambda job: build(*job), jobs)))


def _reduce_names(fused: bool) -> set[str]:
    return {reduce_kernel_name(dtype, op, fused) for dtype in SUPPORTED_DTYPES for op in ReduceOp}


EXPECTED_KERNELS = {
    "copy.cu": {"gpucomm_copy"},
    "flags.cu": {"gpucomm_signal", "gpucomm_wait"},
    "reduce.cu": _reduce_names(fused=False),
    "oneshot_allreduce.cu": _reduce_names(fused=True),
}


def test_every_shipped_source_is_compiled_here() -> None:
    shipped = {p.name for p in importlib.resources.files(KERNEL_PACKAGE).iterdir() if p.name.endswith(".cu")}
    assert shipped == set(SOURCES) == set(EXPECTED_KERNELS)


def test_sources_include_only_headers_nvrtc_ships() -> None:
    # NVRTC has no host standard library; it provides cuda_fp16.h and cuda_bf16.h itself.
    allowed = {'"common.cuh"', "<cuda_fp16.h>", "<cuda_bf16.h>"}
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
def test_waits_load_with_acquire_at_system_scope_and_a_deadline(compiled, arch: int) -> None:
    waiting = [("flags.cu", "gpucomm_wait")] + [("oneshot_allreduce.cu", name) for name in EXPECTED_KERNELS["oneshot_allreduce.cu"]]
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
            next_load = next((j for j, ins in enumerate(following) if re.match(r"(@!?P\d+\s+)?LDG?\.", ins)), len(following))
            assert "CCTL.IVALL" in following[:next_load], (name, sass[i:])
        assert any("SR_GLOBALTIMER" in ins for ins in sass), name


@pytest.mark.parametrize("arch", ARCHS)
def test_reduces_contract_no_multiply_add(compiled, arch: int) -> None:
    # A fused multiply-add would round once where torch rounds twice. AVG's division is excluded:
    # IEEE division itself is computed with FMAs and is correctly rounded.
    for file in ("reduce.cu", "oneshot_allreduce.cu"):
        for name, sass in compiled[file, arch].sass.items():
            if "_avg_" in name:
                continue
            fmas = [ins for ins in sass if re.match(r"(@!?P\d+\s+)?(FFMA|DFMA)\b", ins)]
            assert not fmas, (name, fmas)


@pytest.mark.parametrize("arch", ARCHS)
def test_bulk_paths_move_16_byte_vectors(compiled, arch: int) -> None:
    kernels = [("copy.cu", "gpucomm_copy")] + [("reduce.cu", name) for name in EXPECTED_KERNELS["reduce.cu"]]
    for file, name in kernels:
        sass = compiled[file, arch].sass[name]
        assert any(ins.startswith("LDG.E.128") for ins in sass), name
        assert any(ins.startswith("STG.E.128") for ins in sass), name


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
    assert options[6:] == ("-DA=1", "-DB=2")  # sorted, so the memo key and the options agree


def test_target_prefers_a_cubin_and_falls_back_to_older_ptx() -> None:
    assert _target((9, 0), (80, 86, 90)) == ("sm_90", "cubin")
    assert _target((12, 0), (80, 86, 90, 100)) == ("compute_100", "ptx")
    with pytest.raises(UnsupportedError, match="none at or below this device's sm_75"):
        _target((7, 5), (80, 90))


def test_cpu_device_is_unsupported_with_the_reason() -> None:
    with pytest.raises(UnsupportedError, match=r"GPUCOMM_KERNELS=cuda needs a CUDA device .*got device cpu"):
        CudaKernels(torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA")
def test_cuda_device_without_cuda_is_unsupported_with_the_reason() -> None:
    with pytest.raises(UnsupportedError, match=r"torch\.cuda\.is_available\(\) is False"):
        CudaKernels(torch.device("cuda", 0))
