"""Every collective of the matrix under torchrun, with gpucomm's own paths (shm, torch kernels).

Run by two torchrun agents (``--nnodes 2``): each rank writes its failures, all_reduce digests
and GPUCOMM_DEBUG=INFO lines to $RESULT_DIR/rank<R>.json (tests/distributed/test_across_nodes.py).
"""

from __future__ import annotations

import io
import json
import logging
import os
from pathlib import Path

from collective_matrix import Matrix, run_everything
from two_level import two_level_checks

import gpucomm as dist

dist.init_process_group(transport="shm", kernels="torch", debug="INFO", timeout=60)
stream = io.StringIO()
logging.getLogger("gpucomm").addHandler(logging.StreamHandler(stream))
rank, world_size = dist.get_rank(), dist.get_world_size()
per_node = int(os.environ["LOCAL_WORLD_SIZE"])
m = Matrix(int(os.environ["SEED"]))
run_everything(m, sizes=(0, 7))
nodes = [list(range(k, k + per_node)) for k in range(0, world_size, per_node)]
failures = m.failures + two_level_checks(rank, world_size, int(os.environ["SEED"]), nodes)
dist.destroy_process_group()
result = {
    "failures": failures,
    "digests": m.digests,
    "log": stream.getvalue().splitlines(),
    "local_world_size": per_node,
}
Path(os.environ["RESULT_DIR"], f"rank{rank}.json").write_text(json.dumps(result))
