"""Bad-input fuzz: random argument combinations, valid and invalid, for every collective.

Each draw is one call, the same on every rank (each rank draws it from a generator seeded by
the seed and the draw's number, so every rank knows every rank's arguments): a collective, a
dtype, a piece size, an op and a root, the buffers laid out in one flat tensor at random
offsets or overlapping (tests/support/overlap_cases.py), and at most one fault: a non-contiguous view, a
wrong dtype, element count, list length or root, a bad op, a meta tensor, a non-tensor, split
sizes that do not add up, a root outside the group, or sizes or roots that differ across ranks;
from 3 ranks on, some draws run on a subgroup of all ranks but the last (which stays out).
Then, on every rank:

- a draw without a fault gives the result of the call made on separate buffers in checked gloo
  (whose op and dtype rules are the reference: a combination it refuses must be refused too);
- a draw with a fault raises a typed error (TypeError, ValueError or a GpucommError) on every
  rank, and leaves every buffer of the call as it was: nothing moved;
- nothing hangs: the ranks' own timeout is a few seconds and the harness kills a run past its
  deadline.

Runs on the shared-memory workspace with the torch kernels and with the Triton kernels under the
interpreter (the emulated device path): a fixed seed and a few draws in CI, and a longer run with
``--run-slow`` (GPUCOMM_FUZZ_SEED and GPUCOMM_FUZZ_DRAWS choose the seed and the number).
"""

from __future__ import annotations

import os
import random

import pytest
from spawn import run_ranks

CI_SEED = 20261126
# Each rank's collective timeout. A fault only the root can see (a scatter_list of another dtype
# than the tensor) leaves the other ranks in the call until they time out: CommTimeoutError.
TIMEOUT_S = 3.0
REFERENCE_TIMEOUT_S = 60.0

COLLECTIVES = (
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
)
ROOTED = ("reduce", "broadcast", "gather", "scatter")
REDUCING = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor")
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "int16", "int8", "uint8", "bool", "complex64")
OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AVG")
# Faults that every rank makes alike: each rank raises on its own.
LOCAL_FAULTS = (
    "noncontiguous",
    "dtype",
    "numel",
    "list_length",
    "root",
    "op",
    "meta",
    "not_a_tensor",
    "splits",
    "root_outside",
)
# Faults where each rank's call is well formed but the ranks' calls differ.
CROSS_FAULTS = ("differ_size", "differ_root")


def draw(seed: int, i: int, world_size: int) -> dict:
    """The ``i``-th call of the run: every rank draws the same."""
    rng = random.Random(f"{seed}/{i}/{world_size}")
    fn = rng.choice(COLLECTIVES)
    spec = {
        "fn": fn,
        "dtype": rng.choice(DTYPES),
        "n": rng.choice((1, 2, 4, 6, 10)),
        "op": rng.choice(OPS),
        "root": rng.randrange(world_size),
        "overlap": rng.random() < 0.3,
        "gaps": [rng.randrange(3) for _ in range(4 * world_size + 4)],
        "splits": fn == "all_to_all_single" and rng.random() < 0.4,
        "matrix": [[rng.randrange(4) for _ in range(world_size)] for _ in range(world_size)],
        "odd_rank": rng.randrange(world_size),
        "pick": rng.random(),
        "group": world_size >= 3 and rng.random() < 0.3,  # on a subgroup of all ranks but the last
        "rows": rng.random() < 0.3,  # tensors of two columns
        "async": rng.random() < 0.3,  # async_op=True, then wait()
        "strided": rng.random() < 0.5,  # one-element tensors as views of stride 2
        "fault": None,
    }
    if rng.random() < 0.5:
        applicable = [f for f in (*LOCAL_FAULTS, *CROSS_FAULTS) if _applies(f, spec, world_size)]
        spec["fault"] = rng.choice(applicable)
    if spec["fault"] == "noncontiguous":
        spec["n"] = max(spec["n"], 2)
    return spec


def _applies(fault: str, spec: dict, world_size: int) -> bool:
    fn = spec["fn"]
    single = fn in ("all_reduce", "reduce", "broadcast")
    if fault in ("dtype",):
        return not single
    if fault == "noncontiguous":  # pieces of one element would be contiguous all the same
        return fn != "all_to_all" and not spec["splits"]
    if fault == "numel":
        return fn in (
            "all_gather",
            "all_gather_into_tensor",
            "gather",
            "scatter",
            "reduce_scatter",
            "reduce_scatter_tensor",
            "all_to_all_single",
        )
    if fault == "list_length":
        return fn in ("all_gather", "gather", "scatter", "reduce_scatter", "all_to_all")
    if fault in ("root", "root_outside", "differ_root"):
        return fn in ROOTED and (fault != "differ_root" or world_size > 1)
    if fault == "op":
        return fn in REDUCING
    if fault == "splits":
        return fn == "all_to_all_single"
    if fault == "differ_size":  # all_to_all's sizes, and split sizes, are drawn per pair already
        return fn != "all_to_all" and not spec["splits"] and world_size > 1
    return True


def layout(spec: dict, rank: int, world_size: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]], int]:
    """``(output spans, input spans, buffer size)`` of this rank's call."""
    from overlap_cases import cases

    fn, w, root = spec["fn"], world_size, spec["root"]
    n = spec["n"] + (1 if spec["fault"] == "differ_size" and rank == spec["odd_rank"] else 0)
    if spec["overlap"] and fn not in ("all_reduce", "reduce", "broadcast") and not spec["splits"]:
        # gather's and scatter's cases are laid out for roots 0 and world_size - 1 only.
        found = [c for c in cases(rank, w, 2 * n) if c[1] == fn and (fn not in ROOTED or c[4] == root)]
        if found:
            _, _, outs, ins, _ = found[int(spec["pick"] * len(found))]
            return outs, ins, (2 * w + 2) * 2 * n
    m = spec["matrix"]
    mine = rank == root
    sizes: dict[str, tuple[list[int], list[int]]] = {
        "all_reduce": ([n], []),
        "reduce": ([n], []),
        "broadcast": ([n], []),
        "all_gather": ([n] * w, [n]),
        "all_gather_into_tensor": ([w * n], [n]),
        "gather": ([n] * w if mine else [], [n]),
        "scatter": ([n], [n] * w if mine else []),
        "reduce_scatter": ([n], [n] * w),
        "reduce_scatter_tensor": ([n], [w * n]),
        # Pair (r, j) carries m[r][j] + n elements: sizes differ per pair, and agree between the pair.
        "all_to_all": ([m[j][rank] + n for j in range(w)], [m[rank][j] + n for j in range(w)]),
        "all_to_all_single": ([sum(m[j][rank] for j in range(w))], [sum(m[rank])])
        if spec["splits"]
        else ([w * n], [w * n]),
    }
    outs, ins = sizes[fn]
    spans, at = [], 0
    for k, numel in enumerate([*outs, *ins]):
        at += spec["gaps"][k]
        spans.append((at, numel))
        at += numel
    return spans[: len(outs)], spans[len(outs) :], at + 1


def fill(rank: int, size: int, dtype: object) -> object:
    """Small values (1 to 10): a product of four stays exact in float16, sums in every dtype."""
    import torch

    values = torch.arange(size, dtype=torch.int64) % 7 + rank + 1
    return values.to(dtype)


def make_call(spec: dict, rank: int, world_size: int, comm: object, buf: object, outs: list, ins: list) -> object:
    """A function that makes the drawn call (its fault applied) on views of ``buf``."""
    import torch

    import gpucomm as dist

    fn, fault, w = spec["fn"], spec["fault"], world_size
    dtype = buf.dtype
    # One element sliced with step 2 has stride 2 and is contiguous all the same (torch ignores
    # the strides of size-1 dims).
    step = 2 if spec["strided"] else 1
    o = [buf[a : a + k : step if k == 1 else 1] for a, k in outs]
    i = [buf[a : a + k : step if k == 1 else 1] for a, k in ins]
    if spec["rows"] and fn != "all_to_all_single" and all(t.numel() % 2 == 0 for t in o + i):
        # Two columns: the same bytes, so the same result as the flat call (all_to_all_single
        # splits dim 0 and keeps its flat form).
        o, i = [t.view(-1, 2) for t in o], [t.view(-1, 2) for t in i]
    op = getattr(dist.ReduceOp, spec["op"])
    root = spec["root"]
    if fault == "differ_root" and rank == spec["odd_rank"]:
        root = (root + 1) % w
    if fault == "root":
        root = (w, -1, "0", 1.0)[int(spec["pick"] * 4)]
    if fault == "root_outside":
        root = w + 3
    if fault == "op":
        op = ("sum", 1, None)[int(spec["pick"] * 3)]
    target = o if o else i  # the list the fault lands in
    k = int(spec["pick"] * len(target)) if target else 0
    if fault == "noncontiguous" and target:
        t = torch.empty(2 * target[k].numel(), dtype=dtype)[::2]
        t.copy_(target[k].reshape(-1))
        target[k] = t
    elif fault == "dtype" and target:
        target[k] = target[k].to(torch.float64 if dtype != torch.float64 else torch.float32)
    elif fault == "numel" and target:
        target[k] = torch.zeros(target[k].numel() + 1, dtype=dtype)
    elif fault == "meta" and target:
        target[k] = torch.empty(target[k].shape, dtype=dtype, device="meta")
    elif fault == "not_a_tensor" and target:
        target[k] = target[k].tolist()
    elif fault == "list_length":
        # The call's list, one tensor too long (on a rank that passes no list: a list of one).
        listed = {"reduce_scatter": i, "scatter": i, "gather": o}.get(fn, o)
        listed.append(listed[0] if listed else (i or o)[0])
    splits = {}
    if spec["splits"]:
        m = spec["matrix"]
        splits = {"output_split_sizes": [m[j][rank] for j in range(w)], "input_split_sizes": list(m[rank])}
        if fault == "splits":
            splits["input_split_sizes"][0] += 1
    elif fault == "splits":
        splits = {"output_split_sizes": [n := o[0].numel() // w] * w, "input_split_sizes": [n + 1] * w}
    asynchronous = spec["async"]
    calls = {
        "all_reduce": lambda: comm.all_reduce(o[0], op, async_op=asynchronous),
        "reduce": lambda: comm.reduce(o[0], root, op, async_op=asynchronous),
        "broadcast": lambda: comm.broadcast(o[0], root, async_op=asynchronous),
        "all_gather": lambda: comm.all_gather(o, i[0], async_op=asynchronous),
        "all_gather_into_tensor": lambda: comm.all_gather_into_tensor(o[0], i[0], async_op=asynchronous),
        "gather": lambda: comm.gather(i[0], o or None, root, async_op=asynchronous),
        "scatter": lambda: comm.scatter(o[0], i or None, root, async_op=asynchronous),
        "reduce_scatter": lambda: comm.reduce_scatter(o[0], i, op, async_op=asynchronous),
        "reduce_scatter_tensor": lambda: comm.reduce_scatter_tensor(o[0], i[0], op, async_op=asynchronous),
        "all_to_all": lambda: comm.all_to_all(o, i, async_op=asynchronous),
        "all_to_all_single": lambda: comm.all_to_all_single(o[0], i[0], **splits, async_op=asynchronous),
    }

    def made() -> None:
        work = calls[fn]()
        if work is not None:  # async_op: the error may come from wait()
            work.wait()

    return made


def _fuzz_rank(rank: int, world_size: int, kernels: str, seed: int, draws: int) -> list[tuple[int, str, str]]:
    """Every draw on this rank: ``(draw, what it was, verdict)``; the verdict starts with "ok",
    "raised" (a typed error, nothing moved), "skipped" (a draw on a group this rank is not in)
    or "WRONG"."""
    import dataclasses

    import torch

    import gpucomm as dist
    from gpucomm.comm.communicator import Communicator

    dist.init_process_group(transport="shm", kernels=kernels, timeout=TIMEOUT_S)
    world = dist.get_default_communicator()
    made = 0
    members = list(range(world_size - 1))  # the subgroup of group draws (3 ranks or more)

    def fresh(**knobs: object) -> tuple[Communicator, Communicator | None]:
        nonlocal made
        made += 1
        config = dataclasses.replace(world.config, **knobs)
        whole = Communicator(world.store, rank, world_size, prefix=f"{world.prefix}f{made}/", config=config)
        return whole, whole.new_subgroup(members) if world_size >= 3 else None

    # The reference waits longer than the fuzzed communicator, so that a draw that leaves one rank
    # waiting out TIMEOUT_S there finds its peers still in the reference's next call.
    (reference, ref_group), (comm, group) = fresh(transport="gloo", timeout=REFERENCE_TIMEOUT_S), fresh()
    if not comm.paths().get("cpu", "").startswith("workspace"):
        return [(-1, "setup", f"WRONG: the fuzz communicator serves CPU tensors on {comm.paths()}")]
    verdicts = []
    for d in range(draws):
        spec = draw(seed, d, world_size)
        what = (
            f"{spec['fn']} {spec['dtype']} n={spec['n']} op={spec['op']} root={spec['root']} overlap={spec['overlap']} "
            f"splits={spec['splits']} group={spec['group']} rows={spec['rows']} async={spec['async']} "
            f"fault={spec['fault']}"
        )
        if not spec["group"]:
            verdict, broken = _one_draw(spec, rank, world_size, comm, reference)
        elif rank in members:
            w = len(members)
            spec = {
                **spec,
                "root": spec["root"] % w,
                "odd_rank": spec["odd_rank"] % w,
                "matrix": [row[:w] for row in spec["matrix"][:w]],
            }
            verdict, broken = _one_draw(spec, members.index(rank), w, group, ref_group)
        else:
            verdict, broken = "skipped: not in the group", False
        verdicts.append((d, what, verdict))
        # Whether any rank's communicator may be broken, agreed in gloo: then all take a fresh one,
        # so that a rank that failed alone cannot leave the others in a collective of its old one.
        flag = torch.tensor([int(broken)])
        reference.all_reduce(flag, dist.ReduceOp.MAX)
        if flag.item():
            for old in (comm, group):
                if old is not None:
                    old.close()
            comm, group = fresh()
    for old in (comm, group, reference, ref_group):
        if old is not None:
            old.close()
    dist.destroy_process_group()
    return verdicts


def _one_draw(spec: dict, rank: int, world_size: int, comm: object, reference: object) -> tuple[str, bool]:
    """One draw on ``comm`` as ``rank`` of ``world_size``: its verdict, and whether ``comm`` may be broken."""
    import torch
    from overlap_cases import views

    import gpucomm as dist

    dtype = getattr(torch, spec["dtype"])
    outs, ins, size = layout(spec, rank, world_size)
    expected, refused = None, None
    if spec["fault"] is None:
        # The call on separate buffers in checked gloo: its result, or the error it raises.
        ref_buf = fill(rank, size, dtype)
        own_outs = [v.clone() for v in views(ref_buf, outs)]  # all_reduce's and others' are inputs too
        ref_ins = [v.clone() for v in views(ref_buf, ins)]
        try:
            _call_on(spec, rank, world_size, reference, own_outs, ref_ins)
            expected = ref_buf.clone()
            for (a, k), t in zip(outs, own_outs, strict=True):
                expected[a : a + k] = t
        except (TypeError, ValueError, dist.GpucommError) as err:
            refused = err
    buf = fill(rank, size, dtype)
    before = buf.clone()
    try:
        make_call(spec, rank, world_size, comm, buf, outs, ins)()
    except (TypeError, ValueError, dist.GpucommError) as err:
        broken = isinstance(err, dist.GpucommError)  # a failed exchange breaks the communicator
        if spec["fault"] is None and refused is None:
            return f"WRONG: raised {type(err).__name__} on a call checked gloo serves: {err}", broken
        if not torch.equal(buf, before):
            return f"WRONG: raised {type(err).__name__} after data moved: {err}", broken
        return f"raised {type(err).__name__}", broken
    except Exception as err:  # noqa: BLE001 - any other type is the finding, reported with its text
        return f"WRONG: untyped {type(err).__name__}: {err}", True
    return _verdict(spec, refused, buf, expected), False


def _verdict(spec: dict, refused: BaseException | None, buf: object, expected: object) -> str:
    import torch

    if spec["fault"] is not None:
        return "WRONG: the fault raised nothing"
    if refused is not None:
        return f"WRONG: served a call checked gloo refuses ({refused})"
    if not torch.equal(buf, expected):
        return f"WRONG: got {buf.tolist()}, separate buffers in gloo give {expected.tolist()}"
    return "ok"


def _call_on(spec: dict, rank: int, world_size: int, comm: object, outs: list, ins: list) -> None:
    """The drawn call, without its fault, on the given separate tensors."""
    import torch

    flat = torch.cat([t.reshape(-1) for t in [*outs, *ins]]) if outs or ins else torch.empty(0)
    spans, at = [], 0
    for t in [*outs, *ins]:
        spans.append((at, t.numel()))
        at += t.numel()
    make_call(spec, rank, world_size, comm, flat, spans[: len(outs)], spans[len(outs) :])()
    for (a, k), t in zip(spans[: len(outs)], outs, strict=True):
        t.copy_(flat[a : a + k])


def _check(results: list[list[tuple[int, str, str]]], seed: int) -> tuple[int, int]:
    """Every rank's verdicts right and alike (all served or all raised); returns (served, raised)."""
    problems = []
    served = raised = 0
    for d, per_rank in enumerate(zip(*results, strict=True)):
        kinds = {v.split(" ")[0].rstrip(":") for _, _, v in per_rank} - {"skipped"}
        wrong = [f"rank {r}: {v}" for r, (_, _, v) in enumerate(per_rank) if v.startswith("WRONG")]
        if wrong or len(kinds) > 1:
            problems.append(
                f"draw {d} ({per_rank[0][1]}): "
                + "; ".join(wrong or [f"rank {r}: {v}" for r, (_, _, v) in enumerate(per_rank)])
            )
        served += kinds == {"ok"}
        raised += kinds == {"raised"}
    assert not problems, f"seed {seed}: {len(problems)} draws wrong:\n" + "\n".join(problems[:20])
    return served, raised


@pytest.mark.parametrize(
    ("kernels", "world_size", "draws", "env"),
    [
        pytest.param("torch", 2, 60, {}, id="shm-torch-2"),
        pytest.param("torch", 3, 30, {}, id="shm-torch-3"),
        pytest.param("triton", 2, 25, {"TRITON_INTERPRET": "1"}, id="shm-triton-interpreter-2"),
    ],
)
def test_bad_input_fuzz_fixed_seed(kernels: str, world_size: int, draws: int, env: dict) -> None:
    results = run_ranks(_fuzz_rank, world_size, kernels, CI_SEED, draws, env=env, timeout=240)
    served, raised = _check(results, CI_SEED)
    # The draws cover both outcomes (about half the draws carry a fault).
    assert served and raised, f"seed {CI_SEED}: {served} served and {raised} raised of {draws}"


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_bad_input_fuzz_long(kernels: str, world_size: int) -> None:
    seed = int(os.environ.get("GPUCOMM_FUZZ_SEED", random.randrange(1 << 30)))
    draws = int(os.environ.get("GPUCOMM_FUZZ_DRAWS", 400 if kernels == "torch" else 100))
    env = {"TRITON_INTERPRET": "1"} if kernels == "triton" else {}
    results = run_ranks(_fuzz_rank, world_size, kernels, seed, draws, env=env, timeout=3600)
    _check(results, seed)
