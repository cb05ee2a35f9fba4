"""The biggest classes under a source tree, in lines (from ``class`` to the end of its body).

Run: ``python tools/class_sizes.py [src] [how many]``; a class over ``--limit`` lines (default 600)
makes it exit non-zero.
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import sys


def class_sizes(root: pathlib.Path) -> list[tuple[int, str, str]]:
    """``(lines, class name, file:line)`` of every class below ``root``, biggest first."""
    rows = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                rows.append((node.end_lineno - node.lineno + 1, node.name, f"{path}:{node.lineno}"))
    return sorted(rows, reverse=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", nargs="?", default="src")
    parser.add_argument("count", nargs="?", type=int, default=12)
    parser.add_argument("--limit", type=int, default=600)
    args = parser.parse_args()
    rows = class_sizes(pathlib.Path(args.root))
    for lines, name, where in rows[: args.count]:
        print(f"{lines:6d}  {name:28s} {where}")
    return 1 if rows and rows[0][0] > args.limit else 0


if __name__ == "__main__":
    sys.exit(main())
