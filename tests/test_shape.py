"""Sizes the house keeps: no module over 400 lines, no function over 80 (split where
responsibilities part; the limits only say when to look)."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "vllmref", "gpubench", "predictor", "scheduling", "kvcomm")
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 80


def _sources():
    for package in PACKAGES:
        yield from sorted((REPO / package).rglob("*.py"))


def test_no_module_over_400_lines():
    long = [f"{p.relative_to(REPO)}: {n}" for p in _sources() if (n := p.read_text().count("\n")) > MAX_MODULE_LINES]
    assert not long, long


def test_no_function_over_80_lines():
    long = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {n}")
    assert not long, long
