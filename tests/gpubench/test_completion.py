"""`gpubench completion bash|zsh`: the script, sourced in a real bash, completes from the real parser."""
import shutil
import subprocess
import sys

import pytest

from gpubench.cli import build_parser
from gpubench.completion import command_tree, script

BASH = shutil.which("bash")


def completion_script(shell):
    proc = subprocess.run([sys.executable, "-m", "gpubench.cli", "completion", shell], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def complete_in_bash(script_text, tmp_path, *words):
    """What bash's completion function offers for the words typed so far (the last one is being
    completed), as `complete -F` would call it."""
    path = tmp_path / "gpubench.bash"
    path.write_text(script_text)
    quoted = " ".join("'" + w.replace("'", "'\\''") + "'" for w in words)
    probe = (f"source {path}\nCOMP_WORDS=({quoted})\nCOMP_CWORD=$(( ${{#COMP_WORDS[@]}} - 1 ))\n"
             "_gpubench\nprintf '%s\\n' \"${COMPREPLY[@]}\"\n")
    proc = subprocess.run([BASH, "--norc", "--noprofile", "-c", probe], capture_output=True, text=True, timeout=30,
                          cwd=tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    return [line for line in proc.stdout.splitlines() if line]


@pytest.mark.skipif(BASH is None, reason="no bash on this machine")
def test_bash_completes_commands_options_and_values(tmp_path):
    text = completion_script("bash")
    assert complete_in_bash(text, tmp_path, "gpubench", "rep") == ["replay"]
    assert "--trace-out" in complete_in_bash(text, tmp_path, "gpubench", "replay", "--tr")
    assert complete_in_bash(text, tmp_path, "gpubench", "replay", "--trace-o") == ["--trace-out"]
    # an option's value: the choices argparse knows; a value word is not taken for a sub-command
    assert complete_in_bash(text, tmp_path, "gpubench", "replay", "--policy", "continuum") == \
        ["continuum", "continuum-offload"]
    assert complete_in_bash(text, tmp_path, "gpubench", "replay", "--out", "run", "--no-st") == ["--no-step-log"]
    # nested sub-commands and a positional's choices
    assert complete_in_bash(text, tmp_path, "gpubench", "kvcomm", "e") == ["eval"]
    assert complete_in_bash(text, tmp_path, "gpubench", "completion", "") == ["bash", "zsh"]
    # a value without choices completes file names
    (tmp_path / "jobs.jsonl").write_text("")
    assert complete_in_bash(text, tmp_path, "gpubench", "replay", "--trace", "jobs") == ["jobs.jsonl"]


def test_script_lists_every_command_and_option_of_the_parser():
    parser = build_parser()
    tree = command_tree(parser)
    top = set(tree[""]["subcommands"])
    assert {"run", "replay", "sweep", "kvcomm", "completion"} <= top
    assert {"kvcomm eval", "trace stats", "vllm setup"} <= set(tree)
    for shell in ("bash", "zsh"):
        text = script(parser, shell)
        for path, node in tree.items():
            for option in node["options"]:
                assert option in text, (shell, path, option)
    assert script(parser, "zsh").startswith("#compdef gpubench\n")


@pytest.mark.parametrize("argv", [["completion"], ["completion", "fish"]])
def test_unknown_or_missing_shell_is_one_line(argv):
    proc = subprocess.run([sys.executable, "-m", "gpubench.cli", *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
