"""pyproject.toml lists what the package uses, and its extras mean what they say."""
import ast
import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the project's own fallback (gpubench.skus reads TOML the same way)
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gpubench", "predictor", "scheduling", "kvcomm", "vllmref")
# Distribution name -> the module the code imports.
IMPORT_NAME = {"scikit-learn": "sklearn", "nvidia-ml-py": "pynvml", "pyyaml": "yaml", "cupy-cuda12x": "cupy"}
# Used through another library rather than imported; each entry names a string the code must
# still contain for the use to be real (so the test fails when that use goes away).
USED_THROUGH = {
    "pyarrow": ("parquet", "pandas' parquet engine for step rows and SWE-smith files"),
    "gguf": ("gguf_file=", "transformers reads the SmolLM2 GGUF file with it"),
    "accelerate": ("gguf_file=", "transformers needs it to load the GGUF model"),
    "aiconfigurator-core": ('PACKAGE = "aiconfigurator_core"', "gpubench silicon reads the parquet tables it ships, "
                            "located with importlib (the package itself is never imported)"),
}
DEV_TOOLS = {"pytest", "pytest-benchmark", "selenium"}


def project():
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def dist_name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9._-]+", requirement.strip()).group(0).lower()


def sources():
    for package in PACKAGES:
        yield from (ROOT / package).rglob("*.py")


def imported_top_modules() -> set[str]:
    found = set()
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    return found


def runtime_requirements():
    p = project()
    extras = p["optional-dependencies"]
    yield from (("dependencies", r) for r in p["dependencies"])
    for extra, reqs in extras.items():
        if extra == "dev":
            continue
        yield from ((extra, r) for r in reqs if not r.startswith("gpubench["))


def test_every_runtime_dependency_is_used_by_the_package():
    imported = imported_top_modules()
    text = "\n".join(path.read_text(encoding="utf-8") for path in sources())
    unused = []
    for where, requirement in runtime_requirements():
        name = dist_name(requirement)
        if name in USED_THROUGH:
            marker, _why = USED_THROUGH[name]
            if marker not in text:
                unused.append(f"{where}: {name} (nothing uses {marker!r} any more)")
            continue
        if IMPORT_NAME.get(name, name.replace("-", "_")) not in imported:
            unused.append(f"{where}: {name}")
    assert unused == []


def test_all_is_the_runtime_extras_without_the_test_tools():
    extras = project()["optional-dependencies"]
    (self_ref,) = extras["all"]
    included = set(re.fullmatch(r"gpubench\[(.*)\]", self_ref).group(1).split(","))
    assert "dev" not in included and included <= set(extras) - {"all"}
    pulled = {dist_name(r) for extra in included for r in extras[extra]}
    assert not pulled & DEV_TOOLS
    assert DEV_TOOLS <= {dist_name(r) for r in extras["dev"]}


@pytest.mark.parametrize("path", [".ci/run", "README.md"])
def test_install_commands_still_bring_the_test_tools(path):
    """A fresh clone that follows CI or README installs dev as well as all, so pytest is there."""
    text = (ROOT / path).read_text(encoding="utf-8")
    installs = re.findall(r"pip install[^\n&]*-e '\.\[([^\]]*)\]'", text)
    assert installs and all({"all", "dev"} <= set(extras.split(",")) for extras in installs)


def test_metadata_has_classifiers_and_no_license_classifier():
    p = project()
    # PEP 639: the SPDX `license` expression replaces license classifiers (setuptools refuses both).
    assert p["license"] == "Apache-2.0"
    assert p["classifiers"] and not [c for c in p["classifiers"] if c.startswith("License ::")]
    assert any(c.startswith("Programming Language :: Python :: 3.1") for c in p["classifiers"])
