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
    f.write_text("def f():\n    from predictor.ops import x\n    import scheduling.engine\n")
    assert imported_packages(f) == {"predictor", "scheduling"}


@pytest.mark.parametrize("package", sorted(FLOOR))
def test_every_floor_is_a_package(package):
    assert (REPO / package / "__init__.py").is_file()
