"""The package's shape in numbers: lines per package and module, and the longest functions.

    python scripts/code_shape.py                 # the tree with line counts, 10 longest functions
    python scripts/code_shape.py --functions 5 --only train_step,run_recipe

What issue 69's closing note reports (modules above ~500 lines say why in their docstring:
tests/test_imports.py checks it); a function's length is its lines from `def` to its last
statement, docstring and comments included.
"""

from __future__ import annotations

import argparse
import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "aiayn"


def functions(path: Path) -> list[tuple[int, str]]:
    """(lines, qualified name) of every function and method in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                found.append((child.end_lineno - child.lineno + 1, name))  # type: ignore[operator]
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(tree, "")
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--functions", type=int, default=10, help="how many of the longest to list")
    p.add_argument("--only", default="", help="comma-separated function names to report too")
    args = p.parse_args()
    per_package: dict[str, int] = defaultdict(int)
    modules = []
    every = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        n = path.read_text(encoding="utf-8").count("\n")
        per_package[rel.parts[0] if len(rel.parts) > 1 else "(top)"] += n
        modules.append((n, str(rel)))
        every += [(length, f"{rel}::{name}") for length, name in functions(path)]
    print(f"src/aiayn: {sum(per_package.values())} lines")
    for package, n in sorted(per_package.items(), key=lambda kv: -kv[1]):
        print(f"  {package:<14} {n:>6}")
    print("modules above 400 lines:")
    for n, rel in sorted(modules, reverse=True):
        if n > 400:
            print(f"  {n:>5}  {rel}")
    print(f"the {args.functions} longest functions:")
    for length, name in sorted(every, reverse=True)[: args.functions]:
        print(f"  {length:>5}  {name}")
    wanted = {w for w in args.only.split(",") if w}
    for length, name in every:
        if name.rsplit("::", 1)[1].rsplit(".", 1)[-1] in wanted:
            print(f"  {length:>5}  {name}")


if __name__ == "__main__":
    main()
