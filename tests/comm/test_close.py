"""Closing a broken communicator: every step is tried past one that fails, the first failure
raised after the last (gpucomm/comm/communicator.py), so that a workspace whose release refuses (a
device whose synchronize raises after a kernel fault) does not keep the flight record, the
other engines or the gloo group from being freed."""

from __future__ import annotations

from spawn import run_ranks

ENV = {"GPUCOMM_TRANSPORT": "shm"}


def _rank_engine_close_fails(rank, world_size):
    import gpucomm
    from gpucomm.errors import GpucommError

    gpucomm.init_process_group(timeout=30)
    comm = gpucomm.get_default_communicator()
    engines = list(comm._engines.values())
    closed = []

    def refuse():
        closed.append("refused")
        raise GpucommError("release refused (faked)")

    real = engines[0].close
    engines[0].close = refuse
    try:
        comm.close()
        raised = None
    except GpucommError as exc:
        raised = str(exc)
    real()  # what the faked refusal skipped: this test frees it itself
    return raised, closed, comm._own_record is None and comm._signal is None, comm.closed, len(engines)


def test_close_goes_on_past_an_engine_that_refuses_and_raises_its_error():
    for raised, closed, record_closed, comm_closed, engines in run_ranks(
        _rank_engine_close_fails, 2, env=ENV, timeout=120
    ):
        assert engines >= 1 and closed == ["refused"]
        assert raised == "release refused (faked)"
        assert record_closed and comm_closed, "the flight record is closed past the refused engine"
