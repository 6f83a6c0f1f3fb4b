"""The examples of docs/torch-integration.md and README.md's usage example run as written.

Each example is a whole script (env:// rendezvous, as torchrun sets it up); a rank runs them one
after another, each with a port of its own, on the default path (the shared-memory workspace
here) and on gpucomm's gloo path (GPUCOMM_TRANSPORT=gloo).
"""

from __future__ import annotations

import os
import re

import pytest
from spawn import free_port, run_ranks

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def examples(path: str, marker: str = "<!-- example -->") -> list[str]:
    """The python blocks that follow ``marker`` in ``path``."""
    with open(os.path.join(_REPO, path)) as f:
        text = f.read()
    return re.findall(re.escape(marker) + r"\s*```python\n(.*?)```", text, re.S)


def readme_usage() -> str:
    with open(os.path.join(_REPO, "README.md")) as f:
        text = f.read()
    return re.search(r"## Use\n.*?```python\n(.*?)```", text, re.S).group(1)


def _run_scripts(rank: int, world_size: int, scripts: list[str], ports: list[int]) -> int:
    for script, port in zip(scripts, ports):
        os.environ["MASTER_PORT"] = str(port)
        # dont_inherit: compiled as the script file it is, without this module's __future__ imports
        # (a comm hook's annotations must be objects, as DDP reads them)
        exec(compile(script, "<example>", "exec", dont_inherit=True), {"__name__": "__main__"})  # noqa: S102 - the docs' own code
    return len(scripts)


def test_there_is_an_example_of_each_client() -> None:
    text = "\n".join(examples("docs/torch-integration.md"))
    for needle in (
        "DistributedDataParallel",
        "GpucommState",
        "fully_shard",
        "distribute_tensor",
        "torch.compile",
        "dcp.save",
        "batch_isend_irecv",
    ):
        assert needle in text, needle


@pytest.mark.parametrize("path", ["default", "gloo"])
def test_torch_integration_examples_run(path: str) -> None:
    scripts = examples("docs/torch-integration.md")
    env = {"OMP_NUM_THREADS": "1", **({"GPUCOMM_TRANSPORT": "gloo"} if path == "gloo" else {})}
    ran = run_ranks(_run_scripts, 2, scripts, [free_port() for _ in scripts], env=env, timeout=400)
    assert ran == [len(scripts)] * 2


def test_readme_usage_example_runs_on_this_host() -> None:
    script = readme_usage()
    assert "import gpucomm as dist" in script
    assert run_ranks(_run_scripts, 3, [script], [free_port()], env={"OMP_NUM_THREADS": "1"}, timeout=120) == [1] * 3


def test_readme_lists_every_knob() -> None:
    import dataclasses

    from gpucomm.config import Config

    with open(os.path.join(_REPO, "README.md")) as f:
        table = [line for line in f if line.startswith("| `GPUCOMM_")]
    listed = {line.split("`")[1] for line in table}
    knobs = {f"GPUCOMM_{field.name.upper()}" for field in dataclasses.fields(Config)}
    assert listed == knobs, f"missing from README: {sorted(knobs - listed)}; not knobs: {sorted(listed - knobs)}"
