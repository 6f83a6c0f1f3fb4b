"""Out-of-place over in-place per size, one column per run, for each backend (gpucomm-bench JSON).

python docs/results/2026-11-29-bench-oop/into_table.py docs/results/2026-11-29-bench-oop/into_run*.json
"""

import json
import sys


def _size(nbytes: int) -> str:
    for unit, shift in (("M", 20), ("K", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes >> shift}{unit}"
    return str(nbytes)


def main() -> None:
    reports = [json.load(open(p)) for p in sys.argv[1:]]
    ratios: dict[str, dict[int, list[float]]] = {}
    for report in reports:
        for table in report["tables"]:
            for r in table["rows"]:
                q = r["out_of_place"]["time_us"] / r["in_place"]["time_us"]
                ratios.setdefault(table["backend"], {}).setdefault(r["size"], []).append(q)
    for backend, rows in ratios.items():
        print(f"| {backend} size | " + " | ".join(f"run {i + 1}" for i in range(len(reports))) + " |")
        print("|---" * (len(reports) + 1) + "|")
        for size, qs in rows.items():
            print(f"| {_size(size)} | " + " | ".join(f"**{q:.2f}**" if q > 1.5 else f"{q:.2f}" for q in qs) + " |")
        print()


if __name__ == "__main__":
    main()
