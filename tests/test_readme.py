"""README.md stays a front door, and the README and docs/ link only to what exists."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 200
# [text](target) and [text](target "title"); images are links too.
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def markdown_files():
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def without_code(text: str) -> str:
    """The text without its fenced code blocks (a `[x](y)` there is shell or output, not a link)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def relative_links(path: Path):
    for match in LINK.finditer(without_code(path.read_text(encoding="utf-8"))):
        target = match.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http(s), mailto: and in-page anchors
        yield target


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines (at most {MAX_README_LINES})"


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    missing = []
    for target in relative_links(path):
        file_part = target.split("#", 1)[0]
        if not file_part:
            continue
        if not (path.parent / file_part).exists():
            missing.append(target)
    assert missing == [], f"{path.relative_to(ROOT)} links to paths that do not exist: {missing}"


def test_link_pattern_finds_links():
    # the checks above pass vacuously if the pattern finds nothing
    assert len(list(relative_links(README))) >= 10
    assert "docs/results.md" in set(relative_links(README))


def readme_code_blocks():
    return re.findall(r"^```[^\n]*\n(.*?)^```", README.read_text(encoding="utf-8"), flags=re.M | re.S)


def test_readme_test_command_is_what_ci_runs_last():
    """CI's pytest lines (the suite's parallel part, then its exclusive part) are one README code
    block's lines, in order, and the two parts' markers split the suite with nothing left out."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    ci_tests = [line.strip() for line in ci.splitlines() if line.strip().startswith("python -m pytest")]
    assert ci_tests, ".ci/run runs no `python -m pytest` line"
    blocks = [[line.strip() for line in block.splitlines()] for block in readme_code_blocks()]
    assert any(lines[i:i + len(ci_tests)] == ci_tests for lines in blocks for i in range(len(lines))), \
        f"no README code block has CI's test commands {ci_tests!r}, in order"
    selections = [re.search(r' -m (?:"([^"]+)"|(\w+)) tests$', line) for line in ci_tests]
    assert sorted(m.group(1) or m.group(2) for m in selections if m) == ["exclusive", "not exclusive"], ci_tests


def command_file_for(path: Path) -> Path | None:
    """The COMMAND file in path's directory or the nearest one above it, below results/ (results/COMMAND
    is only an index: it regenerates nothing)."""
    results = (ROOT / "results").resolve()
    here = path.resolve()
    if here.is_file():
        here = here.parent
    while here != results and results in here.parents:
        if (here / "COMMAND").is_file():
            return here / "COMMAND"
        here = here.parent
    return None


def test_every_results_link_in_readme_has_a_command():
    targets = [t.split("#", 1)[0] for t in relative_links(README)]
    results_links = [t for t in targets if t.startswith("results/")]
    assert results_links, "README links to no committed result"
    without = [t for t in results_links if command_file_for(ROOT / t) is None]
    assert without == [], f"README links to results without a COMMAND file: {without}"


@pytest.mark.parametrize("index", [README, ROOT / "docs" / "README.md"], ids=["README.md", "docs/README.md"])
def test_docs_index_lists_every_doc(index):
    linked = {(index.parent / t.split("#", 1)[0]).resolve() for t in relative_links(index)}
    docs = {p.resolve() for p in (ROOT / "docs").glob("*.md")} - {index.resolve()}
    unlisted = sorted(str(p.relative_to(ROOT)) for p in docs - linked)
    assert unlisted == [], f"{index.relative_to(ROOT)} does not link {unlisted}"
