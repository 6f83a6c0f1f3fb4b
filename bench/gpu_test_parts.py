"""tests/gpu in two parts, each one call of a lent GPU machine (10 minutes at most, install and MPS
included): ``bash bench/gpu_check.sh tests-a`` then ``tests-b``. Every case of tests/gpu is in
exactly one step of one part (tests/bench/test_bench.py collects each step's selection on CPU and checks
it).

``python3 -m gpucomm._bench.gpu_test_parts PART`` prints one line per step, quoted for the shell
(gpu_check.sh reads each with ``eval "set -- $line"``): its name, its time limit in seconds, then
pytest's arguments (the files and selection, plus ``-n 8`` where pytest-xdist is there for the
steps that spread over the host's cores).

Step limits come from the one H100 run so far (docs/results/2026-11-25-h100/*.log, MPS on, 16
cores), with margin for what it did not reach:

- the two kernel files: 672 of 1131 cases in 73 s on 4 workers, most of it compiles;
- the files that spawn ranks: 40 cases in 170 s; the slowest were DDP's set-ups (13-28 s each, one
  per world size and kernel family: four) and the async file's DDP and two-stream cases (7-24 s);
- the graph-timeout cases of test_program_cache_gpu wait out a communicator timeout (now 20 s,
  their peer sleeping 30 s); the fused comparison compiles several kernels (over 30 s).

Each part's limits add up to at most 520 s, leaving 80 s of the call to the install and MPS.
"""

from __future__ import annotations

import importlib.util
import shlex
import sys
from typing import NamedTuple

__all__ = ["Step", "PARTS", "pytest_args", "main"]


class Step(NamedTuple):
    name: str
    limit_s: int
    selection: tuple[str, ...]  # pytest's files and options that pick this step's cases
    spread: bool = False  # over the host's cores, where pytest-xdist is there


_G = "tests/gpu/"
# Whether launches through CuPy's Function and through gpucomm's launcher run in order on torch's
# stream: a few seconds, first (the H100 run's three unexplained results were CuPy's).
_ORDER = "in_order_on_torchs_current_stream or times_out_with_the_missing"
_KERNEL_FILES = (f"{_G}test_cuda_kernels.py", f"{_G}test_program_kernels.py")

PARTS: dict[str, tuple[Step, ...]] = {
    "tests-a": (
        # A few seconds (gpu_check.sh's brief part gives the same selection 40 s; the 20 s this step
        # had more went to tests_gpu_ranks_a).
        Step("tests_gpu_launch_order", 40, (f"{_G}test_cuda_kernels.py", "-k", _ORDER)),
        Step("tests_gpu_kernels", 230, (*_KERNEL_FILES, "-k", f"not ({_ORDER})"), spread=True),
        # The files that check fixes made without a GPU first, each a few seconds a case but the
        # async file (its DDP and two-stream cases took 7-24 s on the H100), and all_reduce_into
        # (never run on a GPU: five groups' set-ups and about 45 calls a kernel family, estimated
        # at 20-40 s a family from the set-ups and calls the H100 run timed; not measured).
        Step(
            "tests_gpu_ranks_a",
            250,
            tuple(
                f"{_G}{name}.py"
                for name in (
                    "test_repeat_launch_gpu",
                    "test_small_allreduce_gpu",
                    "test_all_reduce_into_gpu",
                    "test_caller_stream_gpu",
                    "test_async_gpu",
                    "test_cuda_ipc",
                    "test_symmetric_gpu",
                    "test_bench_timing_gpu",
                )
            ),
        ),
    ),
    "tests-b": (
        # Never run to the end on a GPU: graph replays and timeouts, a killed peer (4 s timeout),
        # every collective and algorithm on the workspace.
        Step(
            "tests_gpu_ranks_b",
            240,
            tuple(
                f"{_G}{name}.py"
                for name in (
                    "test_program_cache_gpu",
                    "test_stream_ordered_gpu",
                    "test_workspace_collectives_gpu",
                )
            ),
        ),
        # The fused comparison (several compiles) and DDP (four set-ups of 13-28 s) last.
        Step("tests_gpu_fused_ddp", 280, (f"{_G}test_fused_gpu.py", f"{_G}test_ddp_gpu.py")),
    ),
}


def pytest_args(step: Step, xdist: bool) -> list[str]:
    """The step's pytest arguments (selection, then workers where it spreads and xdist is there)."""
    return [*step.selection, *(["-n", "8"] if step.spread and xdist else [])]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] not in PARTS:
        print(f"usage: python -m gpucomm._bench.gpu_test_parts {{{'|'.join(PARTS)}}}", file=sys.stderr)
        return 2
    xdist = importlib.util.find_spec("xdist") is not None
    for step in PARTS[argv[0]]:
        print(shlex.join([step.name, str(step.limit_s), *pytest_args(step, xdist)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
