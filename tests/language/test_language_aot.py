"""The device API's kernels compile for sm_90 without a GPU, with the instructions its contract
rests on (as tests/ops/test_triton_aot.py checks the program kernel): release stores and acquire
loads at system scope for flags, %globaltimer for deadlines decided once per block, 16-byte
vector loads where the addresses allow them.

Kernels: the one-shot all_reduce (kernels/triton/oneshot.py), the fused ops'
(kernels/triton/fused_norm.py, fused_matmul.py), a user's kernel of signal/wait
(tests/support/lang_kernels.py) and the tutorial's (docs/tutorials/one_shot_all_reduce.py).
"""

from __future__ import annotations

import json
import os
import re
import runpy
import subprocess
import sys

import pytest
from ptx_instructions import INSTRUCTION, has, narrow_products, timer_facts

ARCH = 90
# Asynchronous tile copies (16 bytes a thread, global to shared) and Hopper's warp-group MMA.
_ASYNC = re.compile(r"\b(?:cp\.async\.cg\.shared\.global|wgmma\.mma_async)[\w.]*")
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _variants() -> dict[str, tuple]:
    """name -> (kernel, signature, constexprs, num_warps)."""
    import triton.language as tl
    from lang_kernels import ring_put

    from gpucomm._kernels.triton import fused_matmul, fused_norm, oneshot

    tutorial = runpy.run_path(os.path.join(_REPO, "docs", "tutorials", "one_shot_all_reduce.py"))["one_shot_all_reduce"]
    variants = {}
    for dtype, op, copy, elem in (
        ("bfloat16", 0, tl.int16, 2),
        ("float32", 4, tl.int32, 4),
        ("float32", 3, tl.int32, 4),
    ):
        variants[f"oneshot-{op}-{dtype}"] = (
            oneshot.oneshot_kernel,
            # n and piece as Triton's dispatch types them below 2**31 elements: i32.
            {"ctx": "*i64", "x_addr": "i64", "n": "i32", "piece": "i32", "divisor": "i32"},
            {
                "DTYPE": getattr(tl, dtype),
                "OP": op,
                "COPY": copy,
                "ELEM": elem,
                "ALIGNED": True,
                "BLOCK": 128 * 16 // elem,
                "LANES": 128,
            },
            oneshot.NUM_WARPS,
        )
    norm = {"DTYPE": tl.bfloat16, "ALIGNED": True, "BLOCK_H": 8192}
    variants["ar_residual_rmsnorm-bfloat16"] = (
        fused_norm.ar_residual_rmsnorm_kernel,
        {
            "ctx": "*i64", "x_addr": "i64", "res_addr": "i64", "w_addr": "i64", "out_addr": "i64",
            "new_res_addr": "i64",
            "T": "i32", "H": "i32", "eps": "fp32", "rows_per_piece": "i32",
        },
        {**norm, "COPY": tl.int16, "LANES": 32 * fused_norm.num_warps(8192)},
        fused_norm.num_warps(8192),
    )  # fmt: skip
    kernel, signature, constexprs, warps = variants["ar_residual_rmsnorm-bfloat16"]
    variants["ar_residual_rmsnorm_twoshot-bfloat16"] = (
        fused_norm.ar_residual_rmsnorm_twoshot_kernel,
        signature,
        constexprs,
        warps,
    )
    variants["residual_rmsnorm-bfloat16"] = (
        fused_norm.residual_rmsnorm_kernel,
        {
            "s_addr": "i64",
            "res_addr": "i64",
            "w_addr": "i64",
            "out_addr": "i64",
            "new_res_addr": "i64",
            "T": "i32",
            "H": "i32",
            "eps": "fp32",
        },
        norm,
        fused_norm.num_warps(8192),
    )
    matmul = {
        "G": 4,
        "DTYPE": tl.bfloat16,
        "PRECISION": "tf32",
        "WIDEN": False,
        "ALIGNED": True,
        "BLOCK_M": 64,
        "BLOCK_N": 64,
        "BLOCK_K": 32,
        "LANES": 128,
    }
    sizes = {"stage_addr": "i64", "stage_half": "i64", "m": "i32", "n": "i32", "k": "i32"}
    variants["ag_publish-bfloat16"] = (
        fused_matmul.ag_publish_kernel,
        {"ctx": "*i64", "a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", **sizes},
        {**matmul, "COPY": tl.int16, "BLOCK": 1024},
        4,
    )
    variants["ag_matmul-bfloat16"] = (
        fused_matmul.ag_matmul_kernel,
        {"ctx": "*i64", "b_ptr": "*bf16", "c_ptr": "*bf16", **sizes},
        matmul,
        4,
    )
    # One chunk: one wait in the TTGIR. With four, MLIR reuses the SSA names of the unrolled
    # waits in their separate regions, which the name-based timer analysis cannot tell apart.
    kernel, signature, constexprs, warps = variants["ag_matmul-bfloat16"]
    variants["ag_matmul-bfloat16-G1"] = (kernel, signature, {**constexprs, "G": 1}, warps)
    variants["user-ring_put"] = (
        ring_put,
        {"ctx": "*i64", "x_ptr": "*fp32", "inbox_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "value": "i64"},
        {"BLOCK": 512, "LANES": 128},
        4,
    )
    variants["tutorial"] = (
        tutorial,
        {"ctx": "*i64", "x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"},
        {"BLOCK": 512, "LANES": 128},
        4,
    )
    return variants


def _worker() -> dict:
    import triton
    from triton.backends.compiler import GPUTarget

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("test_language_aot worker: run without TRITON_INTERPRET")
    report: dict = {}
    for name, (kernel, signature, constexprs, warps) in _variants().items():
        signature = {**signature, **{k: "constexpr" for k in constexprs}}
        # Pointer arguments of the launch are 16-byte aligned (torch allocations, the context
        # table), and so are the integers Triton specialises as such at a launch with sizes and
        # addresses that are multiples of 16 (the matmul's m, n, k and stage).
        aligned = {
            (i,): [["tt.divisibility", 16]]
            for i, (arg, t) in enumerate(signature.items())
            if t.startswith("*")
            or (name.startswith(("ag_publish", "ag_matmul")) and arg in ("m", "n", "k", "stage_addr"))
        }
        source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=aligned)
        try:
            compiled = triton.compile(source, target=GPUTarget("cuda", ARCH, 32), options={"num_warps": warps})
        except Exception as exc:  # reported per variant, so one failure does not hide others
            report[name] = f"{type(exc).__name__}: {exc}"
            continue
        ptx = compiled.asm["ptx"]
        report[name] = sorted(set(INSTRUCTION.findall(ptx) + _ASYNC.findall(ptx))) + (
            ["%globaltimer"] if "%globaltimer" in ptx else []
        )
        report[f"{name}-timer"] = timer_facts(compiled.asm["ttgir"])
        report[f"{name}-narrow"] = narrow_products(compiled.asm["ttgir"])
    return report


@pytest.fixture(scope="module")
def ptx() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run(
        [sys.executable, __file__, "--worker"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=os.path.dirname(__file__),
    )
    if proc.returncode != 0:
        raise RuntimeError(f"AOT worker failed (exit {proc.returncode}):\n{proc.stderr[-8000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _seen(ptx: dict, name: str) -> list[str]:
    seen = ptx[name]
    if isinstance(seen, str):
        pytest.fail(f"{name} did not compile for sm_{ARCH}: {seen}", pytrace=False)
    return seen


WAITING = [
    "oneshot-0-bfloat16",
    "oneshot-4-float32",
    "oneshot-3-float32",
    "ar_residual_rmsnorm-bfloat16",
    "ar_residual_rmsnorm_twoshot-bfloat16",
    "ag_matmul-bfloat16-G1",
    "user-ring_put",
    "tutorial",
]


@pytest.mark.parametrize("name", WAITING)
def test_waits_acquire_at_system_scope_against_the_global_timer_once_per_block(ptx, name: str) -> None:
    seen = _seen(ptx, name)
    assert has(seen, "atom", "acquire", "sys"), seen  # the polls: an atomic add of 0, acquire, .sys
    assert "%globaltimer" in seen, seen  # the deadline
    assert has(seen, "bar", "sync"), seen  # the block lines up around its flags
    facts = ptx[f"{name}-timer"]
    # Every thread reads the clock, and a branch sees it only through a reduction (the block's verdict).
    assert facts == {"per_thread": True, "branch_sees_raw": False, "branch_sees_reduced": True}, facts


# all_gather_matmul's matmul launch waits and does not announce; its push launch announces.
SIGNALLING = [name for name in WAITING if not name.startswith("ag_matmul")] + ["ag_publish-bfloat16"]


@pytest.mark.parametrize("name", SIGNALLING)
def test_signals_release_at_system_scope(ptx, name: str) -> None:
    seen = _seen(ptx, name)
    assert has(seen, "atom", "release", "sys", "exch"), seen


def test_all_gather_matmuls_push_launch_never_waits(ptx) -> None:
    # What makes the op independent of block scheduling (kernels/triton/fused_matmul.py): the
    # push launch has no poll (an acquire) and no clock. (That the matmul launch pushes nothing
    # a peer awaits is tested by running the launches apart, tests/fused/test_fused.py: its error
    # record's release exchange looks like a signal here.)
    seen = _seen(ptx, "ag_publish-bfloat16")
    assert not any("acquire" in i.split(".") for i in seen) and "%globaltimer" not in seen, seen


@pytest.mark.parametrize(
    "name",
    [
        "oneshot-0-bfloat16",
        "oneshot-4-float32",
        "ar_residual_rmsnorm-bfloat16",
        "ar_residual_rmsnorm_twoshot-bfloat16",
        "residual_rmsnorm-bfloat16",
    ],
)
def test_peer_loads_keep_their_16_byte_vectors(ptx, name: str) -> None:
    # gl.translate promises 16-byte distances, so loads through a translated base stay vectors.
    seen = _seen(ptx, name)
    assert any(i.startswith(("ld.global.v4", "ld.global.v2", "ld.global.cg.v4", "ld.global.cg.v2")) for i in seen), (
        seen
    )  # peer loads are .cg
    assert any(i.startswith(("st.global.v4", "st.global.v2")) for i in seen), seen


@pytest.mark.parametrize("name", ["ag_publish-bfloat16", "ag_matmul-bfloat16"])
def test_the_matmul_pipelines_16_byte_tile_copies_into_tensor_core_mmas(ptx, name: str) -> None:
    # Tiles of 16-byte rows, from this rank's shard (the push launch) or from the gathered
    # buffer (the matmul launch): cp.async.cg (16 bytes a thread) into shared memory, wgmma on
    # sm_90 (Triton 3.9).
    seen = _seen(ptx, name)
    assert any(i.startswith("cp.async.cg.shared.global") for i in seen), seen
    assert any(i.startswith("wgmma.mma_async") for i in seen), seen


def test_rmsnorm_divides_and_roots_as_ieee(ptx) -> None:
    for name in ("ar_residual_rmsnorm-bfloat16", "ar_residual_rmsnorm_twoshot-bfloat16", "residual_rmsnorm-bfloat16"):
        seen = _seen(ptx, name)
        assert [i for i in seen if i.startswith("div.") and i.endswith("f32")] == ["div.rn.f32"], seen


def test_all_gather_matmuls_pushes_store_16_byte_vectors(ptx) -> None:
    # The push writes every peer's gathered buffer over the links: with a 16-byte aligned shard
    # (ALIGNED) its stores are vectors. Without the alignment said of the stage half (an argument
    # Triton does not specialise), the sm_90 PTX stored 8 single bf16 a thread a step.
    seen = _seen(ptx, "ag_publish-bfloat16")
    assert has(seen, "st", "global", "v4"), seen


# The 32-bit products a kernel widens into an address, and why each stays far below 2**31: every
# other offset is computed in 64 bits (tests/support/ptx_instructions.narrow_products says why).
BOUNDED_PRODUCTS = {
    "rec": "a channel's error record: channel x 64 bytes",
    "row_bytes": "H rounded down to whole vectors (at most H)",
    "at": "H rounded down to whole vectors (at most H)",
    "out": "a row of the output (shard p's first, a tile's first): under world x m rows",
}


@pytest.mark.parametrize("name", sorted(set(WAITING + SIGNALLING)))
def test_data_offsets_are_computed_in_64_bits(ptx, name: str) -> None:
    """A tensor of more than 2 GiB has offsets past 2**31 bytes while its element count, below
    2**31, is an i32 argument: the one-shot's piece offset ``start * ELEM`` was such a product."""
    _seen(ptx, name)
    narrow = ptx[f"{name}-narrow"]
    assert set(narrow) <= set(BOUNDED_PRODUCTS), narrow


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    print(json.dumps(_worker()))
