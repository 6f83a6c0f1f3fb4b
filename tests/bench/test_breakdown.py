"""bench/breakdown.py: the variants of an all_reduce's program, the split of its time, the model's
flags, and the whole module run on CPU at 2 ranks (Triton's interpreter over the shared-memory
workspace): every checked row right, and a "full" row that leaves its REDUCE out caught.

The times of a CPU run mean nothing; what it proves is that every program the GPU run times is
built, bound and run by the real executor, and that each check can fail."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from breakdown_broken import broken_rank

from gpucomm._bench import breakdown_programs as bp
from gpucomm._bench.breakdown import model_flags, parser, run, saturating_grid, split
from gpucomm._bench.breakdown_rank import workspace_for
from gpucomm._bench.model import parser as model_parser
from gpucomm.ops.program import COPY, REDUCE, SYNC, Builder, operands
from gpucomm.workspace.layout import DataLayout

# A few calls at the smallest sizes: the interpreter takes tens of ms a launch.
SMALL = ["--device", "cpu", "--step-sizes", "8", "--iters", "2", "--rounds", "1", "--warmup", "1", "--timeout", "60"]


class _Engine:
    """What breakdown_programs reads of an engine."""

    rank, world_size, half_bytes = 0, 2, 1 << 16


def _full(nbytes: int = 8):
    return bp.all_reduce_program(_Engine(), torch.empty(max(1, nbytes // 4)))


def test_the_8_byte_program_is_one_shot_and_each_variant_leaves_its_steps_out():
    algo, full = _full()
    assert algo == "oneshot" and [ins[0] for ins in full.instructions] == [COPY, SYNC, REDUCE]
    made = bp.variants(full)
    assert list(made) == list(bp.VARIANTS) and made["full"] is full
    assert {v: bp.moves(p) for v, p in made.items()} == {
        "full": [COPY, SYNC, REDUCE],
        "no_reduce": [COPY, SYNC],
        "no_copy": [SYNC, REDUCE],
        "no_sync": [COPY, REDUCE],
        "empty": [],
    }
    for v, p in made.items():
        # The same kernel on the same grid: dtype, op and extent are the full program's.
        assert (p.dtype, p.op, p.extent, p.syncs) == (full.dtype, full.op, full.extent, bp.moves(p).count(SYNC)), v
    # A fingerprint each: ranks at different variants see a mismatch, never pair up.
    assert len({p.fingerprint for p in made.values()}) == len(made)
    # The launch alone is one COPY of no bytes between operands the kernels can resolve.
    (nothing,) = made["empty"].instructions
    assert nothing[:2] == (COPY, 0) and operands(nothing) == operands(full.instructions[0])


def test_leave_out_refuses_what_it_cannot_do():
    _, full = _full()
    with pytest.raises(ValueError, match=r"leave_out: expected opcodes among COPY, REDUCE, SYNC, got 7"):
        bp.leave_out(full, frozenset({7}), "x")
    b = Builder(0, 2, 1 << 16, "barrier", ())
    b.sync()
    with pytest.raises(ValueError, match=r"leave_out: barrier has no COPY or REDUCE"):
        bp.leave_out(b.finish(), frozenset({SYNC}), "empty")


def test_the_programs_over_the_halves_read_the_staged_round():
    engine, data = _Engine(), torch.empty(64)
    (copy, sync) = bp.stage(engine, data).instructions
    assert copy[0] == COPY and copy[3].round == 0 and sync[0] == SYNC
    # No SYNC after the stage: round -1 is the half it wrote, as often as they run.
    (red,) = bp.reduce_halves(engine, data).instructions
    assert red[0] == REDUCE and [(s.peer, s.round) for s in red[4]] == [(0, -1), (1, -1)]
    (pulled,) = bp.pull(engine, data, 1).instructions
    assert (pulled[4].peer, pulled[4].round) == (1, -1)
    (pushed,) = bp.push(engine, data, 1).instructions
    assert (pushed[3].peer, pushed[3].round) == (1, 0)
    sync, out = bp.land(engine, data).instructions
    assert sync[0] == SYNC and (out[4].peer, out[4].round) == (0, 0)  # after its SYNC: the pushes' round


def test_split_and_the_model_flags():
    us = {"full": 10.0, "no_reduce": 7.5, "no_copy": 9.0, "no_sync": 6.0, "empty": 3.0}
    assert split(us) == {"launch": 3.0, "copy": 1.0, "sync": 4.0, "reduce": 2.5}
    with pytest.raises(ValueError, match=r"split: expected a time for every variant, missing \['empty'\]"):
        split({k: v for k, v in us.items() if k != "empty"})
    assert saturating_grid({1: 40.0, 4: 150.0, 16: 480.0, 32: 500.0}) == 16  # 480 is within 5% of 500
    assert saturating_grid({1: 40.0, 4: 150.0, 16: 470.0, 32: 500.0}) == 32
    with pytest.raises(ValueError, match=r"saturating_grid: expected rates"):
        saturating_grid({})
    assert model_flags(3.14159, 4.5, 16) == "--launch-us 3.14 --sync-us 4.50 --saturating-grid 16"
    assert model_flags(3.0, 4.0, None) == "--launch-us 3.00 --sync-us 4.00"


def test_the_workspace_holds_the_largest_size():
    for nbytes in (16 << 10, 1 << 20, 256 << 20):
        size = workspace_for(nbytes)
        assert DataLayout(size).half_bytes >= nbytes > DataLayout(size - (1 << 20)).half_bytes


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--nproc", "1"], "--nproc must be at least 2"),
        (["--copy-channels", "8"], r"--copy-channels must be one of --channels \[1, 4, 16, 32\], got 8"),
        (["--sizes", "1000"], "--sizes must be whole 16-byte vectors"),
        (["--warmup", "0"], "--warmup must be at least 1"),
    ],
)
def test_bad_settings_are_refused_before_any_rank_starts(argv, message):
    with pytest.raises(ValueError, match=message):
        run(parser().parse_args(argv))


# How each kernel family runs on CPU tensors: Triton's interpreter; the CUDA C++ kernels built for the
# host, 64 threads a block (as tests/workspace/test_small_allreduce.py runs them).
FAMILIES = {
    "triton": {"TRITON_INTERPRET": "1"},
    "cuda": {"GPUCOMM_CUDA_EMULATE": "1", "GPUCOMM_CUDA_EMULATE_THREADS": "64"},
}


def _env(kernels: str = "triton") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCOMM_")}
    return {**env, **FAMILIES[kernels], "OMP_NUM_THREADS": "1"}


# Triton 9 s here; the CUDA C++ family 5 s with its host build cached, 18 s with the build (the
# 2-core machine, 2026-11-29).
@pytest.mark.parametrize("kernels", ["triton", "cuda"])
def test_on_cpu_every_checked_row_is_right_and_the_model_flags_are_derived(tmp_path, kernels):
    out = tmp_path / "b.json"
    argv = [*SMALL, "--sizes", "16K", "--channels", "1", "2", "--copy-channels", "2", "--json", str(out)]
    cmd = [sys.executable, "-m", "gpucomm._bench.breakdown", "--kernels", kernels, *argv]
    proc = subprocess.run(cmd, text=True, capture_output=True, timeout=300, env=_env(kernels))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "THE TIMES MEAN NOTHING" in proc.stdout and "# check: PASS (5 checked rows)" in proc.stdout
    result = json.loads(out.read_text())
    assert result["check"] is True and result["settings"]["device"].endswith("cores")
    rows = {r["variant"]: r for r in result["steps"]}
    assert rows["full"]["wrong"] == 0 and rows["full"]["steps"] == "CSR"
    assert all(rows[v]["wrong"] is None for v in bp.VARIANTS if v != "full")  # unchecked
    assert [(r["channels"], r["wrong"]) for r in result["reduce"]] == [(1, 0), (2, 0)]
    assert [(r["copy"], r["wrong"]) for r in result["copy"]] == [("pull", 0), ("push", 0)]
    s = result["split_us"]["8"]
    times = {r["variant"]: r["time_us"] for r in result["steps"]}
    assert s["launch"] == times["empty"] and s["sync"] == pytest.approx(times["full"] - times["no_sync"])
    grid = saturating_grid({r["channels"]: r["gbps"] for r in result["reduce"]})
    flags = f"--launch-us {s['launch']:.2f} --sync-us {s['sync']:.2f} --saturating-grid {grid}"
    assert result["model_flags"] == flags and f"model flags: {flags}" in proc.stdout
    taken = model_parser().parse_args(flags.split())  # ready for python -m gpucomm._bench.model
    assert (taken.launch_us, taken.saturating_grid) == (round(s["launch"], 2), grid)


def test_a_full_row_without_its_reduce_is_caught(monkeypatch, capsys):
    for name, value in _env().items():
        monkeypatch.setenv(name, value)
    for name in [k for k in os.environ if k.startswith("GPUCOMM_")]:
        monkeypatch.delenv(name)
    assert run(parser().parse_args([*SMALL, "--sizes"]), rank=broken_rank) == 1
    text = capsys.readouterr().out
    assert "# check: FAIL (1 checked rows)" in text
    full = next(line for line in text.splitlines() if re.match(r"\s+8\s+oneshot\s+full\s", line))
    assert "CS " in full and "WRONG (4 elements)" in full  # 2 elements on each of 2 ranks


def test_the_gpu_defaults_are_valid_and_cuda_is_needed_for_them():
    """What bench/gpu_check.sh runs passes the settings' check; without CUDA it says so and exits 2."""
    from gpucomm._bench.breakdown import _check

    args = parser().parse_args(["--mps", "on"])
    _check(args)  # raises where a default contradicts another
    assert (args.device, args.channels, args.copy_channels) == ("cuda", [1, 4, 16, 32], 16)
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: bench/gpu_check.sh runs the benchmark itself")
    cmd = [sys.executable, "-m", "gpucomm._bench.breakdown", "--rounds", "1"]
    proc = subprocess.run(cmd, text=True, capture_output=True, timeout=120, env=_env())
    assert proc.returncode == 2 and "--device cuda needs a CUDA device" in proc.stderr, proc.stderr


def test_gpu_check_breakdown_fits_one_call():
    """bench/gpu_check.sh breakdown: a step per kernel family, each under its own limit, the limits
    summing to at most 300 s (a lent machine's call, beside the install and MPS), JSON into $work."""
    from pathlib import Path

    script = (Path(__file__).resolve().parents[2] / "bench" / "gpu_check.sh").read_text()
    start = script.index("\nbreakdown)")
    part = script[start : script.index("\n    ;;", start)]
    assert "for k in triton cuda; do" in part and 'step "breakdown_$k" "$limit"' in part
    assert sum(int(x) for x in re.findall(r"limit=(\d+)", part)) <= 300
    assert '--mps "$mps"' in part and '--json "$work/breakdown_$k.json"' in part and '--rounds "$rounds"' in part
    assert "|breakdown|" in script.splitlines()[script.splitlines().index("set -uo pipefail") + 1]
