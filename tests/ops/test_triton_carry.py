"""The carried copies of the Triton program kernel (kernels/triton/carry.py), under the interpreter:
each channel moves exactly the bytes of the two copies at the in-half positions it owns, every one
once, whichever shares the fold's steps take, with 16-byte vectors (ALIGNED) and without.

A probe kernel runs what the program kernel's REDUCE runs for one channel (``carry_plan``, a share
of ``quota`` bytes in each of the fold's steps, then the rest) on host memory; the bytes copied are
compared with the ownership rule of gpucomm.workspace.channels (granule g is channel g % grid's),
each channel alone, so that a byte moved by the wrong channel, twice, or not at all fails. The
cases end the copies inside a 16-byte vector and inside a granule, with shares that start mid-copy
(the second copy's numbering starts on a whole vector), on a few threads a block so that a share
spans several iterations of the vector loop.

TRITON_INTERPRET=1 must be set before triton is imported, so the cases run in one subprocess (this
file run as a script), as tests/ops/test_cpu_kernels.py's Triton cases do.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

# Threads of the probe's block: small, so that a share spans several iterations of the vector loop
# (8 vectors a thread: 1 KiB an iteration at 8 threads).
LANES = 8


def _cases() -> list[dict]:
    """(copies' positions and sizes, granule, channels, steps of the fold, unit) drawn at random,
    and a few chosen: a first copy that ends inside a vector, so the second is numbered from the
    next whole one; more steps than shares; none at all."""
    rng = random.Random(20261129)
    cases = []
    for aligned in (True, False):
        for i in range(16):
            unit = rng.choice((1, 2, 4, 8))  # COPY_BYTES: ALIGNED still has copies of any size
            step = 16 if aligned else unit  # positions, addresses and the granule
            granule = step * rng.randint(1, 24) if aligned else unit * rng.randint(1, 40)
            channels = rng.randint(1, 4)
            pos1 = step * rng.randint(0, 40)
            n1 = unit * rng.randint(0, 700)
            pos2 = pos1 + n1 + step * rng.randint(0, 8)  # after the first, as a two-shot's two ranges
            pos2 = -(-pos2 // step) * step
            n2 = unit * rng.randint(0, 700)
            cases.append(dict(aligned=aligned, unit=unit, granule=granule, channels=channels, pos1=pos1,
                              n1=n1, pos2=pos2, n2=n2, steps=rng.randint(0, 6), fold=rng.randint(0, 3) * 2048,
                              name=f"{'aligned' if aligned else 'unaligned'}-{i}"))  # fmt: skip
    # The first copy's owned bytes end 8 bytes into a vector, shares of 16: the second from a whole vector.
    cases.append(dict(aligned=True, unit=8, granule=64, channels=3, pos1=16, n1=8 * 97, pos2=2048, n2=8 * 301,
                      steps=5, fold=6000, name="aligned-second-from-a-whole-vector"))  # fmt: skip
    return cases


def _worker() -> dict[str, str]:
    """Run every case of every channel under the interpreter; 'ok' or what went wrong, by case."""
    import torch
    from carry_probe import carry_probe

    from gpucomm._kernels.triton.types import COPY_ELEMS

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("test_triton_carry worker: run with TRITON_INTERPRET=1")

    report = {}
    for case in _cases():
        size = case["pos2"] + case["n2"] + 64
        gen = torch.Generator().manual_seed(len(report))
        src = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
        verdict = "ok"
        for channel in range(case["channels"]):
            # 16-byte aligned storage, the copies at their positions in it (as in a half).
            dst = torch.full((size,), 0xA5, dtype=torch.uint8)
            base_d, base_s = dst.data_ptr(), src.data_ptr()
            if (base_d | base_s) % 16:
                raise RuntimeError("test_triton_carry worker: host buffers not 16-byte aligned")
            carry_probe[(1,)](
                case["pos1"], case["n1"], base_d + case["pos1"], base_s + case["pos1"],
                case["pos2"], case["n2"], base_d + case["pos2"], base_s + case["pos2"],
                case["granule"], channel, case["channels"], case["fold"], case["steps"],
                COPY_ELEM=COPY_ELEMS[case["unit"]], COPY_BYTES=case["unit"], ALIGNED=case["aligned"], LANES=LANES,
            )  # fmt: skip
            want = torch.full((size,), 0xA5, dtype=torch.uint8)
            for pos, n in ((case["pos1"], case["n1"]), (case["pos2"], case["n2"])):
                x = torch.arange(pos, pos + n)
                mine = x[(x // case["granule"]) % case["channels"] == channel]
                want[mine] = src[mine]
            if not torch.equal(dst, want):
                wrong = (dst != want).nonzero().flatten()
                verdict = f"channel {channel}: {wrong.numel()} bytes wrong, first at {int(wrong[0])}"
                break
        report[case["name"]] = verdict
    return report


@pytest.fixture(scope="module")
def verdicts() -> dict[str, str]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__, "--worker"], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"carry worker failed (exit {proc.returncode}):\n{proc.stderr[-8000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", [case["name"] for case in _cases()])
def test_each_channel_moves_exactly_its_owned_bytes(verdicts: dict[str, str], name: str) -> None:
    assert verdicts[name] == "ok", verdicts[name]


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    print(json.dumps(_worker()))
