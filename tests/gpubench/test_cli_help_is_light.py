"""`gpubench --help`, every sub-command's --help and `gpubench completion` load no torch, pandas or
matplotlib (seconds of import under load, for a page of text), and kvcomm's names agree with what
it implements."""
import json
import subprocess
import sys

HEAVY = ("torch", "pandas", "matplotlib", "transformers")

PROBE = """
import contextlib, io, json, sys
from gpubench.cli import build_parser, main
parser = build_parser()
commands = [a for a in parser._subparsers._group_actions[0].choices]
loaded = {}
nested = [["kvcomm", "eval", "--help"], ["trace", "stats", "--help"], ["trace", "swesmith", "--help"],
          ["vllm", "setup", "--help"]]
completion = [["completion", "bash"], ["completion", "zsh"]]
for argv in [["--help"]] + [[c, "--help"] for c in commands] + nested + completion:
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            main(argv)
    except SystemExit:
        pass
loaded = [m for m in %r if m in sys.modules]
print(json.dumps({"commands": commands, "heavy": loaded}))
""" % (HEAVY,)


def test_help_of_every_command_imports_nothing_heavy():
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"run", "replay", "sweep", "kvcomm", "trace", "vllm", "predict", "evaluate", "completion"} <= set(doc["commands"])
    assert doc["heavy"] == []


def test_kvcomm_names_are_what_it_implements():
    from kvcomm import names, protocols, tasks

    assert protocols.PROTOCOLS is names.PROTOCOLS
    assert tuple(tasks.TASKS) == names.TASK_NAMES


def test_nothing_shipped_cites_a_document_the_repository_does_not_ship():
    """Code, help text, data files and docs say the sentence instead of pointing at a design
    document or a shared folder outside the repository."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    pattern = re.compile(r"DESIGN(\.md| §| section)|STYLE\.md|shared/(DESIGN|STYLE|reference)|/work/")
    offenders = []
    for top in ("gpubench", "predictor", "scheduling", "kvcomm", "vllmref", "scripts", "docs", "csrc"):
        for path in (root / top).rglob("*"):
            if path.suffix in (".py", ".toml", ".md", ".sh", ".js", ".html", ".cu", ".cuh", ".cpp", ".txt") and path.is_file():
                for i, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                    if pattern.search(line):
                        offenders.append(f"{path.relative_to(root)}:{i}")
    assert offenders == []


def test_run_help_lists_the_registered_probes_of_both_backends():
    """The probe list in `gpubench run --help` comes from the registries, so adding a probe (as
    torch_ops and vllm_ops were) cannot leave the help naming an old set."""
    import contextlib
    import io

    import pytest

    from gpubench.backends.cpu.probes import cpu_probes
    from gpubench.backends.cuda import CudaBackend
    from gpubench.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(out.getvalue().split())  # argparse wraps lines
    assert f"on the CPU {','.join(cpu_probes())};" in text
    assert "torch_ops" in text and "vllm_ops" in text
    cuda = ",".join(CudaBackend.probes(object.__new__(CudaBackend)))
    assert f"on a GPU {cuda}" in text
    # --quick leaves vllm_ops out (41.6 s on a quiet 2-core VM, docs/cli.md); the help says so
    assert "under a minute" in text and "vllm_ops (vLLM's own kernels, ~90 s on a 2-core CPU) left out" in text
