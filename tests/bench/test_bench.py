"""gpucomm-bench end to end on CPU: every collective with 2 ranks, the JSON, the plot, a planted error,
rounds against gloo, the path gpucomm took, --help, and the progress bar kept out of logs."""

from __future__ import annotations

import fcntl
import json
import math
import os
import pty
import re
import select
import statistics
import struct
import subprocess
import sys
import termios
import time

import pytest

from gpucomm._bench.backends import gpucomm_api_available
from gpucomm._bench.rounds import round_order
from gpucomm._bench.sizes import parse_size, size_sweep

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "alltoall",
    "sendrecv",
)
# nccl-tests' bus-bandwidth factors, written out again here rather than imported from the bench.
FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "alltoall": lambda n: (n - 1) / n,
    "gather": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "sendrecv": lambda n: 1.0,
}
# Collectives whose size is the buffer of all ranks' pieces (count = elements of one piece).
SPLIT = {"all_gather", "reduce_scatter", "alltoall", "gather", "scatter"}
NO_IN_PLACE = {"alltoall", "sendrecv"}
ELEM = {"float": 4, "half": 2, "bfloat16": 2, "int32": 4}
SMALL = ["-b", "8", "-e", "64K", "-f", "8", "-n", "3", "-w", "1"]
TINY = ["-b", "8", "-e", "512", "-f", "8", "-n", "2", "-w", "1"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BAR = re.compile(r"\d+%\|")  # tqdm's "  0%|" at the start of every drawing of the bar
requires_gpucomm = pytest.mark.skipif(
    not gpucomm_api_available(), reason="gpucomm's collective API is not in this install yet"
)


def _env(env: dict[str, str] | None) -> dict[str, str]:
    # gpucomm's defaults unless a test sets a variable: none inherited from the shell.
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCOMM_")}
    full_env.pop("RANK", None)  # the CLI must spawn its own ranks, not think it runs under torchrun
    full_env.pop("WORLD_SIZE", None)
    return {**full_env, **(env or {})}


def _bench(
    args: list[str], env: dict[str, str] | None = None, timeout: float = 150.0, **streams: object
) -> subprocess.CompletedProcess:
    streams = streams or {"capture_output": True}
    return subprocess.run(
        [sys.executable, "-m", "gpucomm._bench.cli", *args], text=True, timeout=timeout, env=_env(env), **streams
    )


def _bench_on_terminal(args: list[str], stderr_too: bool, timeout: float = 150.0) -> tuple[int, str, str]:
    """Run with stdout on a pseudo-terminal (stderr too, or a pipe): (exit status, terminal text, stderr)."""
    master, slave = pty.openpty()
    # A terminal has a size; tqdm draws nothing on one of 0 columns.
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpucomm._bench.cli", *args],
        env=_env(None),
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave if stderr_too else subprocess.PIPE,
    )
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    while select.select([master], [], [], max(0.0, deadline - time.monotonic()))[0]:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: every process holding the terminal has exited
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    stderr = proc.stderr.read().decode() if proc.stderr else ""
    code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    return code, b"".join(chunks).decode(errors="replace"), stderr


def _check_tables(data: dict, backends: list[str], collectives, world: int, dtype: str, max_bytes: int) -> None:
    """Every table of every backend: rows present, #wrong 0, the nccl-tests size and bandwidth rules."""
    assert [t["backend"] for t in data["tables"]] == [b for b in backends for _ in collectives]
    for table in data["tables"]:
        name = table["collective"]
        assert table["error"] is None, table["error"]
        assert table["wrong"] == 0
        assert table["rows"], f"{table['backend']} {name}: no rows"
        assert table["rows"][0]["size"] <= 16 and table["rows"][-1]["size"] <= max_bytes
        for row in table["rows"]:
            pieces = world if name in SPLIT else 1
            assert row["size"] == row["count"] * ELEM[dtype] * pieces
            variants = ["out_of_place"] if name in NO_IN_PLACE else ["out_of_place", "in_place"]
            if name in NO_IN_PLACE:
                assert row["in_place"] is None
            for variant in variants:
                cell = row[variant]
                assert cell["wrong"] == 0, (table["backend"], name, row["size"], variant)
                assert cell["time_us"] > 0
                assert math.isclose(cell["algbw"], row["size"] / (cell["time_us"] * 1e-6) / 1e9, rel_tol=1e-9)
                assert math.isclose(cell["busbw"], cell["algbw"] * FACTORS[name](world), rel_tol=1e-9)
                assert len(cell["rank_time_us"]) == world


@pytest.mark.parametrize(
    "size,expected", [("8", 8), ("1K", 1024), ("4M", 4 << 20), ("1G", 1 << 30), ("1.5k", 1536), ("64KB", 65536)]
)
def test_parse_size(size, expected):
    assert parse_size(size) == expected


@pytest.mark.parametrize("size", ["", "abc", "1X", "-8", "0.3"])
def test_parse_size_rejects(size):
    with pytest.raises(ValueError, match="parse_size"):
        parse_size(size)


def test_size_sweep():
    assert size_sweep(8, 65536, 8) == [8, 64, 512, 4096, 32768]
    assert size_sweep(1024, 1 << 20, 1) == [1024]
    with pytest.raises(ValueError, match="size_sweep"):
        size_sweep(64, 8, 2)


def test_round_order_alternates():
    assert [round_order(["gpucomm", "gloo", "nccl"], k) for k in range(3)] == [
        ["gpucomm", "gloo", "nccl"],
        ["nccl", "gloo", "gpucomm"],
        ["gpucomm", "gloo", "nccl"],
    ]


def test_gloo_all_collectives(tmp_path):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    proc = _bench(["all", "--backend", "gloo", "--nproc", "2", *SMALL, "--json", str(out_json), "--plot", str(out_png)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("# Out of bounds values : 0 OK") == len(COLLECTIVES)
    assert proc.stdout.rstrip().endswith("# OK")
    data = json.loads(out_json.read_text())
    assert data["failed"] is False
    assert data["settings"]["world_size"] == 2 and data["settings"]["backends"] == ["gloo"]
    _check_tables(data, ["gloo"], COLLECTIVES, 2, "float", 65536)
    assert out_png.read_bytes()[:8] == PNG_MAGIC


def test_gloo_odd_world_root_dtype_op(tmp_path):
    """Three ranks, a non-zero root, bf16 products: the check inputs stay exact."""
    out_json = tmp_path / "r.json"
    proc = _bench(
        [
            "all",
            "--backend",
            "gloo",
            "--nproc",
            "3",
            "-b",
            "8",
            "-e",
            "4K",
            "-f",
            "512",
            "-n",
            "2",
            "-w",
            "1",
            "-d",
            "bfloat16",
            "-o",
            "prod",
            "-r",
            "2",
            "--json",
            str(out_json),
        ]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out_json.read_text())
    _check_tables(data, ["gloo"], COLLECTIVES, 3, "bfloat16", 4096)
    rooted = [t for t in data["tables"] if t["collective"] in ("broadcast", "reduce", "gather", "scatter")]
    assert all(row["root"] == 2 for t in rooted for row in t["rows"])


@requires_gpucomm
def test_gpucomm_against_gloo(tmp_path):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    proc = _bench(
        [
            "all",
            "--backend",
            "gpucomm",
            "--compare",
            "gloo",
            "--nproc",
            "2",
            *SMALL,
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
        ]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out_json.read_text())
    # The library's default path, not knobs of the bench's choosing: on one host, CPU tensors go
    # to the shared-memory workspace; the header says so, as the started communicator words it.
    assert data["settings"]["gpucomm_knobs"] == {}
    served = data["settings"]["gpucomm"]
    assert served["config"]["transport"] == "auto"
    assert served["paths"]["cpu"].startswith("workspace transport=shm ")
    assert f"# gpucomm: cpu tensors -> {served['paths']['cpu']} (transport=auto kernels=auto algo=auto " in proc.stdout
    _check_tables(data, ["gpucomm", "gloo"], COLLECTIVES, 2, "float", 65536)
    assert out_png.read_bytes()[:8] == PNG_MAGIC


@requires_gpucomm
def test_transport_option_and_gpucomm_variables(tmp_path):
    """--transport gloo changes the path the header states; GPUCOMM_* variables reach gpucomm."""
    out_json = tmp_path / "r.json"
    proc = _bench(
        ["all_reduce", "--nproc", "2", *TINY, "--transport", "gloo", "--json", str(out_json)],
        env={"GPUCOMM_CHECK": "off", "GPUCOMM_TIMEOUT": "77"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "# gpucomm: cpu tensors -> gloo (transport=gloo kernels=auto algo=auto check=off)" in proc.stdout
    settings = json.loads(out_json.read_text())["settings"]
    assert settings["gpucomm_knobs"] == {"transport": "gloo"}
    assert settings["gpucomm"]["paths"]["cpu"] == "gloo"
    assert settings["gpucomm"]["config"]["timeout"] == 77.0  # not overridden by the bench's --timeout default


def _printed(text: str, us: float) -> bool:
    """Whether ``text`` is ``us`` as the tables print times (2, 1 or 0 decimals as it grows)."""
    half_step = 0.005 if us < 100 else 0.05 if us < 10000 else 0.5
    return abs(float(text) - us) <= half_step + 1e-9


def _comparison_rows(stdout: str, collective: str) -> list[list[str]]:
    """The data rows of one comparison table, split into fields."""
    lines = stdout.split(f"# Comparison: {collective} ", 1)[1].splitlines()[1:]
    rows = []
    for line in lines:
        if line.startswith("#") and rows:
            return rows
        if not line.startswith("#"):
            rows.append(line.split())
    raise AssertionError(f"comparison table of {collective} has no end")


@requires_gpucomm
def test_rounds_against_gloo(tmp_path):
    out_json = tmp_path / "r.json"
    proc = _bench(["all_reduce", "--compare", "gloo", "--nproc", "2", *TINY, "--rounds", "3", "--json", str(out_json)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "median over 3 rounds (backends in alternating order)" in proc.stdout
    data = json.loads(out_json.read_text())
    assert data["settings"]["rounds"] == 3
    _check_tables(data, ["gpucomm", "gloo"], ["all_reduce"], 2, "float", 512)
    times = {}  # (backend, size, variant) -> cell
    for table in data["tables"]:
        for row in table["rows"]:
            for variant in ("out_of_place", "in_place"):
                cell = row[variant]
                rounds = cell["round_time_us"]
                assert len(rounds) == 3
                assert cell["time_us"] == statistics.median(rounds)
                assert cell["time_min_us"] == min(rounds) <= cell["time_us"] <= cell["time_max_us"] == max(rounds)
                times[table["backend"], row["size"], variant] = cell
    # size, then per variant: gpucomm's "median [min-max]", gloo's, the ratio column.
    assert re.search(r"^#\s+size\s+gpucomm\s+gloo\s+gpucomm/gloo\s+gpucomm\s+gloo\s+gpucomm/gloo$", proc.stdout, re.M)
    rows = _comparison_rows(proc.stdout, "all_reduce")
    assert [int(r[0]) for r in rows] == [row["size"] for row in data["tables"][0]["rows"]]
    for fields in rows:
        size = int(fields[0])
        for variant, (ours, spread, _, _, ratio) in zip(("out_of_place", "in_place"), (fields[1:6], fields[6:11])):
            cell = times["gpucomm", size, variant]
            low, high = spread.strip("[]").split("-")
            for text, us in ((ours, cell["time_us"]), (low, cell["time_min_us"]), (high, cell["time_max_us"])):
                assert _printed(text, us), (text, us)
            expected = cell["time_us"] / times["gloo", size, variant]["time_us"]
            assert abs(float(ratio) - expected) <= 0.005 + 1e-9
            assert cell["ratio"] == {"gloo": expected}  # the JSON's ratio column
    # The markdown summary of the same JSON: one row per size, the same medians and ratios.
    summary = subprocess.run(
        [sys.executable, "-m", "gpucomm._bench.summarize", str(out_json)], capture_output=True, text=True, timeout=60
    )
    assert summary.returncode == 0, summary.stderr
    md_rows = [line.split("|")[1:-1] for line in summary.stdout.splitlines() if re.match(r"\| \d", line)]
    assert [r[0].strip() for r in md_rows] == [_size_label(row["size"]) for row in data["tables"][0]["rows"]]
    for fields, row in zip(md_rows, data["tables"][0]["rows"]):
        for variant, (ours, _, ratio) in zip(("out_of_place", "in_place"), (fields[1:4], fields[4:7])):
            cell = times["gpucomm", row["size"], variant]
            assert math.isclose(float(ours.split()[0]), cell["time_us"], rel_tol=5e-4), (ours, cell)  # 4 digits
            assert abs(float(ratio) - cell["time_us"] / times["gloo", row["size"], variant]["time_us"]) <= 0.005 + 1e-9


def _size_label(nbytes: int) -> str:
    return f"{nbytes // 1024} KiB" if nbytes >= 1024 and nbytes % 1024 == 0 else f"{nbytes} B"


@pytest.mark.parametrize("backend,rounds", [("gloo", 1), ("gpucomm", 2)])
def test_planted_error_fails(tmp_path, backend, rounds):
    if backend == "gpucomm" and not gpucomm_api_available():
        pytest.skip("gpucomm's collective API is not in this install yet")
    out_json = tmp_path / "r.json"
    proc = _bench(
        [
            "all_gather",
            "--backend",
            backend,
            "--nproc",
            "2",
            "-b",
            "8",
            "-e",
            "512",
            "-f",
            "8",
            "-n",
            "1",
            "-w",
            "0",
            "--rounds",
            str(rounds),
            "--json",
            str(out_json),
        ],
        env={"GPUCOMM_BENCH_PLANT_ERROR": "1"},
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "# Out of bounds values : " in proc.stdout and "FAILED" in proc.stdout
    data = json.loads(out_json.read_text())
    assert data["failed"] is True
    (table,) = data["tables"]
    # One corrupted element per checking rank (all ranks check all_gather), per row, variant and round.
    assert all(row[v]["wrong"] == 2 * rounds for row in table["rows"] for v in ("out_of_place", "in_place"))


def test_help_shows_every_default():
    proc = _bench(["--help"])
    assert proc.returncode == 0, proc.stderr
    # One block per option: its names, then its help, wrapped onto indented lines.
    section = proc.stdout.split("\noptions:\n", 1)[1]
    blocks = {b.split()[0].rstrip(","): " ".join(b.split()) for b in re.split(r"\n(?=  -)", section) if b.strip()}
    assert len(blocks) >= 24, list(blocks)  # -h and the 23 options of today
    for name, block in blocks.items():
        assert name == "-h" or "(default: " in block, block
    assert blocks["--rounds"].endswith("(default: 1)")
    assert blocks["-e"].endswith("(default: 32M)")


GLOO_TINY = ["all_reduce", "--backend", "gloo", "--nproc", "2", "-b", "8", "-e", "64", "-f", "8", "-n", "1", "-w", "0"]


def test_no_bar_in_one_log():
    """stdout and stderr into one pipe (CI, `2>&1`): the tables, and no progress bar among them."""
    proc = _bench(GLOO_TINY, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.returncode == 0, proc.stdout
    assert "# Out of bounds values : 0 OK" in proc.stdout
    assert not BAR.search(proc.stdout) and "\r" not in proc.stdout, proc.stdout


@pytest.mark.parametrize("stderr_too", [False, True], ids=["stderr-in-a-log", "both-on-a-terminal"])
def test_bar_only_when_both_streams_are_terminals(stderr_too):
    code, terminal, stderr = _bench_on_terminal(GLOO_TINY, stderr_too)
    assert code == 0, terminal + stderr
    assert "# Out of bounds values : 0 OK" in terminal
    assert bool(BAR.search(terminal)) is stderr_too, terminal
    assert not BAR.search(stderr), stderr


def test_kernels_cpu(tmp_path):
    out_json = tmp_path / "k.json"
    proc = _bench(
        [
            "kernels",
            "-b",
            "7",
            "-e",
            "4K",
            "-f",
            "8",
            "-n",
            "2",
            "-w",
            "1",
            "-d",
            "half",
            "-o",
            "avg",
            "--json",
            str(out_json),
        ]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "torch reference only" in proc.stdout
    data = json.loads(out_json.read_text())
    assert data["settings"]["implementations"] == ["torch"]
    rows = data["rows"]
    kernels = {r["kernel"] for r in rows}
    assert kernels == {"copy_", "copy", *(f"reduce{k}" for k in range(2, 9))}
    for row in rows:
        k = row["k"]
        assert row["wrong"] == (None if row["kernel"] == "copy_" else 0)
        assert math.isclose(row["gbps"], (k + 1) * row["size"] / (row["time_us"] * 1e-6) / 1e9, rel_tol=1e-9)
        roof = next(r for r in rows if r["size"] == row["size"] and r["kernel"] == "copy_")
        assert math.isclose(row["roof_fraction"], row["gbps"] / roof["gbps"], rel_tol=1e-9)


def test_bad_settings_exit_2():
    proc = _bench(["all_reduce", "--backend", "gloo", "--nproc", "2", "-r", "5", "-n", "1", "-w", "0", "-e", "8"])
    assert proc.returncode == 2
    assert "-r/--root must be in [0, 2), got 5" in proc.stderr


@pytest.mark.parametrize("bind", ["core", "none"])
def test_bind_sets_and_reports_each_ranks_cores(tmp_path, bind):
    cores = sorted(os.sched_getaffinity(0))
    nproc = min(2, len(cores))
    out_json = tmp_path / "b.json"
    proc = _bench([*GLOO_TINY[:4], str(nproc), *GLOO_TINY[5:], "--bind", bind, "--json", str(out_json)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = json.loads(out_json.read_text())["settings"]["ranks"]
    expected = [[c] for c in cores[:nproc]] if bind == "core" else [cores] * nproc
    assert [r["cores"] for r in ranks] == expected
    for r, rank_cores in enumerate(expected):
        shown = ",".join(map(str, rank_cores)) if len(rank_cores) <= 4 else f"{len(rank_cores)} cores"
        assert re.search(rf"^#  Rank\s+{r} .* cores {shown} threads \d+$", proc.stdout, re.M), proc.stdout


def test_bind_core_needs_a_core_per_rank():
    nproc = len(os.sched_getaffinity(0)) + 1
    proc = _bench([*GLOO_TINY[:4], str(nproc), *GLOO_TINY[5:], "--bind", "core"])
    assert proc.returncode == 2
    assert f"--bind core needs a core per rank: {nproc} ranks" in proc.stderr


def test_gpu_latency_says_it_needs_cuda():
    """The GPU latency benchmark (run by bench/gpu_check.sh on a lent GPU) parses its options and,
    where torch sees no CUDA device, says so and exits 2 instead of failing inside the ranks."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: bench/gpu_check.sh runs the benchmark itself")
    proc = subprocess.run(
        [sys.executable, "-m", "gpucomm._bench.gpu_latency", "--bytes", "8", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "needs a CUDA device" in proc.stderr, proc.stderr
    help_text = subprocess.run(
        [sys.executable, "-m", "gpucomm._bench.gpu_latency", "--help"], capture_output=True, text=True, timeout=120
    ).stdout
    assert "--per-graph" in help_text and "eager" in help_text


def test_cudagraph_refuses_what_it_cannot_capture(monkeypatch):
    """-G (nccl-tests' graph launches) is refused before any rank starts where it cannot run: on
    CPU tensors, and with gloo, whose calls copy through the host and cannot be captured."""
    import torch

    from gpucomm._bench import cli
    from gpucomm._bench.timing import time_graph

    proc = _bench(["all_reduce", "--backend", "gloo", "--nproc", "2", "-G", "5", "--device", "cpu", "-e", "8"])
    assert (
        proc.returncode == 2
        and "-G/--cudagraph replays a CUDA graph and needs CUDA tensors, got --device cpu" in proc.stderr
    )
    proc = _bench(["kernels", "-G", "5", "-e", "8"])
    assert proc.returncode == 2 and "needs CUDA tensors" in proc.stderr, proc.stderr
    assert _bench(["all_reduce", "-G", "-1", "-e", "8"]).returncode == 2
    # Past the device check (as on a GPU host): gloo anywhere in the run is refused.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for backends in (["--backend", "gloo"], ["--backend", "gpucomm", "--compare", "nccl,gloo"]):
        args = cli.build_parser().parse_args(["all_reduce", "-G", "5", *backends])
        with pytest.raises(ValueError, match="gloo's cannot be captured"):
            cli._check_cudagraph(args)
    cli._check_cudagraph(
        cli.build_parser().parse_args(["all_reduce", "-G", "5", "--backend", "gpucomm", "--compare", "nccl"])
    )
    with pytest.raises(ValueError, match="time_graph: CUDA graphs need a CUDA device, got cpu"):
        time_graph(lambda: None, torch.device("cpu"), 1, 1, 1)


def test_gpu_check_brief_runs_every_gpu_test_file():
    """bench/gpu_check.sh brief names the files of tests/gpu one by one (in the order they most need
    a GPU): a file added there and not named would never run on a lent GPU."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = (root / "bench" / "gpu_check.sh").read_text()
    brief = script[script.index("\nbrief)") : script.index("\n    ;;", script.index("\nbrief)"))]
    kernel_files = re.search(r'kernel_files="([^"]+)"', brief)[1].split()
    rank_files = re.search(r'rank_files="([^"]+)"', brief)[1].split()
    named = {Path(f).name for f in kernel_files} | {f"{name}.py" for name in rank_files}
    assert named == {p.name for p in (root / "tests" / "gpu").glob("test_*.py")}
    assert len(rank_files) == len(set(rank_files))


def _collected(args: list[str]) -> list[str]:
    """The test ids pytest collects for ``args`` here (tests/gpu's are collected on CPU and skipped)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [line for line in proc.stdout.splitlines() if "::" in line]


def test_the_gpu_check_parts_name_every_gpu_test_case_once():
    """bench/gpu_check.sh tests-a and tests-b (steps in bench/gpu_test_parts.py) together run every
    case of tests/gpu exactly once, within their calls' time."""
    from gpucomm._bench import gpu_test_parts

    everything = _collected(["tests/gpu"])
    named = [
        case
        for steps in gpu_test_parts.PARTS.values()
        for step in steps
        for case in _collected(gpu_test_parts.pytest_args(step, xdist=False))
    ]
    twice = sorted({case for case in named if named.count(case) > 1})
    assert twice == [], twice[:10]
    assert sorted(named) == sorted(everything), sorted(set(everything) ^ set(named))[:10]
    assert len(everything) > 1000  # the kernel files' cases: collected, not an empty selection
    for part, steps in gpu_test_parts.PARTS.items():
        # One call is 600 s; the install and MPS's probe take the rest.
        assert sum(step.limit_s for step in steps) <= 520, part


def test_bench_runs_without_tqdm(tmp_path):
    """A GPU machine installs gpucomm with --no-deps and has no network: the benchmark must run
    without tqdm, bar or no bar. Every process of the run (the CLI, its spawned ranks) finds a
    tqdm that cannot be imported first on its path."""
    (tmp_path / "tqdm.py").write_text("raise ImportError('tqdm is not installed here')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCOMM_") and k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    args = ["all_reduce", "--backend", "gloo", "--nproc", "2", "-b", "8", "-e", "64", "-f", "8", "-n", "1", "-w", "0"]
    proc = subprocess.run(
        [sys.executable, "-m", "gpucomm._bench.cli", *args], capture_output=True, text=True, timeout=150, env=env
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tqdm" not in proc.stderr
    assert "64" in proc.stdout  # the table's last row
