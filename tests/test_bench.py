"""gpucomm-bench end to end on CPU: every collective with 2 ranks, the JSON, the plot, a planted error."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from gpucomm._bench.backends import gpucomm_api_available
from gpucomm._bench.sizes import parse_size, size_sweep

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "gather", "scatter",
               "alltoall", "sendrecv")
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
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _bench(args: list[str], env: dict[str, str] | None = None, timeout: float = 150.0) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    full_env.pop("RANK", None)  # the CLI must spawn its own ranks, not think it runs under torchrun
    full_env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-m", "gpucomm._bench.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env)


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


@pytest.mark.parametrize("size,expected", [("8", 8), ("1K", 1024), ("4M", 4 << 20), ("1G", 1 << 30), ("1.5k", 1536),
                                           ("64KB", 65536)])
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
    proc = _bench(["all", "--backend", "gloo", "--nproc", "3", "-b", "8", "-e", "4K", "-f", "512", "-n", "2", "-w", "1",
                   "-d", "bfloat16", "-o", "prod", "-r", "2", "--json", str(out_json)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out_json.read_text())
    _check_tables(data, ["gloo"], COLLECTIVES, 3, "bfloat16", 4096)
    rooted = [t for t in data["tables"] if t["collective"] in ("broadcast", "reduce", "gather", "scatter")]
    assert all(row["root"] == 2 for t in rooted for row in t["rows"])


@pytest.mark.skipif(not gpucomm_api_available(), reason="gpucomm's collective API is not in this install yet")
def test_gpucomm_against_gloo(tmp_path):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    proc = _bench(["all", "--backend", "gpucomm", "--compare", "gloo", "--nproc", "2", *SMALL,
                   "--json", str(out_json), "--plot", str(out_png)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "transport=shm" in proc.stdout and "kernels=torch" in proc.stdout  # the CPU defaults, said
    data = json.loads(out_json.read_text())
    assert data["settings"]["gpucomm_knobs"] == {"transport": "shm", "kernels": "torch"}
    _check_tables(data, ["gpucomm", "gloo"], COLLECTIVES, 2, "float", 65536)
    assert out_png.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("backend", ["gloo", "gpucomm"])
def test_planted_error_fails(tmp_path, backend):
    if backend == "gpucomm" and not gpucomm_api_available():
        pytest.skip("gpucomm's collective API is not in this install yet")
    out_json = tmp_path / "r.json"
    proc = _bench(["all_gather", "--backend", backend, "--nproc", "2", "-b", "8", "-e", "512", "-f", "8", "-n", "1",
                   "-w", "0", "--json", str(out_json)], env={"GPUCOMM_BENCH_PLANT_ERROR": "1"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "# Out of bounds values : " in proc.stdout and "FAILED" in proc.stdout
    data = json.loads(out_json.read_text())
    assert data["failed"] is True
    (table,) = data["tables"]
    # One corrupted element per checking rank (all ranks check all_gather), per row and variant.
    assert all(row[v]["wrong"] == 2 for row in table["rows"] for v in ("out_of_place", "in_place"))


def test_kernels_cpu(tmp_path):
    out_json = tmp_path / "k.json"
    proc = _bench(["kernels", "-b", "7", "-e", "4K", "-f", "8", "-n", "2", "-w", "1", "-d", "half", "-o", "avg",
                   "--json", str(out_json)])
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
