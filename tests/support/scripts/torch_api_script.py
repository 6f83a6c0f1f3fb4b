"""A script written against torch.distributed's API, with only the import swapped.

tests/distributed/test_torchrun.py runs it under torchrun twice: as it is (gpucomm) and with the first
import line put back to ``import torch.distributed as dist``; both runs must print the same.
"""

import json
import os
import sys

import torch

import gpucomm as dist

dist.init_process_group()
rank, world = dist.get_rank(), dist.get_world_size()
out: dict[str, object] = {}
x = torch.arange(6, dtype=torch.float32) + rank

t = x.clone()
dist.all_reduce(t, op=dist.ReduceOp.SUM)
out["all_reduce"] = t.tolist()
t = x.clone()
dist.all_reduce(t, op=dist.ReduceOp.MAX)
out["all_reduce_max"] = t.tolist()
t = x.clone()
dist.reduce(t, dst=1, op=dist.ReduceOp.PRODUCT)
out["reduce"] = t.tolist() if rank == 1 else None
t = x.clone()
dist.broadcast(t, src=2)
out["broadcast"] = t.tolist()
outs = [torch.empty(6) for _ in range(world)]
dist.all_gather(outs, x)
out["all_gather"] = [o.tolist() for o in outs]
big = torch.empty(6 * world)
dist.all_gather_into_tensor(big, x)
out["all_gather_into_tensor"] = big.tolist()
gl = [torch.empty(6) for _ in range(world)] if rank == 0 else None
dist.gather(x, gl, dst=0)
out["gather"] = [g.tolist() for g in gl] if gl else None
s = torch.empty(2)
dist.scatter(s, [torch.full((2,), float(i)) for i in range(world)] if rank == 0 else None, src=0)
out["scatter"] = s.tolist()
rs = torch.empty(2)
dist.reduce_scatter(rs, [x[:2] * (i + 1) for i in range(world)])
out["reduce_scatter"] = rs.tolist()
rst = torch.empty(2)
dist.reduce_scatter_tensor(rst, torch.arange(2 * world, dtype=torch.float32) * (rank + 1))
out["reduce_scatter_tensor"] = rst.tolist()
a2a = [torch.empty(1) for _ in range(world)]
dist.all_to_all(a2a, [torch.tensor([float(10 * rank + j)]) for j in range(world)])
out["all_to_all"] = [a.tolist() for a in a2a]
a2s = torch.empty(world)
dist.all_to_all_single(a2s, torch.arange(world, dtype=torch.float32) + 100 * rank)
out["all_to_all_single"] = a2s.tolist()
if rank == 0:
    dist.send(x, dst=1)
    req = dist.irecv(t, src=2)
    req.wait()
    out["recv"] = t.tolist()
elif rank == 1:
    dist.recv(t, src=0)
    out["recv"] = t.tolist()
elif rank == 2:
    dist.isend(x, dst=0).wait()
work = dist.all_reduce(x, async_op=True)
work.wait()
out["async_all_reduce"] = x.tolist()
dist.barrier()
dist.destroy_process_group()
# One file per rank: torchrun merges the ranks' stdout, and long lines can interleave there.
with open(os.path.join(os.environ["RESULT_DIR"], f"rank{rank}.json"), "w") as f:
    json.dump(out, f, sort_keys=True)
sys.exit(0)
