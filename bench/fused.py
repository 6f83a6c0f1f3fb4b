"""gpucomm.fused against the unfused sequence of calls, side by side.

Also the one-shot all_reduce written with gpucomm.language against the program kernel's.

Three pairs, measured in alternating order round after round, each checked:

- ``rmsnorm T``: ``all_reduce_residual_rmsnorm`` of T tokens of ``--hidden`` (bf16) against
  ``all_reduce`` + ``residual_rmsnorm``; the outputs must be equal bit for bit;
- ``ag_matmul``: ``all_gather_matmul`` of an (m, k) shard times (k, n) against
  ``all_gather_into_tensor`` + ``torch.matmul``; within bf16 matmul tolerance;
- ``oneshot n``: ``GPUCOMM_ALGO=oneshot_lang`` against ``oneshot`` (bf16 SUM); equal bit for bit.

The inputs of a reduction are small integers, and every rank rebuilds every rank's inputs, so
each rank holds the exact reference of each pair, built without a collective. After a pair's
timed rounds its inputs are reset (outputs poisoned) and one more call of each side is checked
against that reference on every rank (:func:`timing.check_after`): a collective that did nothing
on both sides would leave the two sides equal, and is caught. A wrong side marks the pair's row
(``wrong``) and fails the run.

Each rank times each call alone (wall clock; on a GPU after a synchronize); a round's figure is
:func:`timing.slowest_rank` of its calls (per call the slowest rank, then the median over calls),
and a pair's the median over rounds. ``--device cpu`` runs the same under ``TRITON_INTERPRET=1``
(a check that it works, not a speed: the interpreter).

Example::

    python -m gpucomm._bench.fused --nproc 2 --device cuda --json fused.json
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time

import torch

from .hostinfo import run_settings, write_json
from .ranks import rank_env, spawn_ranks
from .timing import check_after, slowest_rank

__all__ = ["main"]


def _rank_tensor(q: int, tag: int, shape: tuple[int, ...], integers: bool) -> torch.Tensor:
    """Rank ``q``'s input ``tag`` on the host, which every rank can rebuild.

    Small integers (their sums exact in bf16 at any rank count up to 8, so a reduction's reference
    is exact) or normals.
    """
    gen = torch.Generator(device="cpu").manual_seed(1234 + 7919 * q + tag)
    values = torch.randint(-4, 5, shape, generator=gen).float() if integers else torch.randn(shape, generator=gen)
    return values.to(torch.bfloat16)


def _same_bits(got: tuple, want: tuple) -> bool:
    return all(torch.equal(p.view(torch.int16), q.view(torch.int16)) for p, q in zip(got, want))


def _rank(rank: int, world: int, port: int, device: str, args: dict, results: multiprocessing.Queue) -> None:
    rank_env(rank, world, port)
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: this process's first import
    import gpucomm
    import gpucomm.fused as gf

    transport = "shm" if device == "cpu" else "cuda_ipc"
    gpucomm.init_process_group(transport=transport, kernels="triton", algo="oneshot", timeout=600)
    comm = gpucomm.get_default_communicator()
    lang = comm.new_subgroup(list(range(world)), algo="oneshot_lang")
    on_gpu = device != "cpu"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    dev = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    gen = torch.Generator(device="cpu").manual_seed(1234 + rank)
    bf16 = torch.bfloat16
    H = args["hidden"]
    # Each pair: its two calls, how to reset their inputs (and poison their outputs) before the
    # check after the timed calls, and the reference both must give, built without a collective.
    pairs: dict[str, dict[str, object]] = {}
    wrong: list[str] = []

    def ranks_sum(tag: int, shape: tuple[int, ...]) -> torch.Tensor:
        return sum(_rank_tensor(q, tag, shape, True).float() for q in range(world)).to(bf16).to(dev)

    for T in args["tokens"]:
        x0 = _rank_tensor(rank, T, (T, H), True).to(dev)
        res0 = torch.randn(T, H, generator=gen).to(bf16).to(dev)
        w = torch.randn(H, generator=torch.Generator().manual_seed(7)).to(bf16).to(dev)
        x, res = x0.clone(), res0.clone()

        def fused(x=x, res=res, w=w):
            return gf.all_reduce_residual_rmsnorm(x, res, w, 1e-6)

        def unfused(x=x, res=res, w=w):
            s = x.clone()
            comm.all_reduce(s)
            return gf.residual_rmsnorm(s, res, w, 1e-6)

        def reset(x=x, res=res, x0=x0, res0=res0):
            x.copy_(x0)
            res.copy_(res0)

        # The sum of small integers is exact: the reference of the fused op's bits (its contract).
        want = gf.residual_rmsnorm(ranks_sum(T, (T, H)), res0, w, 1e-6)
        pairs[f"rmsnorm {T}"] = {"fused": fused, "unfused": unfused, "reset": reset, "want": want, "check": "bits"}
    m, k, n = args["m"], args["k"], args["n"]
    a = (_rank_tensor(rank, -1, (m, k), False).float() / k**0.5).to(bf16).to(dev)
    b = torch.randn(k, n, generator=gen).to(bf16).to(dev)
    gathered = torch.empty(world * m, k, dtype=bf16, device=dev)

    def ag_unfused():
        comm.all_gather_into_tensor(gathered, a)
        return torch.matmul(gathered, b)

    every_a = torch.cat([(_rank_tensor(q, -1, (m, k), False).float() / k**0.5).to(bf16) for q in range(world)]).to(dev)
    pairs["ag_matmul"] = {
        "fused": lambda: gf.all_gather_matmul(a, b),
        "unfused": ag_unfused,
        "reset": lambda: gathered.fill_(float("nan")),
        "want": torch.matmul(every_a, b),
        "check": "close",
    }
    for count in args["oneshot"]:
        t0 = _rank_tensor(rank, count, (count,), True).to(dev)
        t_lang, t_prog = t0.clone(), t0.clone()

        def one_lang(t=t_lang, t0=t0):
            t.copy_(t0)
            lang.all_reduce(t)
            return t

        def one_prog(t=t_prog, t0=t0):
            t.copy_(t0)
            comm.all_reduce(t)
            return t

        def poison(ts=(t_lang, t_prog)):
            for t in ts:
                t.fill_(float("nan"))

        pairs[f"oneshot {count}"] = {
            "fused": one_lang,
            "unfused": one_prog,
            "reset": poison,
            "want": ranks_sum(count, (count,)),
            "check": "bits",
        }

    times: dict[str, dict[str, list[list[float]]]] = {name: {"fused": [], "unfused": []} for name in pairs}
    for name, pair in pairs.items():
        for kind in ("fused", "unfused"):  # warm-up: compiles
            pair[kind]()
        sync()
        for r in range(args["rounds"]):
            for kind in ("fused", "unfused") if r % 2 == 0 else ("unfused", "fused"):
                comm.barrier()
                calls = []
                for _ in range(args["calls"]):
                    start = time.perf_counter()
                    pair[kind]()
                    sync()
                    calls.append(time.perf_counter() - start)
                times[name][kind].append(calls)
        # The check, after the timed calls: inputs reset, one more call of each, against the
        # reference (not against each other: a collective that did nothing in both would agree).
        want = pair["want"]
        for kind in ("fused", "unfused"):
            got = check_after(pair["reset"], pair[kind], dev)
            if pair["check"] == "bits":
                same = _same_bits(
                    got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)
                )
            else:
                same = torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2 * (k**0.5))
            if not same:
                wrong.append(f"{name}: {kind} differs from the reference")
    lang.close()
    gpucomm.destroy_process_group()
    results.put((rank, {"times": times, "wrong": wrong}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--m", type=int, default=512, help="rows of a shard")
    parser.add_argument("--k", type=int, default=8192)
    parser.add_argument("--n", type=int, default=3584)
    parser.add_argument(
        "--oneshot", type=int, nargs="+", default=[4, 4096, 32768], help="elements of the one-shot pairs"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    per_rank = spawn_ranks(_rank, args.nproc, args.device, vars(args), timeout=1800)
    wrong = [w for r in sorted(per_rank) for w in per_rank[r]["wrong"]]
    rows = []
    for name in per_rank[0]["times"]:
        row = {
            "pair": name,
            "wrong": [w for r in sorted(per_rank) for w in per_rank[r]["wrong"] if w.startswith(f"{name}:")],
        }
        for kind in ("fused", "unfused"):
            # Per round: per call the slowest rank, the median over calls; then the median over rounds.
            by_round = zip(*(per_rank[r]["times"][name][kind] for r in sorted(per_rank)))
            row[f"{kind}_us"] = round(statistics.median(slowest_rank(calls) for calls in by_round) * 1e6, 1)
        row["fused/unfused"] = round(row["fused_us"] / row["unfused_us"], 3)
        rows.append(row)
    print(
        f"{'pair':>16} {'fused us':>10} {'unfused us':>11} {'ratio':>7}   "
        "(oneshot: language / program kernel; slowest rank)"
    )
    for row in rows:
        print(
            f"{row['pair']:>16} {row['fused_us']:10.1f} {row['unfused_us']:11.1f} {row['fused/unfused']:7.3f}"
            + ("  WRONG" if row["wrong"] else "")
        )
    print("results: " + ("all correct" if not wrong else "WRONG: " + "; ".join(wrong[:5])))
    if args.json:
        write_json(args.json, run_settings(args), rows=rows, wrong=wrong)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
