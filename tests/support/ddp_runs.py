"""DDP on gpucomm, what a CPU and a CUDA run share: one rank's training runs (``training_runs``: gloo as
the reference, the gpucomm backend, gloo + each gpucomm hook), the tests that read what the ranks
sent back (``test_*``, collected by tests/distributed/test_ddp.py and tests/gpu/test_ddp_gpu.py,
each with its own ``runs`` fixture), and bench/ddp_train.py's run under torchrun.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import NamedTuple

import pytest
import torch

STEPS = 10
BATCH = 16
LR = 0.2  # the mean loss falls by 20% or more in 10 steps (40 seeds tried)
GRAD_NUMEL = 4099  # odd: no dtype makes it a multiple of 16 bytes
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Bucket:
    """What the hooks read of a ``dist.GradBucket``: its flat buffer."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def buffer(self) -> torch.Tensor:
        return self._buffer


def log_lines() -> list[str]:
    """Collect gpucomm's GPUCOMM_DEBUG lines of this rank in a list."""
    import logging

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logging.getLogger("gpucomm").addHandler(Collect())
    return lines


def rank_device(rank: int, device_type: str) -> torch.device:
    """CPU, or this rank's GPU (several ranks may share one)."""
    if device_type == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def train(
    rank: int,
    world_size: int,
    backend: str,
    init_method: str | None,
    seed: int,
    device: torch.device,
    steps: int = STEPS,
    hook=None,
    state=None,
    group=None,
) -> dict:
    """Train the script's model under DDP on a fresh default group of ``backend`` (or, with
    ``group``, on that group of the default group there is); return losses and final parameters."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from gpucomm._bench.ddp_train import make_model, train_steps

    if group is None:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    model = make_model(seed).to(device)
    ddp_model = DistributedDataParallel(
        model, device_ids=[device] if device.type == "cuda" else None, process_group=group
    )
    built = callable(state)  # a factory: the state is made from the DDP model, after it
    if built:
        state = state(ddp_model)
    if hook is not None:
        ddp_model.register_comm_hook(state, hook)
    losses, _ = train_steps(ddp_model, steps, seed=seed, rank=rank, batch=BATCH, lr=LR, device=device)
    if built:
        state.close()
    return {"losses": losses, "params": {n: p.detach().cpu().clone() for n, p in model.named_parameters()}}


def gradients(seed: int, world_size: int) -> torch.Tensor:
    """Every rank's gradients (world_size x GRAD_NUMEL), magnitudes spread over four decades."""
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randn(world_size, GRAD_NUMEL, generator=gen)
    return signs * 10 ** (torch.rand(world_size, GRAD_NUMEL, generator=gen) * 4 - 4)


def exact_avg(grads: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What a 16-bit gpucomm hook must return: inputs rounded to dtype, summed in fp32 in rank
    order, divided once, rounded once."""
    acc = torch.zeros(grads.shape[1], dtype=torch.float32)
    for g in grads:
        acc += g.to(dtype).float()
    return (acc / grads.shape[0]).to(dtype).float()


def hook_errors(rank: int, world_size: int, seed: int, device: torch.device, gloo) -> dict:
    """Relative L2 error of torch's and gpucomm's compressed hooks against an fp32 all-reduce, on
    the same gradients; torch's hooks run on CPU tensors on the torch ``gloo`` group (their
    state), gpucomm's on ``device`` on gpucomm's default communicator."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from gpucomm import ddp

    grads = gradients(seed, world_size)
    reference = grads[rank].clone()
    default_hooks.allreduce_hook(gloo, Bucket(reference)).wait()
    out: dict = {}
    for name, dtype, theirs, ours in (
        ("bf16", torch.bfloat16, default_hooks.bf16_compress_hook, ddp.bf16_compress_hook),
        ("fp16", torch.float16, default_hooks.fp16_compress_hook, ddp.fp16_compress_hook),
    ):
        torch_result = grads[rank].clone()
        theirs(gloo, Bucket(torch_result)).wait()
        bucket = grads[rank].to(device, copy=True)  # a copy: grads stays the input of exact_avg
        returned = ours(ddp.GpucommState(), Bucket(bucket)).wait()
        assert returned is bucket, f"{name}: the hook's Future must hold the bucket's own buffer"
        gpucomm_result = bucket.cpu()

        def error(result: torch.Tensor) -> float:
            return ((result.double() - reference.double()).norm() / reference.double().norm()).item()

        out[name] = {
            "torch": error(torch_result),
            "gpucomm": error(gpucomm_result),
            "exact": torch.equal(gpucomm_result, exact_avg(grads, dtype)),
        }
    return out


def torch_api_through_backend(rank: int, world_size: int) -> dict:
    """torch.distributed's collectives on the gpucomm default group, on exact-integer inputs."""
    import torch.distributed as dist

    P, n = world_size, 7
    base = torch.arange(n, dtype=torch.float32)
    got: dict = {}

    t = base + rank
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    got["all_reduce_avg"] = torch.equal(t, base + (P - 1) / 2)
    t = base + rank
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    got["all_reduce_max"] = torch.equal(t, base + P - 1)
    t = base + rank
    dist.reduce(t, dst=P - 1)
    got["reduce"] = torch.equal(t, P * base + P * (P - 1) // 2) if rank == P - 1 else torch.equal(t, base + rank)
    t = torch.full((n,), float(rank))
    dist.broadcast(t, src=1)
    got["broadcast"] = torch.equal(t, torch.ones(n))
    outs = [torch.full((n,), float("nan")) for _ in range(P)]
    dist.all_gather(outs, base + rank)
    got["all_gather"] = all(torch.equal(o, base + r) for r, o in enumerate(outs))
    flat = torch.full((P * n,), float("nan"))
    dist.all_gather_into_tensor(flat, base + rank)
    got["all_gather_into_tensor"] = torch.equal(flat, torch.cat([base + r for r in range(P)]))
    gathered = [torch.full((n,), float("nan")) for _ in range(P)] if rank == 0 else None
    dist.gather(base + rank, gathered, dst=0)
    got["gather"] = rank != 0 or all(torch.equal(o, base + r) for r, o in enumerate(gathered))
    t = torch.full((n,), float("nan"))
    dist.scatter(t, [base * 10 + r for r in range(P)] if rank == 0 else None, src=0)
    got["scatter"] = torch.equal(t, base * 10 + rank)
    t = torch.full((n,), float("nan"))
    dist.reduce_scatter(t, [base + rank + 100 * r for r in range(P)])
    got["reduce_scatter"] = torch.equal(t, P * (base + 100 * rank) + P * (P - 1) // 2)
    t = torch.full((n,), float("nan"))
    dist.reduce_scatter_tensor(t, torch.cat([base + rank + 100 * r for r in range(P)]))
    got["reduce_scatter_tensor"] = torch.equal(t, P * (base + 100 * rank) + P * (P - 1) // 2)
    t = torch.full((P * 2,), float("nan"))
    dist.all_to_all_single(t, torch.arange(P * 2, dtype=torch.float32) + 100 * rank)
    got["all_to_all_single"] = torch.equal(
        t, torch.cat([torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) + 100 * r for r in range(P)])
    )
    outs = [torch.full((r + 1,), float("nan")) for r in range(P)]
    dist.all_to_all(outs, [torch.full((rank + 1,), float(100 * rank + r)) for r in range(P)])
    got["all_to_all"] = all(torch.equal(o, torch.full((r + 1,), float(100 * r + rank))) for r, o in enumerate(outs))
    t = torch.full((n,), float("nan"))
    if rank == 0:
        dist.send(base + 5, dst=1)
        dist.send(base + 6, dst=1)
        got["send_recv"] = True
    elif rank == 1:
        dist.recv(t, src=0)
        first = torch.equal(t, base + 5)
        source = dist.recv(t)  # any source: torch asks the Work for _source_rank()
        got["send_recv"] = first and source == 0 and torch.equal(t, base + 6)
    else:
        got["send_recv"] = True
    sub = dist.new_group([0, P - 1])  # a subgroup on the gpucomm backend: a child of the default group's Communicator
    t = base + rank
    if rank in (0, P - 1):
        dist.all_reduce(t, group=sub)
        got["subgroup"] = torch.equal(t, 2 * base + P - 1) and dist.get_backend(sub) == "gpucomm"
    else:
        got["subgroup"] = sub is dist.GroupMember.NON_GROUP_MEMBER
    # the process group's own Python overloads, as DDP (find_unused_parameters) and older code call them
    pg = dist.group.WORLD
    t = base + rank
    pg.allreduce(t).wait()
    u = base + rank
    pg.reduce(u, 0, dist.ReduceOp.MAX).wait()
    v = torch.full((n,), float(rank))
    pg.broadcast(v, P - 1).wait()
    got["overloads"] = (
        torch.equal(t, P * base + P * (P - 1) // 2)
        and torch.equal(v, torch.full((n,), float(P - 1)))
        and (rank != 0 or torch.equal(u, base + P - 1))
    )
    work = dist.all_reduce(base + rank, async_op=True)
    got["async_work"] = work.wait() and work.is_completed()
    dist.barrier()
    got["backend_name"] = dist.get_backend() == "gpucomm"
    return got


def training_runs(rank: int, world_size: int, tmp: str, seed: int, device_type: str) -> dict:
    """Every training run of one rank; ``device_type`` "cpu" or "cuda". gloo is the reference on
    both (NCCL refuses several ranks on one GPU)."""
    import torch.distributed as dist

    import gpucomm
    from gpucomm import ddp

    device = rank_device(rank, device_type)
    lines = log_lines()
    res: dict = {"gloo": train(rank, world_size, "gloo", f"file://{tmp}/gloo", seed, device)}
    dist.destroy_process_group()

    del lines[:]
    res["backend"] = train(rank, world_size, "gpucomm", f"file://{tmp}/backend", seed, device)
    res["backend_log"] = list(lines)
    if device_type == "cpu":  # the method mapping does not depend on the device
        res["api"] = torch_api_through_backend(rank, world_size)
    dist.destroy_process_group()

    # The hooks on a DDP over a plain gloo group, with no gpucomm.init_process_group: the state
    # builds its Communicator from the DDP model's process group, collectively, before training.
    del lines[:]
    res["hook_torch_group"] = train(
        rank,
        world_size,
        "gloo",
        f"file://{tmp}/torch_group",
        seed,
        device,
        hook=ddp.allreduce_hook,
        state=lambda m: ddp.GpucommState(m.process_group),
    )
    res["hook_torch_group_log"] = list(lines)
    dist.destroy_process_group()

    # gpucomm's default group is torch's (one world); DDP's own traffic (its set-up broadcast and
    # checks) goes over a torch gloo group of it, the gradient buckets through gpucomm's hooks.
    gpucomm.init_process_group(init_method=f"file://{tmp}/gpucomm", rank=rank, world_size=world_size)
    gloo = dist.new_group(backend="gloo")
    for name, hook in (
        ("allreduce", ddp.allreduce_hook),
        ("bf16", ddp.bf16_compress_hook),
        ("fp16", ddp.fp16_compress_hook),
    ):
        del lines[:]
        res[f"hook_{name}"] = train(
            rank, world_size, "gloo", None, seed, device, hook=hook, state=ddp.GpucommState(), group=gloo
        )
        res[f"hook_{name}_log"] = list(lines)
        if name == "allreduce":
            res["errors"] = hook_errors(rank, world_size, seed, device, gloo)
    try:
        ddp.allreduce_hook("not a state", Bucket(torch.zeros(3)))  # type: ignore[arg-type]
    except TypeError as err:
        res["bad_state"] = str(err)
    gpucomm.destroy_process_group()
    try:
        ddp.GpucommState()  # neither gpucomm nor torch.distributed is initialized now
    except gpucomm.NotInitializedError as err:
        res["no_group"] = str(err)
    return res


class Runs(NamedTuple):
    """What a ``runs`` fixture gives the shared tests: every rank's ``training_runs`` results."""

    seed: int
    results: list[dict]  # per rank, what training_runs returned
    transport: str  # the workspace path the gradient buckets must take
    kernels: str


def rel_diff(a: dict, b: dict) -> float:
    """Largest ``max|a - b| / max|b|`` over the parameter tensors."""
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in b)


def same_on_all_ranks(results: list[dict], key: str) -> bool:
    """Whether every rank ended run ``key`` with rank 0's parameters, bit for bit."""
    first = results[0][key]["params"]
    return all(all(torch.equal(r[key]["params"][k], first[k]) for k in first) for r in results)


def mean_losses(results: list[dict], key: str) -> list[float]:
    """The loss of each step averaged over the ranks (each rank sees only its own samples)."""
    return [sum(step) / len(step) for step in zip(*(r[key]["losses"] for r in results))]


def bucket_bytes(results: list[dict]) -> int:
    """The bytes of one fp32 gradient bucket: the model's parameters (one bucket)."""
    return sum(p.numel() for p in results[0]["gloo"]["params"].values()) * 4


def on_workspace(runs: Runs, line: str) -> bool:
    """Whether a GPUCOMM_DEBUG line says the call took the workspace path with the run's
    transport and kernels."""
    return re.search(rf" path=workspace .*transport={runs.transport} kernels={runs.kernels}$", line) is not None


def test_backend_trains_like_gloo(runs) -> None:
    seed, results = runs.seed, runs.results
    assert same_on_all_ranks(results, "backend"), f"seed {seed}: ranks disagree after training on the gpucomm backend"
    diff = rel_diff(results[0]["backend"]["params"], results[0]["gloo"]["params"])
    assert diff < 1e-6, f"seed {seed}: gpucomm backend vs gloo: relative difference {diff:.3g}"


def test_backend_serves_ddp_setup_and_gradient_buckets(runs) -> None:
    results = runs.results
    for rank, r in enumerate(results):
        log = [line for line in r["backend_log"] if line.startswith("gpucomm[rank")]  # the calls' lines
        nbytes = bucket_bytes(results)
        reduces = [
            i
            for i, line in enumerate(log)
            if line.startswith(f"gpucomm[rank {rank}]: all_reduce bytes={nbytes} dtype=float32 ")
        ]
        # DDP's set-up, before the first bucket: the parameter check (an all_gather of shapes)
        # and the broadcast of the module's state (all parameters in one flat float32 tensor)
        assert log[0].startswith(f"gpucomm[rank {rank}]: all_gather "), log[:4]
        state = [
            i
            for i, line in enumerate(log)
            if line.startswith(f"gpucomm[rank {rank}]: broadcast bytes={nbytes} dtype=float32 root=0 ")
        ]
        assert state and reduces and state[0] < reduces[0], f"rank {rank}: {log[:8]}"
        assert len(reduces) == STEPS, f"rank {rank}: {len(reduces)} bucket all_reduces for {STEPS} steps: {log}"
        assert all(on_workspace(runs, log[i]) for i in reduces), [log[i] for i in reduces]


def test_allreduce_hook_matches_gloo(runs) -> None:
    seed, results = runs.seed, runs.results
    assert same_on_all_ranks(results, "hook_allreduce")
    diff = rel_diff(results[0]["hook_allreduce"]["params"], results[0]["gloo"]["params"])
    assert diff < 1e-6, f"seed {seed}: allreduce_hook vs gloo: relative difference {diff:.3g}"
    rank0 = results[0]["hook_allreduce_log"]
    buckets = [
        line
        for line in rank0
        if line.startswith(f"gpucomm[rank 0]: all_reduce bytes={bucket_bytes(results)} dtype=float32 op=AVG")
    ]
    assert len(buckets) == STEPS and all(on_workspace(runs, line) for line in buckets), rank0


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_compressed_hooks_train(runs, name: str) -> None:
    seed, results = runs.seed, runs.results
    assert same_on_all_ranks(results, f"hook_{name}"), (
        f"seed {seed}: ranks disagree after training with the {name} hook"
    )
    losses = mean_losses(results, f"hook_{name}")
    reference = mean_losses(results, "gloo")
    assert losses[-1] < 0.9 * losses[0], f"seed {seed}: {name} hook: loss did not decrease: {losses}"
    assert abs(losses[-1] - reference[-1]) < 0.01 * reference[-1], f"seed {seed}: {name}: {losses} vs fp32 {reference}"
    rank0 = results[0][f"hook_{name}_log"]
    dtype = {"bf16": "bfloat16", "fp16": "float16"}[name]
    half = bucket_bytes(results) // 2
    buckets = [
        line for line in rank0 if line.startswith(f"gpucomm[rank 0]: all_reduce bytes={half} dtype={dtype} op=AVG")
    ]
    assert len(buckets) == STEPS and all(on_workspace(runs, line) for line in buckets), rank0


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_compressed_hooks_beat_torch(runs, name: str) -> None:
    """Against an fp32 all-reduce of the same gradients, gpucomm's hook errs less than torch's.

    With 2 ranks the two agree to rounding: dividing by 2 is exact and two 16-bit values add
    exactly in fp32, so both round once going out and once coming back. From 3 ranks on, torch's
    hook also rounds at the division and at each 16-bit addition, which gpucomm's does not.
    """
    seed, results = runs.seed, runs.results
    P = len(results)
    for rank, r in enumerate(results):
        e = r["errors"][name]
        assert e["exact"], f"seed {seed} rank {rank}: {name} hook differs from round(sum_fp32 / P)"
        if P == 2:
            assert e["gpucomm"] <= e["torch"] * 1.001, f"seed {seed} rank {rank}: {e}"
        else:
            assert e["gpucomm"] < 0.9 * e["torch"], f"seed {seed} rank {rank}: {e}"


# -- the example script under torchrun --------------------------------------------------------
SCRIPT_STEPS = 5


def check_script_under_torchrun(tmp_path, device: str, env: dict[str, str], hook_args: tuple[str, ...] = ()) -> None:
    """bench/ddp_train.py with 2 ranks: gloo, gpucomm-backend and gpucomm-hook (plus ``hook_args``)
    print falling losses and step times, and end with the same parameters."""
    run_env = {**os.environ, **env}
    procs = {}
    for comm in ("gloo", "gpucomm-backend", "gpucomm-hook"):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            os.path.join(_REPO, "bench", "ddp_train.py"), "--comm", comm, "--device", device,
            "--steps", str(SCRIPT_STEPS), "--out", str(tmp_path / f"{comm}.pt"),
            *(hook_args if comm == "gpucomm-hook" else ()),
        ]  # fmt: skip
        procs[comm] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=run_env)
    outputs = {}
    for comm, proc in procs.items():
        outputs[comm], _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, f"--comm {comm} failed:\n{outputs[comm][-3000:]}"
    for comm, text in outputs.items():
        losses = [float(m) for m in re.findall(r"^step +\d+ +loss ([0-9.]+) +time +[0-9.]+ ms$", text, re.M)]
        assert len(losses) == SCRIPT_STEPS and losses[-1] < losses[0], f"--comm {comm}:\n{text}"
        assert re.search(rf"^{comm}(/allreduce)?: 2 ranks, {device}, median step [0-9.]+ ms$", text, re.M), text
    reference = torch.load(tmp_path / "gloo.pt")
    for comm in ("gpucomm-backend", "gpucomm-hook"):
        diff = rel_diff(torch.load(tmp_path / f"{comm}.pt"), reference)
        assert diff < 1e-6, f"--comm {comm} vs gloo: relative difference {diff:.3g}"
