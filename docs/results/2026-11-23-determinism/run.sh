#!/usr/bin/env bash
# What the deterministic contract costs (docs/algorithms.md, "What the contract costs"):
# all_reduce at 4 ranks on the CPU shared-memory workspace (torch kernels), every algorithm at
# every size from 8 B to 16 MiB, with torch's default intra-op threads and with
# OMP_NUM_THREADS=1. Each round runs every (threads, algorithm) pair once, the order of the
# algorithms reversed every other round; the summary takes each cell's median over rounds.
# Run from the repository root: bash docs/results/2026-11-23-determinism/run.sh [rounds]
set -euo pipefail
out=docs/results/2026-11-23-determinism
rounds=${1:-3}
algos=(oneshot twoshot ring tree)
for r in $(seq 1 "$rounds"); do
  order=("${algos[@]}")
  if (( r % 2 == 0 )); then order=(tree ring twoshot oneshot); fi
  for threads in default 1; do
    for a in "${order[@]}"; do
      env_args=()
      if [[ $threads == 1 ]]; then env_args=(OMP_NUM_THREADS=1); fi
      env "${env_args[@]}" gpucomm-bench all_reduce --nproc 4 --transport shm --kernels torch --algo "$a" \
        -b 8 -e 16M -f 2 -n 10 -w 3 --json "$out/ar_np4_${a}_omp${threads}_r${r}.json" > "$out/ar_np4_${a}_omp${threads}_r${r}.log" 2>&1
    done
  done
done
python - "$out" <<'PY'
import glob, json, os, statistics, sys

sys.path.insert(0, os.getcwd())
from gpucomm.algorithms import select

out = sys.argv[1]
ALGOS = ("oneshot", "twoshot", "ring", "tree")
PLACES = ("out_of_place", "in_place")
cells = {}  # (threads, algo, place, size) -> the medians of the rounds that ran
for path in sorted(glob.glob(f"{out}/ar_np4_*_r*.json")):
    _, _, algo, threads, _ = os.path.basename(path)[:-5].split("_")
    for table in json.load(open(path))["tables"]:
        for row in table["rows"]:
            for place in PLACES:
                cells.setdefault((threads[3:], algo, place, row["size"]), []).append(row[place]["time_us"])
summary = {"rows": []}
for threads in ("default", "1"):
    print(f"\nOMP_NUM_THREADS {'unset' if threads == 'default' else '= 1'}: medians over rounds in us, out-of-place / in-place")
    print("\n| size | auto picks | its time | fastest of all four | contract's best / fastest | auto / fastest |")
    print("|---:|---|---:|---:|---:|---:|")
    for size in sorted({k[3] for k in cells if k[0] == threads}):
        med = {(a, p): statistics.median(cells[(threads, a, p, size)]) for a in ALGOS for p in PLACES}
        pick = select.choose("all_reduce", size, 4, "shm", "auto")
        fastest = {p: min(ALGOS, key=lambda a: med[(a, p)]) for p in PLACES}
        keeper = {p: min(("oneshot", "twoshot"), key=lambda a: med[(a, p)]) for p in PLACES}
        best = [med[(keeper[p], p)] / med[(fastest[p], p)] for p in PLACES]
        auto = [med[(pick, p)] / med[(fastest[p], p)] for p in PLACES]
        f = lambda a, p: f"{med[(a, p)]:.0f}"  # noqa: E731
        print(
            f"| {size} | {pick} | {f(pick, 'out_of_place')} / {f(pick, 'in_place')} | "
            f"{fastest['out_of_place']} {f(fastest['out_of_place'], 'out_of_place')} / {fastest['in_place']} {f(fastest['in_place'], 'in_place')} | "
            f"{best[0]:.2f} / {best[1]:.2f} | {auto[0]:.2f} / {auto[1]:.2f} |"
        )
        summary["rows"].append({
            "omp_num_threads": threads, "size": size, "auto": pick, "rounds": {a: len(cells[(threads, a, "in_place", size)]) for a in ALGOS},
            "median_us": {f"{a} {p}": v for (a, p), v in med.items()}, "fastest": fastest,
            "contract_best_over_fastest": best, "auto_over_fastest": auto,
        })
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
PY
