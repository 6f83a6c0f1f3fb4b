"""The performance model (bench/model.py's parameters) for gpucomm.fused on 8 x H100.

1. all_reduce_residual_rmsnorm of T tokens of hidden H (bf16), fused against unfused. The fused
   kernel copies its rows into the stage, meets every rank at one barrier per piece of rows that
   fits a stage half, then reads every rank's rows over NVLink and normalises them:

       fused   = launch + pieces * sync + max(link / (link_bw * share), (local + link) / hbm_bw)
       link    = (P - 1) * n                   n = T * H * 2 bytes: this rank's x
       local   = 6 n + 2 H                     x read, stage written and read, residual read,
                                               out and the new residual written; the weight
       share   = min(1, grid / saturating_grid), grid = min(T, channels)

   The two-shot form (each rank reduces 1/P of the rows and publishes their sums, then every
   rank normalises every row): 2 syncs per piece, link = 2 (P - 1)/P n (x's rows of its own
   rows, the others' sums), local ~ 7 n, grid = min(ceil(T / P), channels).

   Unfused: gpucomm's best program-kernel all_reduce for n bytes (bench/model.py's count and
   predict), then the norm kernel: launch + 4 n / hbm_bw (read the sum and the residual, write
   out and the new residual). Eager adds the host's Python per call: one call against two.

2. all_gather_matmul of shards [m, k] (bf16) times [k, N]: the fraction of the gather the fused
   launches hide, (unfused - fused) / the unfused gather's time.

   Unfused: gpucomm's all_gather (every shard over NVLink at link_bw, a launch and a sync), then
   the matmul (2 M k N flops at ``mma_tflops``, M = P m).

   Fused: two launches on one stream (kernels/triton/fused_matmul.py).

   - The push launch: G of the SMs push this rank's shard to the 7 peers, one after another, at
     G / saturating_grid of the link, while the others compute the own shard's tiles at
     (SMs - G) / SMs of the rate; it ends when both are done.
   - The matmul launch (a launch more): the other shards' tiles at the full rate. The shard of
     rank me - i arrived after i pushes (plus a sync); its tiles start then or when the previous
     shard's end, whichever is later (every rank in step: all have arrived by the time this
     rank's push launch ends).

   Only the own shard's tiles overlap this rank's pushes: the tiles of a shard that waits cannot
   share a launch with the pushes (progress would depend on which blocks a GPU runs first).

Every parameter is bench/model.py's (assumed or published, none measured on a GPU), plus the
H100's published dense bf16 peak and an assumed fraction of it that a Triton matmul reaches.

Example::

    python -m gpucomm._bench.fused_model --json fused_model.json
"""

from __future__ import annotations

import argparse
import sys

from gpucomm.config import DEFAULT_WORKSPACE_BYTES

from . import model
from .hostinfo import run_settings, write_json

__all__ = ["main", "rmsnorm_rows", "ag_matmul"]

TOKENS = (1, 32, 256)
HIDDEN = 8192
# The Llama-3-70B shapes of the table (assumed here: the recipes' exact shapes are not recorded
# in this repository): 8192 tokens of hidden 8192 gathered from 8 ranks, times each rank's
# column shard of the fused gate and up projections (2 x 28672 / 8 = 7168 columns).
LLAMA70B_AG = {"tokens": 8192, "k": 8192, "n": 7168}
# The pushing programs of all_gather_matmul's push launch (kernels/triton/fused_matmul.CHUNKS);
# an H100's SMs.
PUSH_PROGRAMS = 16
SMS = 132
STAGE_HALF_MAX = 4 << 20  # gpucomm.workspace.layout.STAGE_HALF_MAX
TWO_SHOT_MIN_BYTES = 1 << 20  # gpucomm.fused's choice (set from this model's crossover)
CHANNELS = 32  # gpucomm.workspace.channels on an H100 with one rank per GPU: min(32, 132 // 4)


def _args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--workspace-bytes", type=int, default=DEFAULT_WORKSPACE_BYTES["cuda"])
    parser.add_argument("--launch-us", type=float, default=3.0, help="assumed (bench/model.py)")
    parser.add_argument("--sync-us", type=float, default=3.0, help="assumed (bench/model.py)")
    parser.add_argument("--link-gbs", type=float, default=450.0, help="published: NVLink 4, per direction per H100")
    parser.add_argument("--multimem-gbs", type=float, default=309.0, help="bench/model.py's (unused here)")
    parser.add_argument("--hbm-gbs", type=float, default=3000.0, help="published anchor: one H100's copy bandwidth")
    parser.add_argument("--saturating-grid", type=int, default=16, help="assumed: channels that saturate NVLink")
    parser.add_argument("--host-us", type=float, default=10.0, help="host Python per eager call (the goal)")
    parser.add_argument("--mma-tflops", type=float, default=989.0, help="published: H100 SXM dense bf16 peak")
    parser.add_argument(
        "--mma-fraction", type=float, default=0.7, help="assumed: the share of the peak a Triton matmul reaches"
    )
    parser.add_argument("--json", help="write the tables here")
    return parser.parse_args(argv)


def rmsnorm_rows(args: argparse.Namespace, hidden: int = HIDDEN, tokens: tuple[int, ...] = TOKENS) -> list[dict]:
    """Predicted device and eager microseconds, fused and unfused, per token count."""
    P = args.world
    stage_half = min(model._half_bytes(args.workspace_bytes) // 2, STAGE_HALF_MAX) // 256 * 256
    rows = []
    for T in tokens:
        n = T * hidden * 2
        pieces = -(-n // (stage_half // (hidden * 2) * hidden * 2))
        grid = min(T, CHANNELS)
        link, local = (P - 1) * n, 6 * n + 2 * hidden
        share = min(1.0, grid / args.saturating_grid)
        fused = (
            args.launch_us
            + pieces * args.sync_us
            + max(link / (args.link_gbs * 1e3 * share), (local + link) / (args.hbm_gbs * 1e3))
        )
        pieces2 = pieces
        link2 = 2 * (P - 1) * n // P
        share2 = min(1.0, min(-(-T // P), CHANNELS) / args.saturating_grid)
        fused2 = (
            args.launch_us
            + 2 * pieces2 * args.sync_us
            + max(link2 / (args.link_gbs * 1e3 * share2), (local + n + link2) / (args.hbm_gbs * 1e3))
        )
        # What gpucomm.fused's algo="auto" runs (gpucomm/fused/_norm.py: TWO_SHOT_MIN_BYTES).
        picked = fused2 if n >= TWO_SHOT_MIN_BYTES and T >= P else fused
        half = model._half_bytes(args.workspace_bytes)
        ar = min(model.predict(model.count(a, n, P, half), args) for a in ("oneshot", "twoshot"))
        norm = args.launch_us + 4 * n / (args.hbm_gbs * 1e3)
        rows.append({
            "tokens": T, "hidden": hidden, "bytes": n, "pieces": pieces, "grid": grid,
            "fused_us": round(fused, 2), "fused_twoshot_us": round(fused2, 2), "unfused_us": round(ar + norm, 2),
            "fused_auto_us": round(picked, 2), "fused_eager_us": round(picked + args.host_us, 2),
            "unfused_eager_us": round(ar + norm + 2 * args.host_us, 2),
        })  # fmt: skip
    return rows


def ag_matmul(args: argparse.Namespace, tokens: int, k: int, n: int) -> dict:
    """Predicted unfused and fused microseconds of all_gather_matmul, and the hidden fraction."""
    P = args.world
    m = tokens // P
    shard = m * k * 2
    gather = args.launch_us + args.sync_us + (P - 1) * shard / (args.link_gbs * 1e3)
    matmul = 2 * tokens * k * n / (args.mma_tflops * args.mma_fraction * 1e6)
    unfused = gather + matmul
    push_rate = args.link_gbs * 1e3 * min(1.0, PUSH_PROGRAMS / args.saturating_grid)  # bytes per us
    push_end = args.launch_us + (P - 1) * shard / push_rate
    slow = (SMS - PUSH_PROGRAMS) / SMS  # the tiles' rate while the pushes last
    per_shard = matmul / P
    # The push launch: the own shard's tiles at the slow rate beside the pushes (at the full
    # rate once they end); it ends when both are done.
    own_slow = min(per_shard, (push_end - args.launch_us) * slow)
    own_end = args.launch_us + own_slow / slow + (per_shard - own_slow)
    t = max(push_end, own_end) + args.launch_us  # the matmul launch: the other shards, full rate
    for i in range(1, P):
        arrived = args.launch_us + i * shard / push_rate + args.sync_us
        t = max(t, arrived) + per_shard
    fused = t
    return {
        "tokens": tokens, "k": k, "n": n, "world": P, "shard_bytes": shard,
        "gather_us": round(gather, 1), "matmul_us": round(matmul, 1), "unfused_us": round(unfused, 1),
        "fused_us": round(fused, 1), "hidden_fraction": round((unfused - fused) / gather, 3),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    norm = rmsnorm_rows(args)
    print(f"all_reduce_residual_rmsnorm, hidden {HIDDEN}, bf16, {args.world} ranks (predicted, us)")
    print(
        f"{'tokens':>7} {'pieces':>6} {'fused 1-shot':>12} {'fused 2-shot':>12} {'fused auto':>10} {'unfused':>8} "
        f"{'fused eager':>12} {'unfused eager':>14}"
    )
    for r in norm:
        print(
            f"{r['tokens']:>7} {r['pieces']:>6} {r['fused_us']:12.1f} {r['fused_twoshot_us']:12.1f} "
            f"{r['fused_auto_us']:10.1f} {r['unfused_us']:8.1f} {r['fused_eager_us']:12.1f} "
            f"{r['unfused_eager_us']:14.1f}"
        )
    sweep = rmsnorm_rows(args, tokens=tuple(2**i for i in range(10)))
    # From a row per rank on, where two-shot stays ahead at every larger count.
    ahead = [
        r["tokens"] >= args.world
        and all(q["fused_twoshot_us"] < q["fused_us"] for q in sweep if q["tokens"] >= r["tokens"])
        for r in sweep
    ]
    crossover = next((r["tokens"] for r, a in zip(sweep, ahead) if a), None)
    print(f"two-shot ahead of one-shot from {crossover} tokens of {HIDDEN} (predicted)")
    ag = ag_matmul(args, **LLAMA70B_AG)
    print(
        f"all_gather_matmul {ag['tokens']} x {ag['k']} gathered from {ag['world']} ranks, "
        f"times {ag['k']} x {ag['n']} (predicted):"
    )
    print(
        f"  gather {ag['gather_us']} us + matmul {ag['matmul_us']} us = {ag['unfused_us']} us unfused; "
        f"fused {ag['fused_us']} us; hidden fraction of the gather {ag['hidden_fraction']:.0%}"
    )
    if args.json:
        write_json(
            args.json,
            run_settings(args),
            rmsnorm=norm,
            rmsnorm_sweep=sweep,
            twoshot_from_tokens=crossover,
            all_gather_matmul=ag,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
