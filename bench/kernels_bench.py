"""``gpucomm-bench kernels``: copy and k-input reduce of each kernel implementation.

Measured against the bandwidth of torch's own ``copy_`` in the same run (the roofline).

Bytes counted are bytes moved: a copy reads and writes ``size`` (2 × size); a k-input reduce
reads k × size and writes size ((k + 1) × size). ``%roof`` is a kernel's GB/s over ``copy_``'s at
the same size: the fraction of attainable memory bandwidth it reaches.

A kernel's time is the median over its timed calls (one process: :func:`timing.slowest_rank` of
one rank). Its check is one call after the timed calls (after the replays with ``-G``), inputs
refilled and the output poisoned before it (:func:`timing.check_after`).
"""

from __future__ import annotations

import datetime
import json
import socket
from functools import partial

import torch

from gpucomm.errors import UnsupportedError
from gpucomm.ops.contract import Region
from gpucomm.ops.registry import get_kernels
from gpucomm.reduce_op import ReduceOp

from .collectives import CHECK_RANGES, poison_value
from .hostinfo import device_name, versions
from .runner import DTYPES
from .timing import check_after, count_wrong, slowest_rank, time_calls, time_graph

__all__ = ["run_kernels"]

IMPLS = ("torch", "triton", "cuda")
REDUCE_INPUTS = range(2, 9)
_OPS = {"sum": ReduceOp.SUM, "prod": ReduceOp.PRODUCT, "min": ReduceOp.MIN, "max": ReduceOp.MAX, "avg": ReduceOp.AVG}


def _inputs(k: int, numel: int, op: str, device: torch.device) -> list[torch.Tensor]:
    """k small-integer inputs whose reduction is exact in every dtype (as the collective checks)."""
    low, high = CHECK_RANGES[op]
    return [torch.randint(low, high + 1, (numel,), device=device) * (k if op == "avg" else 1) for _ in range(k)]


def _reference(ints: list[torch.Tensor], op: str) -> torch.Tensor:
    fold = {"sum": torch.add, "avg": torch.add, "prod": torch.mul, "min": torch.minimum, "max": torch.maximum}[op]
    acc = ints[0]
    for x in ints[1:]:
        acc = fold(acc, x)
    return acc // len(ints) if op == "avg" else acc


def _header(device: torch.device, dtype: str, op: str, impls: list[str], notes: list[str]) -> str:
    lines = [
        f"# gpucomm-bench kernels  device {device} [{device_name(device)}]  dtype {dtype}  op {op}",
        f"# implementations: {', '.join(impls)}; roofline: torch copy_ in the same run",
        "# GB/s counts bytes read + written: copy 2 x size, k-input reduce (k+1) x size",
        *[f"# {note}" for note in notes],
        "#",
        f"# {'size':>10}  {'count':>10}  {'impl':>6}  {'kernel':>8}  {'time':>9}  {'GB/s':>8}  "
        f"{'%roof':>6}  {'#wrong':>6}",
        f"# {'(B)':>10}  {'(elements)':>10}  {'':>6}  {'':>8}  {'(us)':>9}  {'':>8}  {'':>6}  {'':>6}",
    ]
    return "\n".join(lines)


def _line(row: dict) -> str:
    wrong = "N/A" if row["wrong"] is None else str(row["wrong"])
    return (
        f"  {row['size']:>10}  {row['count']:>10}  {row['impl']:>6}  {row['kernel']:>8}  {row['time_us']:9.2f}"
        f"  {row['gbps']:8.2f}  {100 * row['roof_fraction']:5.1f}%  {wrong:>6}"
    )


def run_kernels(
    sizes, dtype_name, op_name, iters, warmup, check, device_kind, json_path, plot_path, argv, graph_launches: int = 0
) -> int:
    """Measure every available implementation; 0 if no check found a wrong value.

    ``graph_launches`` > 0 times each kernel's calls captured into a CUDA graph
    (:func:`timing.time_graph`).
    """
    if device_kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("gpucomm-bench kernels: --device cuda asked for, but torch sees no CUDA device")
    on_gpu = device_kind != "cpu" and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    dtype, op = DTYPES[dtype_name], _OPS[op_name]
    elem = torch.empty(0, dtype=dtype).element_size()

    impls, notes = {}, []
    for name in IMPLS if on_gpu else ("torch",):
        try:
            impls[name] = get_kernels(name, device)
        except UnsupportedError as err:
            notes.append(f"{name}: not run: {err}")
    if not on_gpu:
        notes.append(
            "CPU run: the torch reference only (Triton on CPU runs only under its slow "
            "interpreter; the CUDA kernels need a GPU)"
        )
    if graph_launches:
        if not on_gpu:
            raise ValueError("gpucomm-bench kernels: -G/--cudagraph needs a CUDA device")
        notes.append(f"time: {iters} calls captured into a CUDA graph, replayed {graph_launches} times, per call")

        def timed(call, device, warmup, iters):  # noqa: ANN001, ANN202
            return time_graph(call, device, warmup, iters, graph_launches)
    else:
        timed = time_calls
    print(_header(device, dtype_name, op_name, list(impls), notes), flush=True)

    rows, wrong_total = [], 0
    for size in sizes:
        numel = max(1, size // elem)
        nbytes = numel * elem
        ints = _inputs(max(REDUCE_INPUTS), numel, op_name, device)
        src = ints[0].to(dtype)
        out = torch.empty(numel, dtype=dtype, device=device)
        copy_s = slowest_rank([timed(partial(out.copy_, src), device, warmup, iters)])
        roof = 2 * nbytes / copy_s / 1e9
        base = {"size": nbytes, "count": numel, "type": dtype_name}
        row = {
            **base,
            "impl": "torch",
            "kernel": "copy_",
            "k": 1,
            "time_us": copy_s * 1e6,
            "gbps": roof,
            "roof_fraction": 1.0,
            "wrong": None,
        }
        rows.append(row)
        print(_line(row), flush=True)
        for name, kernels in impls.items():
            cases = [("copy", 1)] + [(f"reduce{k}", k) for k in REDUCE_INPUTS]
            for kernel, k in cases:
                if kernel == "copy":
                    ins = [ints[0]]
                    typed = [src]
                    call = partial(kernels.copy, Region.of(out), Region.of(src))
                else:
                    # AVG divides by k: the inputs are multiples of the divisor of their own k.
                    ins = [x * k // max(REDUCE_INPUTS) for x in ints[:k]] if op_name == "avg" else ints[:k]
                    typed = [x.to(dtype) for x in ins]
                    call = partial(
                        kernels.reduce,
                        Region.of(out),
                        [Region.of(t) for t in typed],
                        dtype,
                        op,
                        k if op_name == "avg" else 1,
                    )
                seconds = slowest_rank([timed(call, device, warmup, iters)])
                wrong = None
                if check:
                    expected = _reference(ins, op_name).to(dtype)

                    def reset(typed=typed, ins=ins, out=out) -> None:
                        for t, x in zip(typed, ins):
                            t.copy_(x.to(dtype))
                        out.fill_(poison_value(dtype))

                    check_after(reset, call, device)
                    wrong = count_wrong(out, expected)
                    wrong_total += wrong
                gbps = (k + 1) * nbytes / seconds / 1e9
                row = {
                    **base,
                    "impl": name,
                    "kernel": kernel,
                    "k": k,
                    "time_us": seconds * 1e6,
                    "gbps": gbps,
                    "roof_fraction": gbps / roof,
                    "wrong": wrong,
                }
                rows.append(row)
                print(_line(row), flush=True)

    print(f"# Out of bounds values : {wrong_total} {'OK' if wrong_total == 0 else 'FAILED'}", flush=True)
    if json_path:
        settings = {
            "argv": list(argv),
            "dtype": dtype_name,
            "op": op_name,
            "iters": iters,
            "warmup": warmup,
            "check": check,
            "sizes": list(sizes),
            "device": str(device),
            "graph_launches": graph_launches,
            "device_name": device_name(device),
            "versions": versions(),
            "implementations": list(impls),
            "notes": notes,
            "host": socket.gethostname(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        with open(json_path, "w") as f:
            json.dump({"settings": settings, "rows": rows, "failed": wrong_total > 0}, f, indent=1)
    if plot_path:
        _plot(rows, plot_path, f"gpucomm-bench kernels, {device}, {dtype_name} {op_name}")
    print("# OK" if wrong_total == 0 else f"# FAILED: {wrong_total} wrong value(s)", flush=True)
    return 0 if wrong_total == 0 else 1


def _plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    impls = list(dict.fromkeys(r["impl"] for r in rows if r["kernel"] != "copy_"))
    fig, axes = plt.subplots(1, max(1, len(impls)), figsize=(5.5 * max(1, len(impls)), 4), squeeze=False)
    roof = [(r["size"], r["gbps"]) for r in rows if r["kernel"] == "copy_"]
    for ax, impl in zip(axes.flat, impls):
        ax.plot(*zip(*roof), "k--", label="torch copy_ (roofline)")
        for kernel in dict.fromkeys(r["kernel"] for r in rows if r["impl"] == impl and r["kernel"] != "copy_"):
            pts = [(r["size"], r["gbps"]) for r in rows if r["impl"] == impl and r["kernel"] == kernel]
            ax.plot(*zip(*pts), marker="o", markersize=3, label=kernel)
        ax.set_xscale("log", base=2)
        ax.set_title(impl)
        ax.set_xlabel("size (B)")
        ax.set_ylabel("GB/s (read + write)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
