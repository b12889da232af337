"""The floors of the house: no package imports one above it.

common (shared helpers, model configs) < vllmref (the reference engine) < gpubench (probes, runs)
< predictor (step model) < scheduling, kvcomm (which do not import each other). The one exception is
the console script, ``gpubench/cli.py``, which only assembles every package's ``cli.py``. Imports
inside functions and under ``TYPE_CHECKING`` count: an arrow is an arrow.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FLOOR = {"common": 0, "vllmref": 1, "gpubench": 2, "predictor": 3, "scheduling": 4, "kvcomm": 4}
ASSEMBLY = {"gpubench/cli.py"}


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out & set(FLOOR)


def arrows() -> list[tuple[str, str]]:
    found = []
    for package in FLOOR:
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel in ASSEMBLY:
                continue
            for target in imported_packages(path):
                found.append((rel, target))
    return found


def test_no_package_imports_a_higher_floor_or_a_sibling():
    bad = [f"{src} imports {dst}" for src, dst in arrows()
           if (lower := src.split("/")[0]) != dst and FLOOR[dst] >= FLOOR[lower]]
    assert not bad, "\n".join(bad)


def test_the_check_sees_real_arrows(tmp_path):
    """The scan itself: a function-level import of a higher floor is found."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from predictor.ops import x\n    import scheduling.engine.loop\n")
    assert imported_packages(f) == {"predictor", "scheduling"}


@pytest.mark.parametrize("package", sorted(FLOOR))
def test_every_floor_is_a_package(package):
    assert (REPO / package / "__init__.py").is_file()


def _module_graph(runtime_only: bool) -> dict[str, set[str]]:
    """module -> the modules it imports (of the six packages); ``from pkg import submodule`` is an
    edge to the submodule only. With ``runtime_only``, imports under ``if TYPE_CHECKING:`` are left out."""
    mods = {}
    for package in FLOOR:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        skip = set()
        if runtime_only:
            for node in ast.walk(tree):
                if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                    skip |= {id(n) for n in ast.walk(node)}
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
                subs = [f"{base}.{a.name}" for a in node.names]
                targets = [s for s in subs if s in mods] + ([base] if any(s not in mods for s in subs) else [])
            for target in targets:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = set()
                    while True:
                        u = stack.pop()
                        on_stack.discard(u)
                        component.add(u)
                        if u == v:
                            break
                    if len(component) > 1:
                        out.append(component)
            elif w not in index:
                index[w] = low[w] = len(index)
                stack.append(w)
                on_stack.add(w)
                work.append((w, iter(sorted(graph[w]))))
            elif w in on_stack:
                low[v] = min(low[v], index[w])
    return out


def test_no_import_circle_at_run_time():
    assert not _cycles(_module_graph(runtime_only=True))


def test_every_annotation_only_circle_is_explained_in_architecture_md():
    """A circle through TYPE_CHECKING imports is allowed where docs/architecture.md names its modules."""
    doc = (REPO / "docs/architecture.md").read_text()
    section = doc[doc.index("## Import circles"):doc.index("## Contracts inside the stages")]
    unexplained = []
    for component in _cycles(_module_graph(runtime_only=False)):
        # each module named: in full, by its last part (inside a `{a,b}` list), or as `package.*`
        def named(m: str) -> bool:
            return m in section or f",{m.rsplit('.', 1)[-1]}" in section or f"{{{m.rsplit('.', 1)[-1]}," in section \
                or f"{m.rsplit('.', 1)[0]}.*" in section or f"{m}.*" in section

        if not all(named(m) for m in component):
            unexplained.append(sorted(component))
    assert not unexplained, unexplained


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


SCHEDULING_FLOOR = {"workload": 0, "engine": 1, "policies": 1, "experiments": 2, "viewer": 3}


def test_scheduling_districts_import_downward_only():
    """Inside scheduling: workload (what is replayed) < engine, policies < experiments < viewer; the
    sub-commands at the top. The engine and its policies share a floor: the engine calls the
    policies' hooks, a policy reads the engine's request and size types."""
    bad = []
    for path in sorted((REPO / "scheduling").rglob("*.py")):
        parts = path.relative_to(REPO / "scheduling").parts
        src = SCHEDULING_FLOOR.get(parts[0], 99) if len(parts) > 1 else 99
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("scheduling."):
                district = node.module.split(".")[1]
                if district in SCHEDULING_FLOOR and SCHEDULING_FLOOR[district] > src:
                    bad.append(f"scheduling/{'/'.join(parts)} imports scheduling.{district}")
    assert not bad, "\n".join(bad)
