"""DDP training on synthetic data, with the gradient all-reduce served by NCCL, gloo or gpucomm.

    torchrun --nproc-per-node 2 bench/ddp_train.py --comm gpucomm-backend --steps 20
    torchrun --nproc-per-node 2 bench/ddp_train.py --comm gpucomm-hook --hook bf16 --device cuda
    torchrun --nproc-per-node 2 bench/ddp_train.py --comm gloo --out gloo.pt   # final parameters

``--comm``:
    nccl             init_process_group("nccl"), DDP as usual (CUDA only)
    gloo             init_process_group("gloo"), DDP as usual
    gpucomm-backend  init_process_group("gpucomm"): every collective DDP makes goes through gpucomm
    gpucomm-hook     gloo (CPU) or NCCL (CUDA) for DDP's set-up (``--ddp-backend`` picks another),
                     gpucomm.init_process_group(), and ``register_comm_hook(GpucommState(), <--hook>)``
                     for the gradient buckets

The model (an MLP with odd widths) and every rank's batches come from fixed seeds, so two runs
with different ``--comm`` should end with the same parameters (to rounding). Rank 0 prints the
loss (averaged over ranks) and the wall time of every step, then the median step time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import gpucomm  # registers the "gpucomm" backend with torch.distributed
from gpucomm import ddp

__all__ = ["COMMS", "HOOKS", "make_model", "make_batch", "train_steps", "main"]

COMMS = ("nccl", "gloo", "gpucomm-hook", "gpucomm-backend")
HOOKS = ("allreduce", "bf16", "fp16")
IN_FEATURES, HIDDEN, OUT_FEATURES = 13, 37, 5  # odd widths: bucket sizes that are not multiples of 16 bytes


def make_model(seed: int, hidden: int = HIDDEN) -> torch.nn.Module:
    """The same MLP on every rank (DDP's initial broadcast is then a no-op on the values)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, OUT_FEATURES),
    )


def make_batch(seed: int, rank: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s samples: inputs and the targets of a fixed random teacher.

    The same at every step, so the loss falls steadily.
    """
    teacher = torch.Generator().manual_seed(seed + 1)
    w = torch.randn(IN_FEATURES, OUT_FEATURES, generator=teacher)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank)
    x = torch.randn(batch, IN_FEATURES, generator=gen)
    return x, torch.sin(x @ w)


def train_steps(
    ddp_model: torch.nn.Module,
    steps: int,
    *,
    seed: int,
    rank: int,
    batch: int,
    lr: float,
    device: torch.device,
) -> tuple[list[float], list[float]]:
    """``steps`` SGD steps; returns this rank's loss and wall time (seconds) of each step."""
    optim = torch.optim.SGD(ddp_model.parameters(), lr=lr, momentum=0.9)
    losses, times = [], []
    x, y = (t.to(device) for t in make_batch(seed, rank, batch))
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        optim.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(ddp_model(x), y)
        loss.backward()  # DDP all-reduces the gradient buckets here
        optim.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return losses, times


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ddp_train", description=__doc__.split("\n\n")[0])
    p.add_argument("--comm", choices=COMMS, required=True, help="what serves DDP's collectives")
    p.add_argument("--hook", choices=HOOKS, default="allreduce", help="gpucomm hook for --comm gpucomm-hook")
    p.add_argument(
        "--ddp-backend",
        choices=("nccl", "gloo"),
        default=None,
        help="torch.distributed backend of DDP's own set-up under --comm gpucomm-hook (default: nccl on cuda, "
        "gloo on cpu; gloo lets several ranks share one GPU, which NCCL refuses)",
    )
    p.add_argument("--steps", type=int, default=10, help="training steps")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--batch", type=int, default=16, help="samples per rank and step")
    p.add_argument("--hidden", type=int, default=HIDDEN, help="width of the hidden layers")
    p.add_argument("--lr", type=float, default=0.2, help="SGD learning rate (momentum 0.9)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="rank 0 saves the final parameters here (torch.save of a dict)")
    return p


def _check(args: argparse.Namespace) -> None:
    if args.steps < 1:
        raise ValueError(f"ddp_train: --steps must be >= 1, got {args.steps}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("ddp_train: --device cuda, but torch sees no CUDA device")
    if "nccl" in (args.comm, args.ddp_backend) and args.device != "cuda":
        raise ValueError("ddp_train: NCCL needs --device cuda")


def _init(comm: str, hook: str, ddp_backend: str | None, device: torch.device) -> tuple[object, object]:
    """Initialise the process groups; returns (hook state, hook) or (None, None) without a hook."""
    if comm == "gpucomm-backend":
        dist.init_process_group("gpucomm")
        return None, None
    if comm == "gpucomm-hook":
        dist.init_process_group(ddp_backend or ("nccl" if device.type == "cuda" else "gloo"))
        gpucomm.init_process_group()
        hooks = {"allreduce": ddp.allreduce_hook, "bf16": ddp.bf16_compress_hook, "fp16": ddp.fp16_compress_hook}
        return ddp.GpucommState(), hooks[hook]
    dist.init_process_group(comm)
    return None, None


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _check(args)
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    state, hook = _init(args.comm, args.hook, args.ddp_backend, device)
    world = dist.get_world_size()
    model = make_model(args.seed, args.hidden).to(device)
    ddp_model = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    if hook is not None:
        ddp_model.register_comm_hook(state, hook)
    losses, times = train_steps(
        ddp_model, args.steps, seed=args.seed, rank=rank, batch=args.batch, lr=args.lr, device=device
    )
    mean_losses = torch.tensor(losses, dtype=torch.float64, device=device)
    dist.all_reduce(mean_losses)  # the loss over all ranks' samples, for the printout
    mean_losses /= world
    if rank == 0:
        label = args.comm + (f"/{args.hook}" if args.comm == "gpucomm-hook" else "")
        for step, (loss, seconds) in enumerate(zip(mean_losses.tolist(), times)):
            print(f"step {step:4d}  loss {loss:.6f}  time {seconds * 1e3:8.3f} ms", flush=True)
        steady = times[1:] or times  # the first step includes DDP's bucket rebuild
        print(
            f"{label}: {world} ranks, {args.device}, median step {statistics.median(steady) * 1e3:.3f} ms", flush=True
        )
        if args.out:
            torch.save({name: p.detach().cpu() for name, p in model.named_parameters()}, args.out)
    dist.destroy_process_group()
    if args.comm == "gpucomm-hook":
        gpucomm.destroy_process_group()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as err:
        print(err, file=sys.stderr)
        sys.exit(2)
