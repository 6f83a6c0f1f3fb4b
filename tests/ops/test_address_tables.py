"""The address tables CudaKernels and TritonKernels launch with are held by the launching stream
(``record_stream``), so a table dropped from the full cache is not reused while a launch on
another stream still reads it. No GPU: torch's stream and a table on CUDA are stood in for."""

from __future__ import annotations

import types

import torch

from gpucomm.ops import cuda_ops, tables, triton_ops


def test_a_table_on_cuda_is_recorded_on_the_current_stream(monkeypatch) -> None:
    streams = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: ("stream of", device))
    table = types.SimpleNamespace(device=torch.device("cuda", 1), record_stream=streams.append)
    assert tables.held(table) is table
    assert streams == [("stream of", torch.device("cuda", 1))]
    on_cpu = torch.zeros(2, dtype=torch.int64)
    assert tables.held(on_cpu) is on_cpu  # nothing to hold on the CPU


def _recording(monkeypatch, module) -> list:  # noqa: ANN001
    held = []
    monkeypatch.setattr(module, "held", lambda table: held.append(table) or table)
    return held


def test_cuda_kernels_tables_are_held_by_every_launch_that_reads_them(monkeypatch) -> None:
    held = _recording(monkeypatch, cuda_ops)
    kernels = cuda_ops.CudaKernels.__new__(cuda_ops.CudaKernels)
    kernels._device, kernels._tables = torch.device("cpu"), {}
    first = kernels._table([0x1000, 0x2000])
    again = kernels._table([0x1000, 0x2000])  # from the cache: held again, by this launch's stream
    assert again is first and held == [first, first]


def test_triton_kernels_tables_are_held_by_every_launch_that_reads_them(monkeypatch) -> None:
    held = _recording(monkeypatch, triton_ops)
    kernels = triton_ops.TritonKernels(torch.device("cpu"))
    first = kernels._table([0x1000, 0x2000])
    again = kernels._table([0x1000, 0x2000])
    assert again is first and held == [first, first]
