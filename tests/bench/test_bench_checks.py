"""The benchmarks check what they time: gpucomm-bench's rows go wrong, and the run fails, when
its collective is right on its first calls and then silently does nothing; a right one passes.
And the convention that makes one figure of every rank's times."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from gpucomm._bench.backends import gpucomm_api_available
from gpucomm._bench.collectives import Case, rank_values
from gpucomm._bench.timing import count_wrong, slowest_rank

# Run as each rank (torchrun's variables set): all_reduce of the backend under test (and gpucomm's
# all_reduce_into) is wrapped so that each tensor gets RIGHT right calls and every later call on it
# returns without writing (each rank keeps its own input: the class of failure a check before the
# timed calls misses).
LAZY_RANK = """
import sys
import torch.distributed as dist
import gpucomm
from gpucomm._bench.cli import main

backend, right = sys.argv[1], int(sys.argv[2])
mod = dist if backend == "gloo" else gpucomm

def lazily(real):
    # The buffer written is the first argument: all_reduce's tensor, all_reduce_into's output.
    def lazy(out, *args, **kwargs):
        out._calls = getattr(out, "_calls", 0) + 1
        if out._calls > right:
            return None
        return real(out, *args, **kwargs)
    return lazy

mod.all_reduce = lazily(mod.all_reduce)
if backend != "gloo":  # gpucomm's out-of-place column times all_reduce_into(output, input)
    mod.all_reduce_into = lazily(mod.all_reduce_into)
sys.exit(main(sys.argv[3:]))
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_ranks(backend: str, right: int, bench_args: list[str], world: int = 2) -> list[subprocess.CompletedProcess]:
    port = _free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("GPUCOMM_")}
    procs = []
    for rank in range(world):
        env = {
            **base,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", LAZY_RANK, backend, str(right), *bench_args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    done = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


BACKENDS = [
    "gloo",
    pytest.param(
        "gpucomm",
        marks=pytest.mark.skipif(not gpucomm_api_available(), reason="gpucomm's collective API is not in this install"),
    ),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_collective_that_stops_writing_after_its_first_call_fails_every_row(tmp_path, backend):
    """Right on each buffer's first call, then nothing: a check of the first call passes it, the
    check after the timed calls does not."""
    out_json = tmp_path / "r.json"
    args = [
        "all_reduce",
        "--backend",
        backend,
        "-b",
        "8",
        "-e",
        "4K",
        "-f",
        "8",
        "-n",
        "3",
        "-w",
        "1",
        "--device",
        "cpu",
        "--json",
        str(out_json),
    ]
    ranks = _run_ranks(backend, 1, args)
    logs = "".join(p.stdout + p.stderr for p in ranks)
    assert [p.returncode for p in ranks] == [1, 1], logs
    assert "# check: one call after the timed calls, inputs reset before it, on every rank" in ranks[0].stdout
    assert "# Out of bounds values : " in ranks[0].stdout and "FAILED" in ranks[0].stdout, logs
    data = json.loads(out_json.read_text())
    assert data["failed"] is True
    (table,) = data["tables"]
    assert len(table["rows"]) == 4  # 8 B, 64 B, 512 B, 4 KiB
    for row in table["rows"]:
        # Each rank holds its own input where the sum was due: wrong wherever the other rank's
        # input is not 0 (inputs rebuilt from the run's seed, as the bench builds them).
        case = Case(0, 2, row["count"], torch.float32, torch.device("cpu"), "sum", 0, data["settings"]["seed"])
        inputs = [rank_values(case, r, row["count"], "sum") for r in range(2)]
        expected = sum(int((inputs[1 - r] != 0).sum()) for r in range(2))
        assert expected > 0
        for variant in ("out_of_place", "in_place"):
            # gpucomm's out-of-place call is all_reduce_into(recv, send): one that writes nothing
            # leaves its output as the check poisoned it, every element of both ranks wrong.
            native = backend == "gpucomm" and variant == "out_of_place"
            want = 2 * row["count"] if native else expected
            assert row[variant]["wrong"] == want, (row["size"], variant, row[variant])


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_same_collective_right_on_every_call_passes(tmp_path, backend):
    out_json = tmp_path / "r.json"
    args = [
        "all_reduce",
        "--backend",
        backend,
        "-b",
        "8",
        "-e",
        "4K",
        "-f",
        "8",
        "-n",
        "3",
        "-w",
        "1",
        "--device",
        "cpu",
        "--json",
        str(out_json),
    ]
    ranks = _run_ranks(backend, 10**9, args)
    logs = "".join(p.stdout + p.stderr for p in ranks)
    assert [p.returncode for p in ranks] == [0, 0], logs
    assert ranks[0].stdout.rstrip().endswith("# OK"), logs
    data = json.loads(out_json.read_text())
    assert data["failed"] is False
    assert all(row[v]["wrong"] == 0 for row in data["tables"][0]["rows"] for v in ("out_of_place", "in_place"))


def test_slowest_rank_takes_each_iterations_slowest_then_the_median():
    # Rank 1 is slow on iteration 0, rank 0 on iterations 1 and 2: per iteration 5, 4, 6 -> 5.
    # (The mean over ranks of their medians, the old figure, would be 2.5.)
    assert slowest_rank([[1.0, 4.0, 6.0], [5.0, 1.0, 1.0]]) == 5.0
    assert slowest_rank([[3.0]]) == 3.0
    with pytest.raises(ValueError, match="slowest_rank: expected .* got \\[2, 1\\]"):
        slowest_rank([[1.0, 2.0], [1.0]])
    with pytest.raises(ValueError, match="slowest_rank"):
        slowest_rank([])


def test_count_wrong_counts_poison_and_refuses_other_shapes():
    got = torch.tensor([1.0, float("nan"), 3.0])
    assert count_wrong(got, torch.tensor([1.0, 2.0, 3.0])) == 1
    with pytest.raises(ValueError, match="count_wrong: expected the shape \\(2,\\), got \\(3,\\)"):
        count_wrong(got, torch.zeros(2))


class _LazyKernels:
    """The torch kernels, right on their first ``right`` calls and then returning without writing."""

    def __init__(self, inner, right: int) -> None:
        self.inner, self.right, self.calls = inner, right, 0

    def _go(self) -> bool:
        self.calls += 1
        return self.calls <= self.right

    def copy(self, *args, **kwargs):
        return self.inner.copy(*args, **kwargs) if self._go() else None

    def reduce(self, *args, **kwargs):
        return self.inner.reduce(*args, **kwargs) if self._go() else None


@pytest.mark.parametrize("right", [1, 10**9], ids=["stops-after-one-call", "right-on-every-call"])
def test_kernels_bench_checks_a_call_after_the_timed_ones(tmp_path, monkeypatch, capsys, right):
    from gpucomm._bench import kernels_bench

    real = kernels_bench.get_kernels
    monkeypatch.setattr(kernels_bench, "get_kernels", lambda name, device: _LazyKernels(real(name, device), right))
    out_json = tmp_path / "k.json"
    code = kernels_bench.run_kernels([64, 4096], "float", "sum", 2, 0, True, "cpu", str(out_json), None, [])
    rows = [r for r in json.loads(out_json.read_text())["rows"] if r["kernel"] != "copy_"]
    assert len(rows) == 2 * 8  # copy and reduce2..reduce8 at each size
    if right == 1:
        # Only the first call of the run wrote; each checked call came after timed ones, wrote nothing and left the
        # poisoned output: every element wrong.
        assert code == 1 and "# FAILED" in capsys.readouterr().out
        assert all(r["wrong"] == r["count"] for r in rows), [(r["size"], r["kernel"], r["wrong"]) for r in rows]
    else:
        assert code == 0 and all(r["wrong"] == 0 for r in rows)


# A main script for the spawning bench modules: spawned ranks run its top level (not the main
# block) before their target, so the wrapped Communicator.all_reduce is theirs too.
LAZY_MAIN = """
import importlib
import sys

from gpucomm.comm.communicator import Communicator

RIGHT = {right}
real = Communicator.all_reduce


def lazy(self, tensor, *args, **kwargs):
    tensor._calls = getattr(tensor, "_calls", 0) + 1
    if tensor._calls > RIGHT:
        return None
    return real(self, tensor, *args, **kwargs)


Communicator.all_reduce = lazy

if __name__ == "__main__":
    sys.exit(importlib.import_module(sys.argv[1]).main(sys.argv[2:]))
"""


def _lazy_main(tmp_path, right: int, module: str, args: list[str]) -> subprocess.CompletedProcess:
    script = tmp_path / "lazy_main.py"
    script.write_text(LAZY_MAIN.format(right=right))
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCOMM_")}
    return subprocess.run(
        [sys.executable, str(script), module, *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**env, "OMP_NUM_THREADS": "1"},
    )


@pytest.mark.skipif(not gpucomm_api_available(), reason="gpucomm's collective API is not in this install")
@pytest.mark.parametrize("right", [1, 10**9], ids=["stops-after-one-call", "right-on-every-call"])
def test_symmetric_bench_checks_a_call_after_the_timed_ones(tmp_path, right):
    """bench/symmetric.py's op is AVG: after one right call every value is already the mean, so a
    check without refilled inputs passes a collective that then does nothing."""
    out_json = tmp_path / "s.json"
    proc = _lazy_main(
        tmp_path,
        right,
        "gpucomm._bench.symmetric",
        ["--nproc", "2", "--max-bytes", "32", "--rounds", "1", "--json", str(out_json)],
    )
    rows = json.loads(out_json.read_text())["rows"]
    assert [r["bytes"] for r in rows] == [8, 32]
    series = ["ordinary", "ordinary_2shot", "symmetric", "symmetric_2shot"]
    if right == 1:
        assert proc.returncode == 1 and "results: WRONG" in proc.stdout, proc.stdout + proc.stderr
        assert all(r["wrong"] == series for r in rows), rows
    else:
        assert proc.returncode == 0 and "results: all correct" in proc.stdout, proc.stdout + proc.stderr
        assert all(r["wrong"] == [] for r in rows), rows


@pytest.mark.skipif(not gpucomm_api_available(), reason="gpucomm's collective API is not in this install")
def test_fused_bench_checks_a_call_after_the_timed_ones(tmp_path):
    """bench/fused.py on the Triton interpreter, gpucomm's all_reduce right on each tensor's first
    call only: both one-shot sides, which reduce one tensor on every call, are wrong against the
    reference, though their first call (the old check, at the warm-up) was right."""
    out_json = tmp_path / "f.json"
    proc = _lazy_main(
        tmp_path,
        1,
        "gpucomm._bench.fused",
        [
            "--nproc",
            "2",
            "--device",
            "cpu",
            "--hidden",
            "64",
            "--tokens",
            "2",
            "--m",
            "4",
            "--k",
            "16",
            "--n",
            "8",
            "--oneshot",
            "4",
            "--rounds",
            "1",
            "--calls",
            "2",
            "--json",
            str(out_json),
        ],
    )
    assert proc.returncode == 1 and "results: WRONG" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    rows = {r["pair"]: r["wrong"] for r in json.loads(out_json.read_text())["rows"]}
    # The unfused rmsnorm reduces a fresh clone on every call: right each time.
    assert rows["rmsnorm 2"] == []
    assert rows["oneshot 4"] == [
        f"oneshot 4: {kind} differs from the reference" for _ in range(2) for kind in ("fused", "unfused")
    ]
    assert rows["ag_matmul"] == []  # all_gather, not all_reduce: untouched, and right
