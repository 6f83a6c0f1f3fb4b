"""Overlapping buffers: every two-buffer collective gives the result separate buffers give.

The rule (docs/reliability.md, "Overlapping buffers"): an input that overlaps an output is
copied aside first, outputs that overlap each other are received apart and copied back in list
order, and torch's in-place forms run as they are. Each case of tests/support/overlap_cases.py runs on
the shared-memory workspace (torch kernels; the Triton kernels under the interpreter), on gloo
and on checked gloo, at 2, 3 and 4 ranks, against the call made on separate buffers.
"""

from __future__ import annotations

import pytest
import torch
from spawn import run_ranks

PIECE = 6  # elements per rank's piece: even, so that half a piece is a whole element


def _overlap_rank(rank: int, world_size: int, kernels: str, dtypes: list[str]) -> list[str]:
    import dataclasses

    from overlap_cases import cases, fill, run_case, separate_result

    import gpucomm as dist
    from gpucomm.comm.communicator import Communicator

    dist.init_process_group(transport="shm", kernels=kernels, timeout=60)
    world = dist.get_default_communicator()

    def apart(label: str, **knobs: object) -> Communicator:
        config = dataclasses.replace(world.config, **knobs)
        return Communicator(world.store, rank, world_size, prefix=f"{world.prefix}{label}/", config=config)

    reference = apart("reference", transport="gloo", check="off")
    paths = {
        "shm": world,
        "gloo": apart("gloo", transport="gloo", check="off"),
        "checked gloo": apart("checked", transport="gloo"),
    }
    if not world.paths().get("cpu", "").startswith("workspace"):
        return [f"the default communicator serves CPU tensors on {world.paths()}, not the workspace"]
    problems = []
    size = (2 * world_size + 2) * PIECE
    for name in dtypes:
        dtype = getattr(torch, name)
        for label, fn, outs, ins, root in cases(rank, world_size, PIECE):
            expected = separate_result(reference, fn, fill(rank, size, dtype), outs, ins, root)
            for path, comm in paths.items():
                got = run_case(comm, fn, fill(rank, size, dtype), outs, ins, root)
                if not torch.equal(got, expected):
                    problems.append(
                        f"{fn} ({label}, {name}) on {path}, rank {rank}: got {got.tolist()}, separate buffers give "
                        f"{expected.tolist()}"
                    )
    for comm in paths.values():
        if comm is not world:
            comm.close()
    reference.close()
    dist.destroy_process_group()
    return problems


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_overlapping_buffers_give_the_separate_buffer_result(world_size: int) -> None:
    # int16 is sent as bytes and reduced in an accumulation type (gpucomm.comm.dtypes): the staging
    # must come before that copy, and must hold for it too.
    results = run_ranks(_overlap_rank, world_size, "torch", ["float32", "int16"], timeout=300)
    problems = [p for per_rank in results for p in per_rank]
    assert not problems, f"{len(problems)} wrong:\n" + "\n".join(problems[:20])


def test_overlapping_buffers_triton_kernels_under_the_interpreter() -> None:
    """The emulated device path: the Triton program kernel on the shared-memory workspace."""
    results = run_ranks(_overlap_rank, 3, "triton", ["float32"], env={"TRITON_INTERPRET": "1"}, timeout=600)
    problems = [p for per_rank in results for p in per_rank]
    assert not problems, f"{len(problems)} wrong:\n" + "\n".join(problems[:20])


def test_in_place_forms_and_separate_buffers_are_not_staged() -> None:
    """torch's in-place forms and buffers that share no byte reach the path as the caller's own
    tensors (no copy); a partial overlap is staged."""
    from gpucomm.comm.validation import separate

    w, n, rank = 4, 6, 2
    out = torch.zeros(w * n)
    for inputs, outputs, forms in [
        ([out[rank * n : rank * n + n]], [out], {(0, 0): rank * n * 4}),  # all_gather_into_tensor
        ([out], [out[rank * n : rank * n + n]], {(0, 0): -rank * n * 4}),  # reduce_scatter_tensor
        ([out[rank * n : rank * n + n]], list(out.split(n)), {(0, rank): 0}),  # all_gather
        ([torch.zeros(n)], list(out.split(n)), {}),
    ]:
        sep = separate(inputs, outputs, forms)
        assert all(a is b for a, b in zip(sep.inputs + sep.outputs, inputs + outputs, strict=True)) and not sep.staged
    # The same views at another offset than the in-place form's: the input is copied aside.
    sep = separate([out[1 : 1 + n]], [out], {(0, 0): rank * n * 4})
    assert sep.inputs[0] is not out[1 : 1 + n] and sep.inputs[0].data_ptr() != out.data_ptr() + 4
    assert sep.outputs[0] is out and not sep.staged
    # Outputs that overlap each other are received apart, then copied back in list order.
    outputs = [out[0:n], out[n // 2 : n // 2 + n], out[2 * n : 3 * n]]
    sep = separate([torch.zeros(n)], outputs)
    assert [mine is outputs[i] for i, (mine, _) in enumerate(sep.staged)] == [True, True]
    assert sep.outputs[2] is outputs[2]
    sep.outputs[0].fill_(1)
    sep.outputs[1].fill_(2)
    sep.write_back()
    assert out[: n // 2].tolist() == [1] * (n // 2) and out[n // 2 : n // 2 + n].tolist() == [2] * n
