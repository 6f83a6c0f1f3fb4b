"""A torch.distributed backend named ``gpucomm``: ``torch.distributed.init_process_group("gpucomm")``.

Importing gpucomm registers it (gpucomm.distributed.registration). The process group wraps a
:class:`gpucomm.Communicator` built on the store torch hands the creator, so every
torch.distributed call (and every call DDP, FSDP2, DTensor and the functional collectives make
from C++ or Python) takes gpucomm's paths: the workspace for CUDA tensors (and CPU tensors with
``GPUCOMM_TRANSPORT=shm``) where it serves the collective, gpucomm's own gloo group everywhere
else.

Why a ``ProcessGroup`` subclass and not a ``Backend``: torch 2.13's C++ ``Backend`` binds no
constructor, so a Python subclass cannot be built (``TypeError: No constructor defined!``), while
a ``ProcessGroup`` subclass is what ``_new_process_group_helper`` returns as the group itself (it
checks ``issubclass(type(backend_class), ProcessGroup)``), in torch 2.11 and 2.13 alike; the C++
trampoline of ``ProcessGroup`` forwards allreduce, broadcast, allgather, ... to the methods below.

What torch's stack asks of a process group besides the collectives, and where it comes from:

- ``group_name``: torch keeps a C++ group's name in its backends, which a Python group has none
  of (``RuntimeError: ProcessGroup name not set``); the name torch chose is handed to the
  creator (``group_id``) and returned here. DeviceMesh, DTensor, FSDP2 and the functional
  collectives (eager and compiled) look groups up by it; ``destroy_process_group`` unregisters it.
- ``group_desc``: set by torch on the C++ object, as for any group.
- ``_device_types`` and ``_get_backend(device)``: the devices this group serves (the CPU, and
  this rank's GPU where there is one) and a :class:`BackendInfo` for each, which answers the
  capability questions torch asks (splitting, coalescing, tensor allocation: none of them).
- ``bound_device_id``: stays None, as for a gloo group. torch checks a ``device_id`` given to
  ``init_process_group`` itself, but binds it to the group object that this one replaces;
  binding it here would make DeviceMesh split the group with ``ncclCommSplit``, which gpucomm
  has no counterpart of. gpucomm's own ``init_process_group(device_id=...)`` pins the device.
- ``options``: the :class:`Options` given as ``pg_options``, or the defaults.

Completion: every collective is started asynchronously and returns a torch ``Work``
(gpucomm.distributed.torch_work).

Method names: torch 2.13 calls ``all_gather_single``, ``reduce_scatter_single``,
``all_to_all_single`` and their ``*_coalesced`` forms; torch 2.11 calls ``_allgather_base``,
``_reduce_scatter_base``, ``alltoall_base``, ``allgather_into_tensor_coalesced`` and
``reduce_scatter_tensor_coalesced``. Both sets are defined.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist

from gpucomm.comm.communicator import Communicator
from gpucomm.distributed.torch_work import BarrierWork, P2PWork, pending
from gpucomm.reduce_op import ReduceOp, as_reduce_op
from gpucomm.work import Work

__all__ = ["BACKEND_NAME", "BackendInfo", "Options", "ProcessGroupGpucomm"]

BACKEND_NAME = "gpucomm"


@dataclasses.dataclass
class Options:
    """``pg_options`` of a gpucomm group: knobs for its Communicator (None: the GPUCOMM_*
    variable, or the default), as ``init_process_group("gpucomm", pg_options=Options(...))``
    or ``new_group(backend="gpucomm", pg_options=...)`` take them."""

    transport: str | None = None
    kernels: str | None = None
    algo: str | None = None
    workspace_bytes: int | str | None = None
    check: str | None = None
    channels: int | str | None = None

    def knobs(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


class BackendInfo:
    """What ``ProcessGroup._get_backend(device)`` answers for a gpucomm group.

    torch asks a group's backend what it can do before choosing how to call it: FSDP2 whether it
    allocates tensors, ``batch_isend_irecv`` whether it coalesces, ``init_process_group`` and
    DeviceMesh whether it splits. gpucomm's group does none of these natively, and says so;
    the collectives themselves go through the process group.
    """

    supports_splitting = False
    supports_coalescing = False
    supports_shrinking = False
    supports_time_estimate = False

    def __init__(self, group: ProcessGroupGpucomm, device: torch.device) -> None:
        self._group = group
        self.device = device

    @property
    def options(self) -> Options:
        return self._group.options

    def name(self) -> str:
        return BACKEND_NAME

    def _get_backend_name(self) -> str:
        return BACKEND_NAME

    def rank(self) -> int:
        return self._group.rank()

    def size(self) -> int:
        return self._group.size()

    def supports_tensor_alloc(self, device: torch.device) -> bool:
        return False

    def eager_connect_single_device(self, device: torch.device | None) -> None:
        """Nothing to connect: the Communicator connected every peer when it was built."""

    def __repr__(self) -> str:
        return f"BackendInfo(gpucomm, {self.device})"


class ProcessGroupGpucomm(dist.ProcessGroup):
    """torch.distributed process group served by a gpucomm :class:`Communicator`.

    Built by ``torch.distributed.init_process_group("gpucomm")`` or ``new_group(backend="gpucomm")``;
    ranks in options (``rootRank``) and arguments (``dst``, ``src``) are group ranks, as torch passes
    them to every backend. ``communicator`` is the wrapped Communicator.
    """

    Options = Options

    def __init__(self, communicator: Communicator, group_name: str = "", options: Options | None = None) -> None:
        super().__init__(communicator.rank, communicator.world_size)
        self.communicator = communicator
        self._group_name = group_name
        self._options = options if options is not None else Options()
        devices = [torch.device("cpu")]
        if communicator.device is not None:
            devices.append(torch.device("cuda"))
        self._backends = {d.type: BackendInfo(self, d) for d in devices}

    # -- identity and life cycle --------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 (the C++ virtual's name)
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    def _get_backend_name(self) -> str:
        return BACKEND_NAME

    @property
    def group_name(self) -> str:
        """The name torch registered this group under (what ``_resolve_process_group`` finds)."""
        if not self._group_name:
            raise RuntimeError("gpucomm: this process group was built outside torch.distributed and has no group name")
        return self._group_name

    @property
    def options(self) -> Options:
        return self._options

    @property
    def _device_types(self) -> list[torch.device]:
        return [b.device for b in self._backends.values()]

    def _get_backend(self, device: torch.device | str) -> BackendInfo:
        kind = torch.device(device).type
        if kind not in self._backends:
            raise RuntimeError(
                f"No backend type associated with device type {kind} "
                f"(the gpucomm group serves {sorted(self._backends)})"
            )
        return self._backends[kind]

    def shutdown(self) -> None:
        self.communicator.close()

    def abort(self) -> None:
        self.communicator.close()

    def __repr__(self) -> str:
        comm = self.communicator
        return f"ProcessGroupGpucomm(rank={comm.rank}, size={comm.world_size}, name={self._group_name!r})"

    # -- reductions -----------------------------------------------------------------------------
    def allreduce(self, tensors: torch.Tensor | list[torch.Tensor], opts: object = None) -> dist.Work:
        works: list[Work | None] = []
        op = _reduce_op(opts, "allreduce")
        tensors = _as_list(tensors)
        for t in tensors:
            if t.is_sparse:
                _sparse_all_reduce(self.communicator, t, op)
            else:
                works.append(self.communicator.all_reduce(t, op, async_op=True))
        return pending(works, tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: object = None) -> dist.Work:
        return self.allreduce(tensors, opts)

    def reduce(self, tensors: torch.Tensor | list[torch.Tensor], opts: object = None, op: object = None) -> dist.Work:
        works: list[Work | None] = []
        if isinstance(opts, int):  # torch's Python overload reduce(tensor, root, op=SUM)
            root, rop = opts, ReduceOp.SUM if op is None else as_reduce_op(op, "reduce")
        else:
            root, rop = _field(opts, "rootRank", 0), _reduce_op(opts, "reduce")
        tensors = _as_list(tensors)
        for t in tensors:
            works.append(self.communicator.reduce(t, root, rop, async_op=True))
        return pending(works, tensors)

    def reduce_scatter(
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: object = None
    ) -> dist.Work:
        works: list[Work | None] = []
        op = _reduce_op(opts, "reduce_scatter")
        for out, inputs in zip(_as_list(output_tensors), input_tensors, strict=True):
            works.append(self.communicator.reduce_scatter(out, list(inputs), op, async_op=True))
        return pending(works, _as_list(output_tensors))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: object = None) -> dist.Work:
        return self.reduce_scatter_single_coalesced([output], [input], opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: object = None
    ) -> dist.Work:
        op = _reduce_op(opts, "reduce_scatter_tensor")
        works = [
            self.communicator.reduce_scatter_tensor(out, inp, op, async_op=True)
            for out, inp in zip(outputs, inputs, strict=True)
        ]
        return pending(works, list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- data movement --------------------------------------------------------------------------
    def broadcast(self, tensors: torch.Tensor | list[torch.Tensor], opts: object = None) -> dist.Work:
        works: list[Work | None] = []
        # torch's Python overload broadcast(tensor, root) arrives with an int in place of opts
        root = opts if isinstance(opts, int) else _field(opts, "rootRank", 0)
        tensors = _as_list(tensors)
        for t in tensors:
            works.append(self.communicator.broadcast(t, root, async_op=True))
        return pending(works, tensors)

    def allgather(
        self, output_tensors: list, input_tensors: torch.Tensor | list[torch.Tensor], opts: object = None
    ) -> dist.Work:
        works: list[Work | None] = []
        inputs = _as_list(input_tensors)
        # torch's Python overload allgather(list[Tensor], Tensor) passes one flat output list
        outputs = [output_tensors] if isinstance(input_tensors, torch.Tensor) else output_tensors
        for outs, inp in zip(outputs, inputs, strict=True):
            works.append(self.communicator.all_gather(list(outs), inp, async_op=True))
        return pending(works, [t for outs in outputs for t in outs])

    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor], opts: object = None
    ) -> dist.Work:
        works: list[Work | None] = []
        # torch hands the outputs rank-major: output_lists[r][k] receives input_list[k] of rank r.
        if len(output_lists) != self.communicator.world_size:
            raise ValueError(
                f"gpucomm backend allgather_coalesced: expected {self.communicator.world_size} output lists "
                f"(one per rank), got {len(output_lists)}"
            )
        for k, inp in enumerate(input_list):
            works.append(self.communicator.all_gather([outs[k] for outs in output_lists], inp, async_op=True))
        return pending(works, [t for outs in output_lists for t in outs])

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: object = None) -> dist.Work:
        return self.all_gather_single_coalesced([output], [input], opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: object = None
    ) -> dist.Work:
        works = [
            self.communicator.all_gather_into_tensor(out, inp, async_op=True)
            for out, inp in zip(outputs, inputs, strict=True)
        ]
        return pending(works, list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: object = None
    ) -> dist.Work:
        works: list[Work | None] = []
        root = _field(opts, "rootRank", 0)
        gather_list = list(output_tensors[0]) if self.communicator.rank == root else None
        works.append(self.communicator.gather(_one(input_tensors, "gather"), gather_list, root, async_op=True))
        return pending(works, gather_list or [])

    def scatter(
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: object = None
    ) -> dist.Work:
        works: list[Work | None] = []
        root = _field(opts, "rootRank", 0)
        scatter_list = list(input_tensors[0]) if self.communicator.rank == root else None
        out = _one(output_tensors, "scatter")
        works.append(self.communicator.scatter(out, scatter_list, root, async_op=True))
        return pending(works, [out])

    def alltoall(
        self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: object = None
    ) -> dist.Work:
        work = self.communicator.all_to_all(list(output_tensors), list(input_tensors), async_op=True)
        return pending([work], list(output_tensors))

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
        opts: object = None,
    ) -> dist.Work:
        # torch passes empty split lists for "equal splits"; the Communicator reads None or [] so
        work = self.communicator.all_to_all_single(
            output, input, list(output_split_sizes), list(input_split_sizes), async_op=True
        )
        return pending([work], [output])

    alltoall_base = all_to_all_single

    # -- point to point: started here, completed by the Work's wait() -------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        t = _one(tensors, "send")
        return P2PWork(self.communicator.isend(t, dst, tag), [t])

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        t = _one(tensors, "recv")
        return P2PWork(self.communicator.irecv(t, src, tag), [t])

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        t = _one(tensors, "recv")
        return P2PWork(self.communicator.irecv(t, None, tag), [t])

    def barrier(self, opts: object = None) -> dist.Work:
        return BarrierWork(self.communicator.barrier(async_op=True))


# -- helpers ----------------------------------------------------------------------------------
def _as_list(tensors: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _one(tensors: Sequence[torch.Tensor], fn: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise ValueError(f"gpucomm backend {fn}: expected exactly one tensor per process, got {len(tensors)}")
    return tensors[0]


def _field(opts: object, name: str, default: object) -> object:
    return default if opts is None else getattr(opts, name)


def _reduce_op(opts: object, fn: str) -> ReduceOp:
    """The ReduceOp of an options object, or of a bare op (torch's ``allreduce(tensors, op)`` overload)."""
    if opts is None:
        return ReduceOp.SUM
    op = getattr(opts, "reduceOp", opts)
    # An options object's reduceOp is a ReduceOp *instance*; its RedOpType is what compares by value.
    return as_reduce_op(getattr(op, "op", op), fn)


def _sparse_all_reduce(comm: Communicator, tensor: torch.Tensor, op: ReduceOp) -> None:
    """SUM of sparse COO tensors, as gloo serves it on the CPU: every rank's entries are
    gathered (indices and values, padded to the largest count) and summed by coalescing."""
    if op is not ReduceOp.SUM:
        raise ValueError(
            f"gpucomm backend allreduce: sparse tensors support ReduceOp.SUM only (as gloo), got {op.name}"
        )
    if tensor.layout != torch.sparse_coo:
        raise ValueError(f"gpucomm backend allreduce: sparse tensors must be COO (as gloo), got {tensor.layout}")
    local = tensor.coalesce()
    P = comm.world_size
    counts = torch.empty(P, dtype=torch.int64)
    comm.all_gather_into_tensor(counts, torch.tensor([local._nnz()], dtype=torch.int64))
    most = int(counts.max())
    indices = local._indices()
    values = local._values()
    padded_i = torch.zeros((indices.shape[0], most), dtype=indices.dtype)
    padded_i[:, : indices.shape[1]] = indices
    padded_v = torch.zeros((most, *values.shape[1:]), dtype=values.dtype)
    padded_v[: values.shape[0]] = values
    all_i = [torch.empty_like(padded_i) for _ in range(P)]
    all_v = [torch.empty_like(padded_v) for _ in range(P)]
    comm.all_gather(all_i, padded_i.contiguous())
    comm.all_gather(all_v, padded_v.contiguous())
    n = counts.tolist()
    total = torch.sparse_coo_tensor(
        torch.cat([i[:, : n[r]] for r, i in enumerate(all_i)], dim=1),
        torch.cat([v[: n[r]] for r, v in enumerate(all_v)]),
        tensor.shape,
    ).coalesce()
    tensor.copy_(total)
