"""The package's shape (issue 52): data flows one way. Every `import` in src/aiayn, lazy ones
inside functions included, is read from the source; a cycle between modules, or a package
importing one above it in `LAYERS`, fails here with the file and line."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import ROOT

PACKAGE = ROOT / "src" / "aiayn"

#: Each top-level module or package of aiayn, by layer: one may import only from its own
#: unit or from a lower layer. Translation and parsing share everything but data and scoring.
LAYERS = {
    "__init__": 0,
    "config": 0,
    "cpu_isa": 0,
    "files": 0,
    "processes": 0,
    "model": 1,
    "scoring": 1,
    "speed": 2,  # the one seam (issue 69): the paper's code asks it for speed paths by name
    "data": 3,
    "parsing": 3,
    "checkpoints": 4,
    "decoding": 5,
    "training": 6,
    "fast": 7,  # above the paper's code: it registers into `speed`, nothing below imports it
    "experiments": 8,
    "analysis": 8,
    "deploy": 8,
    "api": 8,
    "cli": 9,
    "__main__": 10,
}
#: The paper's code: it must run with `aiayn.fast` absent (tests/test_speed_seam.py).
PAPER_CODE = ("model", "scoring", "speed", "data", "parsing", "checkpoints", "decoding", "training")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(path: Path, known: dict[str, Path]) -> list[tuple[str, int]]:
    """(aiayn module imported, line) for every import statement in the file."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = []
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for node in ast.walk(tree):
        if here == "aiayn" and _is_public_api_reexport(node):
            continue
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.startswith("aiayn")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package `level - 1` above this one
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            if not base.startswith("aiayn"):
                continue
            for alias in node.names:  # `from pkg import module` imports the module
                sub = f"{base}.{alias.name}"
                found.append((sub if sub in known else base, node.lineno))
    return found


def _is_public_api_reexport(node: ast.AST) -> bool:
    """The one import allowed upwards: the package's module `__getattr__` importing
    `aiayn.api` on first access to `aiayn.Translator` and the other public names
    (docs/api.md). It runs only after the package is imported, so it adds no layer or
    cycle to loading; the import statement inside it is what is skipped."""
    return (
        isinstance(node, ast.ImportFrom)
        and node.module == "aiayn"
        and [a.name for a in node.names] == ["api"]
    )


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_unit_has_a_layer() -> None:
    units = {unit(m) for m in modules()}
    assert units <= set(LAYERS), f"put {sorted(units - set(LAYERS))} into LAYERS"


def test_no_module_imports_a_higher_layer() -> None:
    known = modules()
    wrong = []
    for name, path in known.items():
        for target, line in imports(path, known):
            a, b = unit(name), unit(target)
            if a != b and LAYERS[b] >= LAYERS[a]:
                wrong.append(
                    f"{path.relative_to(ROOT)}:{line}: {name} ({a}, layer "
                    f"{LAYERS[a]}) imports {target} ({b}, layer {LAYERS[b]})"
                )
    assert not wrong, "\n".join(wrong)


def test_fast_sits_above_the_paper_code_and_below_whoever_builds_a_run() -> None:
    """Issue 69: nothing below `fast` imports it (the paper's code reaches the speed paths
    through `aiayn.speed` only), and `fast` sits under the layers that build runs."""
    assert all(LAYERS[u] < LAYERS["fast"] for u in PAPER_CODE)
    assert all(LAYERS["fast"] < LAYERS[u] for u in ("experiments", "analysis", "deploy", "cli"))
    known = modules()
    reaching = [
        f"{path.relative_to(ROOT)}:{line}: {name} imports {target}"
        for name, path in known.items()
        for target, line in imports(path, known)
        if unit(target) == "fast" and unit(name) in PAPER_CODE
    ]
    assert not reaching, "\n".join(reaching)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph, as a path that starts and ends at one node."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycles() -> None:
    known = modules()
    graph = {
        name: {t for t, _ in imports(path, known) if t != name and t in known}
        for name, path in known.items()
    }
    # a package's __init__ may gather its own modules; they import each other, not it
    for name in graph:
        graph[name] -= {p for p in graph[name] if name.startswith(p + ".")}
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_checks_fail_on_a_cycle_and_on_an_upward_import(tmp_path: Path) -> None:
    """Negative controls: the cycle finder finds a planted cycle, and an upward import
    is reported with its file and line."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    fake = tmp_path / "aiayn" / "model.py"
    fake.parent.mkdir()
    fake.write_text("import torch\n\ndef f():\n    from aiayn.training import trainer\n")
    known = {"aiayn.model": fake, "aiayn.training.trainer": fake}
    global PACKAGE
    saved, PACKAGE = PACKAGE, tmp_path / "aiayn"
    try:
        assert imports(fake, known) == [("aiayn.training.trainer", 4)]
    finally:
        PACKAGE = saved
    assert LAYERS[unit("aiayn.training.trainer")] > LAYERS[unit("aiayn.model")]


#: Inside `aiayn.experiments`, by layer (issue 69): the shared pipeline's stages below the
#: tasks (`experiments/tasks/`: translation, parsing), the tasks below the runner that
#: drives them (`recipe`), and the sweeps above that. A task never imports another.
EXPERIMENT_LAYERS = {
    "__init__": 0,
    "recipe_config": 0,
    "manifest": 0,
    "curves": 0,
    "members": 1,
    "stages": 2,
    "bench": 2,
    "tasks": 3,
    "recipe": 4,
    "table3": 5,
}


def sub_unit(module: str) -> str:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else "__init__"


def test_tasks_sit_between_the_shared_stages_and_the_runner() -> None:
    known = {m: p for m, p in modules().items() if unit(m) == "experiments"}
    assert {sub_unit(m) for m in known} <= set(EXPERIMENT_LAYERS), "give it a layer"
    wrong = []
    for name, path in known.items():
        for target, line in imports(path, modules()):
            if unit(target) != "experiments":
                continue
            a, b = sub_unit(name), sub_unit(target)
            if a != b and EXPERIMENT_LAYERS[b] >= EXPERIMENT_LAYERS[a]:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {name} imports {target}")
            task_a, task_b = name.split(".")[3:4], target.split(".")[3:4]
            same_package = a == b == "tasks" and task_a and task_b and task_a != task_b
            if same_package and "base" not in (task_a[0], task_b[0]):
                wrong.append(f"{path.relative_to(ROOT)}:{line}: a task imports {target}")
    assert not wrong, "\n".join(wrong)


#: Issue 69: modules with one concern. One above this many lines says why in its
#: docstring, in a paragraph that begins "Long because".
MAX_MODULE_LINES = 500


def test_a_long_module_says_why_in_its_docstring() -> None:
    unexplained = []
    for path in modules().values():
        text = path.read_text(encoding="utf-8")
        lines = text.count("\n")
        doc = ast.get_docstring(ast.parse(text)) or ""
        if lines > MAX_MODULE_LINES and "Long because" not in doc:
            unexplained.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not unexplained, "split these or say why in the docstring:\n" + "\n".join(unexplained)
