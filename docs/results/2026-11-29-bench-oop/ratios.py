"""Out-of-place over in-place per size and backend, from gpucomm-bench JSON reports: the largest,
the sizes over 1.5, and the sizes where in-place was the slower by more than 1.5x (noise).

python docs/results/2026-11-29-bench-oop/ratios.py docs/results/2026-11-29-bench-oop/*.json
"""

import json
import sys


def _size(nbytes: int) -> str:
    for unit, shift in (("M", 20), ("K", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes >> shift}{unit}"
    return str(nbytes)


def main() -> None:
    for path in sys.argv[1:]:
        with open(path) as fh:
            report = json.load(fh)
        print(path)
        for table in report["tables"]:
            ratios = [(r["size"], r["out_of_place"]["time_us"] / r["in_place"]["time_us"]) for r in table["rows"]]
            over = [f"{_size(s)}: {q:.2f}" for s, q in ratios if q > 1.5]
            under = [f"{_size(s)}: {1 / q:.2f}" for s, q in ratios if q < 1 / 1.5]
            worst = max(ratios, key=lambda sq: sq[1])
            print(
                f"  {table['backend']:8s} max {worst[1]:.2f} at {_size(worst[0])}; "
                f"over 1.5: {', '.join(over) if over else 'none'}; "
                f"in-place over 1.5 x out-of-place: {', '.join(under) if under else 'none'}"
            )


if __name__ == "__main__":
    main()
