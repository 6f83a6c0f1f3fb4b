"""``all_reduce_into(output, input)``: all_reduce's result in another tensor, the input left as it is.

torch.distributed has no such call: its users write ``out.copy_(x)`` and then ``all_reduce(out)``, a
pass over the data of its own. On the workspace that pass is not needed: the programs copy the input
into the workspace anyway and write the result out at the end, so an out-of-place program reads
``input`` where the in-place one reads the tensor and stores into ``output`` (gpucomm.workspace.into).
Where no such program serves the call, this module (or the engine) runs that copy and then the
in-place call, in the same order on the same stream:

- the gloo path (gloo has no out-of-place all_reduce);
- a dtype or op that travels in another form (gpucomm.comm.dtypes: int8 as int32, float8 as
  float32, PREMUL_SUM's scaled copy), a lazy view, a CUDA graph capture;
- on the workspace, the forms listed in gpucomm.workspace.into.

``GPUCOMM_DEBUG=DEBUG`` prints which of the two a call took.
"""

from __future__ import annotations

from typing import Any

import torch

from gpucomm.capture import capturing
from gpucomm.comm import dtypes
from gpucomm.comm.call import Call
from gpucomm.comm.lazy_views import is_lazy
from gpucomm.comm.path import Path
from gpucomm.comm.validation import check_same, check_tensor
from gpucomm.reduce_op import ReduceOp, as_reduce_op, premul_factor
from gpucomm.work import Work
from gpucomm.workspace.into import copy_then_in_place

# The communicator (gpucomm.comm.collectives.Collectives) is typed Any: it imports this module, and
# the import graph has no circles (tests/test_import_graph.py).
Collectives = Any

__all__ = ["all_reduce_into", "check_into"]

FN = "all_reduce_into"


def check_into(output: object, input: object, device: torch.device | None) -> bool:
    """Check the pair before any data moves; True where ``output`` is ``input``'s memory (in place).

    Both contiguous, of one shape, dtype and device; ``output`` is either exactly ``input``'s
    bytes or shares none of them (a partial overlap would read bytes the call has already written)."""
    output = check_tensor(output, FN, "output", device)
    input = check_tensor(input, FN, "input", device)
    check_same(output, input, FN, "output")
    if output.shape != input.shape:
        raise ValueError(
            f"gpucomm.{FN}: output must have the shape of input, {tuple(input.shape)}, got {tuple(output.shape)}"
        )
    nbytes = input.numel() * input.element_size()
    o, i = output.data_ptr(), input.data_ptr()
    if o == i:
        return True
    if nbytes and o < i + nbytes and i < o + nbytes:
        raise ValueError(
            f"gpucomm.{FN}: output must be input itself or share no byte with it; got output's {nbytes} bytes at "
            f"{o - i:+d} bytes from input's"
        )
    return False


def all_reduce_into(
    comm: Collectives, output: torch.Tensor, input: torch.Tensor, op: object, async_op: bool
) -> Work | None:
    """:meth:`gpucomm.Communicator.all_reduce_into` (its docstring has the contract)."""
    if not async_op:
        # A blocking call seen before: one lookup and one launch, as all_reduce's
        # (gpucomm.workspace.repeat), under the communicator's lock, taken by hand as there.
        lock = comm._lock
        lock.acquire()
        try:
            # Not inside a CUDA graph capture: a captured call copies, then runs in place (module docstring).
            seen = comm._repeat.find(input, op, output) if isinstance(input, torch.Tensor) else None
            seen = None if seen is None or capturing(input.device) else seen
            if seen is not None and comm._broken is None and not comm._closed and comm._progress.idle():
                comm._calls += 1
                slot = comm._flight.enter(comm._calls, seen.flight)
                try:
                    seen.launch()
                except RuntimeError as err:
                    raise comm._translate("all_reduce", comm._calls, None)(err) from err
                comm._flight.completed(slot)
                return None
        finally:
            lock.release()
    comm._check_usable(FN)
    if check_into(output, input, comm.device):
        return comm.all_reduce(output, op, async_op)
    scale = premul_factor(op, FN)
    rop = ReduceOp.SUM if scale is not None else as_reduce_op(op, FN)
    st = dtypes.staged([input], rop, FN, scale)  # raises on a dtype and op with no reduction, before any copy
    if st.wire[0] is not input or is_lazy(input) or is_lazy(output) or capturing(input.device):
        copy_then_in_place(comm.rank, output, input, "the call is staged, lazy or captured")
        return comm.all_reduce(output, op, async_op)
    name = rop.name
    rank = comm.rank

    def serve(path: Path) -> Work:
        into = getattr(path, "all_reduce_into", None)
        if into is not None:
            return into(output, input, rop)
        copy_then_in_place(rank, output, input, "gloo has no out-of-place all_reduce")
        return path.all_reduce(output, rop)

    # The call is an all_reduce for every rank (its fingerprint, its algorithm, its log line): ranks
    # that mix the two forms agree, as their results do.
    work = comm._route(Call("all_reduce", input, serve, async_op=async_op, outputs=[output], fields={"op": name}))
    if not async_op:
        with comm._lock:
            if comm._progress.idle():  # else another thread's call runs on the engine: a later repeat learns
                engine = comm._engines.get(input.device.type)
                comm._repeat.learn(engine, comm.config, comm._flight, input, op, rop, {"op": name}, output)
    return work
