"""The house in figures: each package's share of parsat's source and its longest functions.

    .venv/bin/python benchmarks/house_sizes.py

The limits (no function over 80 lines, no package over a quarter of the
source) are asserted by tests/test_architecture.py, whose measures this
prints, so the figures and the test cannot disagree.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_architecture import MAX_FUNCTION_LINES, MAX_PACKAGE_SHARE, function_lengths, package_lines  # noqa: E402


def main() -> None:
    sizes = package_lines()
    total = sum(sizes.values())
    print(f"{'package':<10} {'lines':>7} {'share':>6}   (limit {MAX_PACKAGE_SHARE:.0%})")
    for package, lines in sorted(sizes.items(), key=lambda item: -item[1]):
        print(f"{package:<10} {lines:>7} {lines / total:>6.1%}")
    print(f"{'all':<10} {total:>7}")
    lengths = function_lengths()
    over = sum(1 for lines, _ in lengths if lines > MAX_FUNCTION_LINES)
    print(f"\n{len(lengths)} functions; {over} over {MAX_FUNCTION_LINES} lines; the ten longest:")
    for lines, where in lengths[:10]:
        print(f"  {lines:>4}  {where}")


if __name__ == "__main__":
    main()
