"""gpucomm-bench on CPU: torch's threads follow --bind, rows stream as each size finishes, nccl-tests'
options run or are refused with the reason, -d all / -o all, and the plot's log axes and legend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from gpucomm._bench.backends import gpucomm_api_available
from gpucomm._bench.cli import build_parser, main
from gpucomm._bench.combos import DTYPES, OPS, combos
from gpucomm._bench.nccl_flags import REFUSED, check_nccl_flags
from gpucomm._bench.sizes import linear_sweep
from gpucomm._bench.threads import plan_threads


def _env(**extra: str) -> dict[str, str]:
    # No OMP_NUM_THREADS from the shell (the case the bench must handle itself), no GPUCOMM_*, no
    # torchrun variables: the CLI spawns its own ranks.
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCOMM_")}
    for name in ("OMP_NUM_THREADS", "RANK", "WORLD_SIZE"):
        env.pop(name, None)
    return {**env, **extra}


def _bench(args: list[str], timeout: float = 150.0, **extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "gpucomm._bench.cli", *args]
    return subprocess.run(cmd, text=True, capture_output=True, timeout=timeout, env=_env(**extra))


GLOO_2 = ["--backend", "gloo", "--nproc", "2", "-n", "2", "-w", "1"]


def test_plan_threads_follows_the_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert plan_threads({3}, 2, None)[0] == 1
    assert plan_threads({0, 1, 2}, 2, None)[0] == 3
    assert plan_threads({0}, 2, 4) == (4, "--cpu-threads")
    available = len(os.sched_getaffinity(0))
    assert plan_threads(None, 2, None)[0] == max(1, available // 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert plan_threads(None, 2, None) == (None, "OMP_NUM_THREADS")  # unbound: the user's setting stands
    assert plan_threads({1}, 2, None)[0] == 1  # bound: the cores decide
    with pytest.raises(ValueError, match=r"plan_threads: expected --cpu-threads >= 1, got 0"):
        plan_threads({0}, 2, 0)


@pytest.mark.parametrize("extra,expected", [([], 1), (["--cpu-threads", "3"], 3)])
def test_a_bound_rank_runs_a_thread_per_core_and_says_so(tmp_path, extra, expected):
    """--bind core: torch in each rank runs 1 thread (its one core), unless --cpu-threads says otherwise;
    the header and the JSON give the count the rank's torch reports."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("--bind core needs a core per rank: 2 cores")
    out = tmp_path / "t.json"
    proc = _bench(["all_reduce", *GLOO_2, "-b", "8", "-e", "8", "--bind", "core", *extra, "--json", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = json.loads(out.read_text())["settings"]["ranks"]
    assert [r["threads"] for r in ranks] == [expected, expected]
    why = "--cpu-threads" if extra else "bound to 1 core (--bind)"
    # The threads the backends start for themselves (gloo's) run on every core (bench/service_threads.py).
    every = sorted(os.sched_getaffinity(0))
    assert [r["backend_threads_cores"] for r in ranks] == [every, every]
    assert f"# threads: torch runs {expected} per rank ({why}); the backends' own threads on cores " in proc.stdout
    assert f"cores {ranks[0]['cores'][0]} threads {expected}" in proc.stdout


def test_rows_stream_as_each_size_finishes(tmp_path):
    """Each row reaches the reader when its size is done: the first row arrives before the last
    size's timed calls run, at least half their measured time before the last row."""
    iters = 60
    cmd = [sys.executable, "-m", "gpucomm._bench.cli", "all_reduce", "--backend", "gloo", "--nproc", "2"]
    cmd += ["-b", "8", "-e", "2M", "-f", "512", "-n", str(iters), "-w", "0", "--json", str(tmp_path / "s.json")]
    proc = subprocess.Popen(cmd, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    arrivals, lines = [], []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("  ") and line.split()[0].isdigit() and len(line.split()) == 13:
            arrivals.append((int(line.split()[0]), time.monotonic()))
    assert proc.wait(timeout=150) == 0, "".join(lines) + proc.stderr.read()
    assert [size for size, _ in arrivals] == [8, 4096, 2097152], "".join(lines)
    report = json.loads((tmp_path / "s.json").read_text())
    last = report["tables"][0]["rows"][-1]["out_of_place"]["time_us"] * 1e-6
    gap = arrivals[-1][1] - arrivals[0][1]
    assert gap >= 0.5 * iters * last, (
        f"rows arrived {gap:.3f} s apart; the last size alone took >= {iters * last:.3f} s"
    )


@pytest.mark.skipif(not gpucomm_api_available(), reason="gpucomm's collective API is not in this install")
def test_several_backends_share_one_streamed_table():
    """gpucomm and gloo: one table, each size's rows in backend order with the name last, then each footer."""
    args = ["all_reduce", "--backend", "gpucomm", "--compare", "gloo", "--nproc", "2", "-n", "2", "-w", "1"]
    proc = _bench([*args, "-b", "8", "-e", "64", "-f", "8"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "# Collective test: all_reduce    backends: gpucomm, gloo (last column)" in proc.stdout
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("  ") and len(line.split()) == 14]
    assert [(r[0], r[-1]) for r in rows] == [("8", "gpucomm"), ("8", "gloo"), ("64", "gpucomm"), ("64", "gloo")]
    assert "#  gpucomm:\n# Out of bounds values : 0 OK" in proc.stdout
    assert "#  gloo:\n# Out of bounds values : 0 OK" in proc.stdout


@pytest.mark.parametrize("short,long,why", REFUSED)
def test_nccl_tests_options_are_refused_with_why(short, long, why, capsys):
    assert main(["all_reduce", short, "1", "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gpucomm-bench: {short}/{long} 1: not run here: ")
    assert (why or "only ") in err


def test_nccl_tests_options_that_run():
    args = build_parser().parse_args(["all_reduce", "-z", "0", "-a", "3", "-T", "12", "-i", "1K", "-e", "4K"])
    check_nccl_flags(args)  # -z 0 and -a 3 are what the bench does: accepted
    assert args.timeout == 12.0 and args.stepbytes == 1024
    assert linear_sweep(8, 4096, 1024) == [8, 1032, 2056, 3080]
    with pytest.raises(ValueError, match=r"linear_sweep: expected a step of at least 1 byte, got 0"):
        linear_sweep(8, 16, 0)


def test_stepbytes_and_stepfactor_together_are_refused(capsys):
    assert main(["all_reduce", "-i", "1K", "-f", "4", "--nproc", "2"]) == 2
    assert "-i/--stepbytes and -f/--stepfactor both given (1024, 4.0)" in capsys.readouterr().err


def test_combos_expand_all():
    assert combos("all", "all", True) == [(d, o) for d in DTYPES for o in OPS]
    assert combos("half", "all", False) == [("half", "sum")]  # the op does not change data movement
    assert combos("int32", "max", True) == [("int32", "max")]
    with pytest.raises(ValueError, match=r"combos: expected -d from .*, got 'int8'"):
        combos("int8", "sum", True)


def test_every_dtype_and_op_in_one_run(tmp_path):
    out = tmp_path / "all.json"
    proc = _bench(["all_reduce", *GLOO_2, "-b", "8", "-e", "8", "-d", "all", "-o", "all", "--json", str(out)])
    tables = json.loads(out.read_text())["tables"]
    ran = {(t["dtype"], t["op"]) for t in tables}
    assert ran == {(d, o) for d in DTYPES for o in OPS}, proc.stdout + proc.stderr
    assert "# Collective test: all_reduce    int64 max    backend: gloo" in proc.stdout
    # torch's gloo has no AVG of integer tensors ("result type Float can't be cast ... Int"): those
    # two tables say so, and as gloo is the backend under test the run fails (exit 1).
    errors = {(t["dtype"], t["op"]) for t in tables if t["error"]}
    assert errors == {("int32", "avg"), ("int64", "avg")}, [t["error"] for t in tables if t["error"]]
    assert proc.returncode == 1 and "# ERROR: rank 0: RuntimeError: result type Float" in proc.stdout
    for table in tables:
        if table["error"] is None:
            assert table["wrong"] == 0 and table["rows"][0]["type"] == table["dtype"]
            assert table["rows"][0]["redop"] == table["op"]


def test_a_collective_that_does_not_reduce_runs_once_per_dtype(tmp_path):
    out = tmp_path / "b.json"
    proc = _bench(["broadcast", *GLOO_2, "-b", "8", "-e", "8", "-d", "all", "-o", "all", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tables = json.loads(out.read_text())["tables"]
    assert [(t["dtype"], t["op"]) for t in tables] == [(d, None) for d in DTYPES]
    assert "# Collective test: broadcast    bfloat16    backend: gloo" in proc.stdout


def test_plot_has_log_axes_a_time_panel_and_a_legend_that_shows_dashes():
    from matplotlib.lines import Line2D

    from gpucomm._bench.plot import figure

    def cell(us: float) -> dict:
        return {"time_us": us, "busbw": 8 / us, "algbw": 8 / us}

    rows = [{"size": s, "out_of_place": cell(s / 10 + 5), "in_place": cell(s / 20 + 4)} for s in (8, 1024, 1 << 20)]
    tables = [{"backend": b, "collective": "all_reduce", "dtype": "float", "op": "sum", "rows": rows} for b in "ab"]
    fig = figure(tables, "t")
    bw_ax, time_ax = fig.axes[0], fig.axes[1]
    assert (bw_ax.get_ylabel(), time_ax.get_ylabel()) == ("busbw (GB/s)", "time (us)")
    for ax in (bw_ax, time_ax):
        assert ax.get_yscale() == "log" and ax.get_xscale() == "log"
        legend = ax.get_legend()
        styles = {text.get_text(): line.get_linestyle() for text, line in zip(legend.get_texts(), legend.get_lines())}
        assert styles == {"a out-of-place": "-", "a in-place": "--", "b out-of-place": "-", "b in-place": "--"}
        # A handle shorter than one dash, gap and dash reads as a solid line.
        assert legend.handlelength >= 3
        markers = {line.get_marker() for line in legend.get_lines() if isinstance(line, Line2D)}
        assert markers == {"o", "s"}
