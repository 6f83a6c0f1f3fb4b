"""The channel count from the ranks on one physical GPU (gpucomm.workspace.gpu_share): ranks are
counted by their GPU's UUID through the store, and the count divides a quarter of the SMs.

torch here has no CUDA: the GPU's properties are a stand-in with an H100's 132 SMs and a UUID."""

from __future__ import annotations

import datetime
import types

import pytest
import torch

from gpucomm.errors import CommTimeoutError
from gpucomm.workspace import gpu_share
from gpucomm.workspace.channels import layout_channels

GPU = torch.device("cuda", 0)


@pytest.fixture
def h100(monkeypatch):  # noqa: ANN201
    props = types.SimpleNamespace(multi_processor_count=132, uuid="6061-h100-0")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    return props


def test_a_quarter_of_an_h100s_sms_shared_by_the_ranks_on_it(h100) -> None:
    assert [layout_channels(0, "cuda", GPU, n) for n in (1, 2, 4, 8, 40)] == [32, 16, 8, 4, 1]
    assert layout_channels(0, "triton", GPU, 1) == 32
    with pytest.raises(ValueError, match="layout_channels: ranks_on_gpu must be at least 1, got 0"):
        layout_channels(0, "cuda", GPU, 0)


def _store(uuids: dict[int, str]) -> torch.distributed.HashStore:
    store = torch.distributed.HashStore()
    for rank, uuid in uuids.items():
        store.set(f"p/{rank}", uuid.encode())
    return store


def test_ranks_are_counted_by_their_gpus_uuid_not_by_what_each_process_sees(h100) -> None:
    # 8 ranks, 4 on this rank's GPU (rank 0's own entry is set by the call).
    others = {r: h100.uuid if r % 2 == 0 else "6061-h100-1" for r in range(1, 8)}
    assert gpu_share.ranks_on_gpu(_store(others), "p/", 0, 8, 5.0, h100.uuid) == 4
    assert gpu_share.node_channels(0, "cuda", GPU, _store(others), "p/", 0, 8, 5.0) == 8
    alone = {r: f"6061-h100-{r}" for r in range(1, 8)}
    assert gpu_share.node_channels(0, "cuda", GPU, _store(alone), "p/", 0, 8, 5.0) == 32


def test_no_exchange_where_the_count_is_not_from_the_sms(h100) -> None:
    empty = torch.distributed.HashStore()  # a call that waited on it would time out
    assert gpu_share.node_channels(3, "cuda", GPU, empty, "p/", 0, 8, 0.1) == 3
    assert gpu_share.node_channels(0, "torch", GPU, empty, "p/", 0, 8, 0.1) == 1
    assert gpu_share.node_channels(0, "cuda", torch.device("cpu"), empty, "p/", 0, 8, 0.1) == 1


def test_a_rank_that_never_says_its_gpu_is_named_in_the_timeout(h100) -> None:
    store = _store({1: h100.uuid})
    store.set_timeout(datetime.timedelta(seconds=0.2))
    with pytest.raises(CommTimeoutError, match=r"GPU identification.*rank\(s\) \[2\]"):
        gpu_share.ranks_on_gpu(store, "p/", 0, 3, 0.2, h100.uuid)
    with pytest.raises(ValueError, match="ranks_on_gpu: uuid must be a GPU's UUID, got ''"):
        gpu_share.ranks_on_gpu(store, "p/", 0, 3, 0.2, "")
