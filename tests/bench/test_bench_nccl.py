"""gpucomm-bench --compare nccl in gpucomm's process layout, without a GPU: where NCCL can share a
GPU between ranks (2.30 and later, NCCL_MULTI_RANK_GPU_ENABLE=1 set at spawn), and the reason in
words where it cannot (fake versions and GPU counts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from gpucomm._bench import backends, launch
from gpucomm._bench.backends import NCCL_MULTI_RANK_ENV, nccl_refusal, nccl_shares_gpus, nccl_spawn_env
from gpucomm._bench.header import header_text
from gpucomm._bench.runner import Settings


@pytest.mark.parametrize(
    "version,shares",
    [
        ((2, 30, 0), True),
        ((2, 31, 2), True),
        ((3, 0, 1), True),
        ((2, 29, 9), False),
        ((2, 27, 3), False),
        (None, False),
    ],
)
def test_nccl_shares_a_gpu_from_2_30(version, shares):
    assert nccl_shares_gpus(version, 1, 4) is shares
    assert nccl_shares_gpus(version, 4, 4) is False  # a GPU per rank: nothing shared
    assert nccl_shares_gpus(version, 0, 4) is False  # no GPU at all


def test_nccl_refusal_says_why():
    assert nccl_refusal("cpu", True, (2, 30, 0), 1, 2, "1") == "nccl needs CUDA tensors and this run is on CPU"
    assert nccl_refusal("cuda", False, None, 1, 2, None) == "torch was built without NCCL"
    # A GPU per rank: any NCCL, the variable or not.
    assert nccl_refusal("cuda", True, (2, 21, 5), 8, 8, None) is None
    # Shared GPUs with an NCCL older than 2.30: the version, and from when it would run.
    old = nccl_refusal("cuda", True, (2, 27, 3), 1, 4, None)
    assert old == (
        "nccl: 4 local ranks would share 1 GPU(s), and NCCL 2.27.3 takes one GPU per rank (several "
        "ranks on one GPU from NCCL 2.30, with NCCL_MULTI_RANK_GPU_ENABLE=1)"
    )
    # New enough, but the variable missing from the ranks' environment (e.g. under torchrun).
    missing = nccl_refusal("cuda", True, (2, 30, 1), 1, 4, None)
    assert missing is not None and "NCCL 2.30.1 accepts that with NCCL_MULTI_RANK_GPU_ENABLE=1" in missing
    assert "it is None here" in missing
    assert nccl_refusal("cuda", True, (2, 30, 1), 1, 4, "1") is None


def _fake_host(monkeypatch, gpus: int, version) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(backends, "nccl_version", lambda: version)


@pytest.mark.parametrize(
    "gpus,version,nproc,expected",
    [
        (1, (2, 30, 0), 2, {NCCL_MULTI_RANK_ENV: "1"}),
        (2, (2, 30, 0), 4, {NCCL_MULTI_RANK_ENV: "1"}),
        (2, (2, 30, 0), 2, {}),  # a GPU per rank
        (1, (2, 29, 0), 2, {}),  # too old: the ranks say why instead
        (0, None, 2, {}),
    ],
)
def test_spawn_env_sets_the_variable_only_where_it_lets_nccl_run(monkeypatch, gpus, version, nproc, expected):
    _fake_host(monkeypatch, gpus, version)
    assert nccl_spawn_env(["gpucomm", "nccl"], "auto", nproc) == expected
    assert nccl_spawn_env(["gpucomm", "gloo"], "auto", nproc) == {}  # NCCL not asked for
    assert nccl_spawn_env(["gpucomm", "nccl"], "cpu", nproc) == {}


def _settings(backends_: list[str], device: str = "auto") -> Settings:
    return Settings(
        collectives=["all_reduce"],
        sizes=[8],
        dtype="float",
        op="sum",
        root=0,
        iters=1,
        warmup=0,
        check=True,
        backends=backends_,
        knobs={},
        device=device,
        timeout_s=None,
        seed=1,
        json_path=None,
        plot_path=None,
    )


def test_launch_puts_the_variable_in_every_spawned_rank_before_it_starts(monkeypatch):
    """The variable reaches the ranks through their spawn arguments, applied first thing in the
    rank (before any backend starts), never set in the parent mid-run."""
    _fake_host(monkeypatch, 1, (2, 30, 0))
    started = []

    class FakeProcess:
        def __init__(self, target, args):
            self.target, self.args, self.exitcode = target, args, 0

        def start(self):
            started.append(self.args)

        def is_alive(self):
            return False

        def join(self):
            pass

    class FakeContext:
        Process = FakeProcess

    monkeypatch.setattr(launch.multiprocessing, "get_context", lambda kind: FakeContext())
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv(NCCL_MULTI_RANK_ENV, raising=False)
    assert launch.launch(_settings(["gpucomm", "nccl"]), 3) == 0
    assert [args[-1] for args in started] == [{NCCL_MULTI_RANK_ENV: "1"}] * 3
    started.clear()
    assert launch.launch(_settings(["gpucomm", "gloo"]), 2) == 0
    assert [args[-1] for args in started] == [{}] * 2

    # In the rank: the variable is in its environment before run_rank starts any backend.
    seen = {}

    def run_rank(settings: Settings) -> int:
        seen["env"] = launch.os.environ.get(NCCL_MULTI_RANK_ENV)
        return 0

    monkeypatch.setattr(launch, "run_rank", run_rank)
    monkeypatch.setattr(launch.os, "environ", {})
    threads = torch.get_num_threads()  # _rank_main sets the rank's threads: this process's, here
    try:
        with pytest.raises(SystemExit):
            launch._rank_main(0, 2, 1234, _settings(["gpucomm", "nccl"]), None, {NCCL_MULTI_RANK_ENV: "1"})
    finally:
        torch.set_num_threads(threads)
    assert seen["env"] == "1"


def test_header_says_when_nccl_ranks_share_a_gpu():
    nccl = {"version": "2.30.0", "gpus": 1, "local_ranks": 2, "multi_rank_gpu": True, NCCL_MULTI_RANK_ENV: "1"}
    infos = [
        {
            "pid": 1,
            "host": "h",
            "device": "cuda:0",
            "device_name": "GPU",
            "cores": [0],
            "threads": 1,
            "threads_from": "--cpu-threads",
        }
    ] * 2
    text = header_text(_settings(["gpucomm", "nccl"]), 2, 1, None, torch.device("cuda", 0), infos, [], nccl)
    assert (
        "# nccl: NCCL 2.30.0, 2 local ranks on 1 GPU(s): NCCL_MULTI_RANK_GPU_ENABLE=1 in the ranks' environment" in text
    )
    alone = header_text(
        _settings(["gpucomm", "nccl"]),
        2,
        1,
        None,
        torch.device("cuda", 0),
        infos,
        [],
        {**nccl, "multi_rank_gpu": False},
    )
    assert "NCCL_MULTI_RANK_GPU_ENABLE" not in alone


def test_compare_nccl_on_cpu_says_why_in_each_table_and_keeps_the_ratios(tmp_path):
    """On CPU tensors every nccl table says why it did not run; gloo, which ran, gets a ratio."""
    out_json = tmp_path / "r.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCOMM_") and k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpucomm._bench.cli",
            "all_reduce",
            "--backend",
            "gloo",
            "--compare",
            "nccl",
            "--nproc",
            "2",
            "-b",
            "8",
            "-e",
            "64",
            "-f",
            "8",
            "-n",
            "2",
            "-w",
            "1",
            "--device",
            "cpu",
            "--json",
            str(out_json),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reason = "nccl needs CUDA tensors and this run is on CPU"
    assert f"# Collective test: all_reduce    backend: nccl\n# skipped: not run: {reason}" in proc.stdout
    data = json.loads(out_json.read_text())
    assert [(t["backend"], t["skipped"]) for t in data["tables"]] == [("gloo", None), ("nccl", f"not run: {reason}")]
    assert data["settings"]["nccl"] is None  # nccl did not run: no NCCL to describe
    # Nothing to set a ratio against: the cells carry an empty one.
    assert all(row[v]["ratio"] == {} for row in data["tables"][0]["rows"] for v in ("out_of_place", "in_place"))


def test_summary_says_why_nccl_did_not_run():
    from gpucomm._bench.summarize import table

    reason = "not run: nccl: 2 local ranks would share 1 GPU(s), and NCCL 2.27.3 takes one GPU per rank"
    data = {
        "settings": {"world_size": 2, "dtype": "float"},
        "tables": [
            {"backend": "gpucomm", "collective": "all_reduce", "rows": [], "skipped": None},
            {"backend": "nccl", "collective": "all_reduce", "rows": [], "skipped": reason},
        ],
    }
    assert table(data, "nccl") == f"**all_reduce**: nccl {reason}\n"
