"""The plans of the workspace collectives' matrix (what tests/support/collective_matrix.py's
``workspace_rank`` runs, label by label) and the check of what the ranks sent back. Shared by
tests/workspace/test_workspace_collectives.py (shm, CPU) and
tests/gpu/test_workspace_collectives_gpu.py (cuda_ipc).

A plan is a list of (label, algorithm its log lines must name, Config fields, "full" or "lean",
arguments of the run).
"""

from __future__ import annotations

__all__ = ["ALGOS", "SIZES", "TINY", "WORKSPACE", "check_results", "labels_of", "torch_plan"]

SIZES = (0, 1, 7, 4099)
ALGOS = ("oneshot", "twoshot", "ring", "tree", "direct", "spread")
# 48 KiB of data per rank: 12 KiB of mailboxes, two 18 KiB halves (4099 elements still take
# a few pieces in most algorithms); 4 KiB, the smallest workspace: 4099 elements take 3 to
# 100+ pieces in every algorithm.
WORKSPACE = "48K"
TINY = 4096  # a Config field, not a knob string: given as bytes


def check_results(results: list[dict], seed: int, labels: dict[str, str], kernels: str = "torch") -> None:
    """Fail unless, for every label, no rank found a wrong result, every rank's all_reduce results
    are bitwise rank 0's, and every call each rank logged was served on the workspace path with the
    label's algorithm and ``kernels``. ``labels`` maps each plan label to that algorithm."""
    for label, algo in labels.items():
        failures = [f for per_rank in results for f in per_rank[label][0]]
        assert not failures, f"{label}, seed {seed}:\n" + "\n".join(failures[:40])
        digests = [per_rank[label][1] for per_rank in results]
        for r, d in enumerate(digests):
            assert d == digests[0], f"{label}, seed {seed}: rank {r}'s all_reduce results differ bitwise from rank 0's"
        for r, per_rank in enumerate(results):
            log = [line for line in per_rank[label][2] if " stage " not in line]  # a call's stages: its own lines
            assert log, f"{label}: rank {r} logged no call"
            expected = (" path=workspace ", f" algo={algo} ", f" kernels={kernels}")
            off_path = [line for line in log if not all(e in line for e in expected)]
            assert not off_path, f"{label}: rank {r} has calls not served as {expected}: {off_path[:3]}"


def torch_plan(world_size: int) -> list[tuple]:
    """The whole matrix per algorithm, the many-pieces pass, and the hierarchical all_reduce."""
    plan = [(algo, algo, {"algo": algo}, "full", (SIZES,)) for algo in ALGOS]
    plan += [(f"{algo} in 4K", algo, {"algo": algo, "workspace_bytes": TINY}, "lean", ((4099,),)) for algo in ALGOS]
    if world_size == 4:
        plan.append(("hierarchical", "hierarchical", {"local_world_size": 2}, "full", (SIZES,)))
        # The node's stages forced onto the ring, in a workspace where they take many pieces.
        ring = {"local_world_size": 2, "algo": "ring", "workspace_bytes": TINY}
        plan.append(("hierarchical ring in 4K", "hierarchical", ring, "lean", ((4099,),)))
    return plan


def labels_of(plan: list[tuple]) -> dict[str, str]:
    """{label: the algorithm its log lines must name} of a plan."""
    return {label: algo for label, algo, _, _, _ in plan}
