"""Bad input raises a typed error naming the function, before any data moves, and never hangs.

Every check runs on two ranks at once: a rank that raised must not have sent anything, so the
collective that follows on both ranks still matches up (a half-started call would deadlock it
or corrupt it, and the harness timeout would catch that).
"""

from __future__ import annotations

import pytest
import torch
from spawn import run_ranks


def _bad_inputs(rank: int, world_size: int) -> list[str]:
    import gpucomm as dist

    problems: list[str] = []

    def expect(exc: type[BaseException], text: str, call) -> None:
        try:
            call()
        except exc as err:
            if text not in str(err):
                problems.append(f"{text!r} not in {err!r}")
        except BaseException as err:  # noqa: BLE001 - report the wrong type, whatever it is
            problems.append(f"expected {exc.__name__} with {text!r}, got {type(err).__name__}: {err}")
        else:
            problems.append(f"expected {exc.__name__} with {text!r}, nothing raised")

    t = torch.ones(4)
    expect(
        dist.NotInitializedError,
        "gpucomm.all_reduce: call gpucomm.init_process_group() first",
        lambda: dist.all_reduce(t),
    )
    dist.init_process_group(timeout=30)
    expect(dist.GpucommError, "already initialized", lambda: dist.init_process_group())
    expect(TypeError, "gpucomm.all_reduce: op must be a gpucomm.ReduceOp", lambda: dist.all_reduce(t, op="sum"))
    expect(TypeError, "gpucomm.all_reduce: tensor must be a torch.Tensor, got list", lambda: dist.all_reduce([1.0]))
    quantized = torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)
    expect(
        TypeError,
        "gpucomm.broadcast: tensor has dtype torch.qint8; supported dtypes are",
        lambda: dist.broadcast(quantized, src=0),
    )
    expect(
        TypeError,
        "gpucomm.all_reduce: ReduceOp.MAX is not defined on torch.complex64",
        lambda: dist.all_reduce(torch.ones(3, dtype=torch.complex64), op=dist.ReduceOp.MAX),
    )
    expect(
        TypeError,
        "gpucomm.reduce_scatter_tensor: ReduceOp.AVG is not defined on torch.bool",
        lambda: dist.reduce_scatter_tensor(
            torch.ones(2, dtype=torch.bool), torch.ones(4, dtype=torch.bool), op=dist.ReduceOp.AVG
        ),
    )
    expect(ValueError, "gpucomm.all_reduce: tensor must be contiguous", lambda: dist.all_reduce(torch.ones(4, 4).t()))
    expect(ValueError, "gpucomm.all_reduce: tensor is on meta", lambda: dist.all_reduce(torch.ones(4, device="meta")))
    expect(ValueError, "gpucomm.broadcast: src=5 is not a member of the group", lambda: dist.broadcast(t, src=5))
    expect(ValueError, "gpucomm.reduce: dst must be in [0, 2), got 7", lambda: dist.reduce(t, group_dst=7))
    expect(
        ValueError,
        "gpucomm.all_gather: tensor_list must hold world_size = 2 tensors, got 3",
        lambda: dist.all_gather([t, t, t], t),
    )
    expect(
        ValueError,
        "gpucomm.all_gather: tensor_list[1] must have 4 elements, got 5",
        lambda: dist.all_gather([t, torch.ones(5)], t),
    )
    expect(
        TypeError,
        "gpucomm.all_gather: tensor_list[0] has dtype torch.float64, expected torch.float32",
        lambda: dist.all_gather([t.double(), t.double()], t),
    )
    expect(
        ValueError,
        "gpucomm.all_gather_into_tensor: output_tensor (world_size x input) must have 8 elements, got 4",
        lambda: dist.all_gather_into_tensor(torch.empty(4), t),
    )
    expect(
        ValueError,
        "gpucomm.reduce_scatter_tensor: input (world_size x output) must have 8 elements, got 5",
        lambda: dist.reduce_scatter_tensor(t, torch.ones(5)),
    )
    expect(
        ValueError,
        "gpucomm.gather: gather_list is required on the destination rank",
        lambda: dist.gather(t, None, dst=rank),
    )
    expect(
        ValueError,
        "gpucomm.scatter: scatter_list must be None or empty on rank",
        lambda: dist.scatter(t, [t, t], src=1 - rank),
    )
    expect(
        ValueError,
        "gpucomm.all_to_all_single: input_split_sizes sums to 3, but dim 0 of the tensor is 4",
        lambda: dist.all_to_all_single(torch.empty(4), t, [2, 2], [1, 2]),
    )
    expect(
        ValueError,
        "gpucomm.all_to_all_single: dim 0 of the tensor (5) must divide by world_size = 2",
        lambda: dist.all_to_all_single(torch.empty(5), torch.ones(5)),
    )
    expect(ValueError, "gpucomm.isend: dst must be another rank", lambda: dist.isend(t, dst=rank))
    expect(ValueError, "gpucomm.send: dst must be in [0, 2), got 9", lambda: dist.send(t, group_dst=9))
    expect(ValueError, "gpucomm.irecv: tag must be a non-negative int", lambda: dist.irecv(t, src=1 - rank, tag=-1))
    expect(
        TypeError,
        "gpucomm.all_reduce: group must be a group from gpucomm.new_group()",
        lambda: dist.all_reduce(t, group="world"),
    )
    # Nothing moved: both ranks still agree on the next collective.
    check = torch.full((3,), float(rank + 1))
    dist.all_reduce(check)
    if check.tolist() != [3.0, 3.0, 3.0]:
        problems.append(f"all_reduce after the bad calls gave {check.tolist()}")
    dist.destroy_process_group()
    return problems


def test_bad_inputs_raise_typed_errors_and_move_nothing() -> None:
    for problems in run_ranks(_bad_inputs, 2, timeout=120):
        assert not problems, "\n".join(problems)


def _bad_knobs(rank: int, world_size: int) -> list[str]:
    import gpucomm

    problems = []
    for knobs, exc, text in [
        ({"transport": "nvlink"}, ValueError, "GPUCOMM_TRANSPORT must be one of"),
        ({"kernels": "cuda"}, gpucomm.UnsupportedError, "GPUCOMM_KERNELS=cuda needs a CUDA device"),
        ({"transport": "cuda_ipc"}, gpucomm.UnsupportedError, "GPUCOMM_TRANSPORT=cuda_ipc needs a CUDA device"),
        ({"workspace_bytes": 16}, ValueError, "GPUCOMM_WORKSPACE_BYTES must be at least"),
        ({"timeout": -1}, ValueError, "init_process_group: timeout must be a positive number"),
        ({"bogus": 1}, TypeError, "unknown knob(s) ['bogus']"),
    ]:
        try:
            gpucomm.init_process_group(**knobs)
        except exc as err:
            if text not in str(err):
                problems.append(f"{knobs}: {text!r} not in {err}")
        else:
            problems.append(f"{knobs}: nothing raised")
            gpucomm.destroy_process_group()
    return problems


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the errors of a host without CUDA")
def test_knobs_this_host_cannot_honour_are_errors() -> None:
    for problems in run_ranks(_bad_knobs, 1, timeout=120):
        assert not problems, "\n".join(problems)
