"""``gpubench completion bash|zsh``: a shell completion script generated from the argparse tree.

The script is data (sub-commands, options, option choices, which options take a value) read from
the same parser ``gpubench --help`` prints, wrapped in a small shell function, so it completes what
the installed version accepts and never goes stale. Generating it imports only the registrars,
which ``--help`` already keeps free of torch, pandas and matplotlib.

Install::

    gpubench completion bash > ~/.local/share/bash-completion/completions/gpubench
    gpubench completion zsh > "${fpath[1]}/_gpubench"     # or: source <(gpubench completion zsh)
"""
from __future__ import annotations

import argparse
import re
from typing import Any

SHELLS = ("bash", "zsh")
# A word goes into the script unquoted inside a case branch; anything else is left out rather
# than risk breaking the script (no option or choice of gpubench needs such characters).
_PLAIN_WORD = re.compile(r"^[A-Za-z0-9_.:+/=@%,-]+$")


def register(sub) -> None:
    p = sub.add_parser(
        "completion", help="print a shell completion script (bash or zsh)",
        description="Print a completion script for gpubench's sub-commands, options and option values, "
                    "generated from the installed version's own parser. bash: "
                    "`gpubench completion bash > ~/.local/share/bash-completion/completions/gpubench` "
                    "(or `source <(gpubench completion bash)`); zsh: `source <(gpubench completion zsh)` "
                    "after compinit, or save it as _gpubench in a directory of $fpath.")
    p.add_argument("shell", choices=SHELLS, help="the shell to complete in")
    p.set_defaults(func=cmd_completion)


def cmd_completion(args: argparse.Namespace) -> int:
    from gpubench.cli import build_parser

    print(script(build_parser(), args.shell), end="")
    return 0


def command_tree(parser: argparse.ArgumentParser, path: str = "") -> dict[str, dict]:
    """``{path: {"subcommands", "options", "choices": {option: [...]}, "takes_value", "positional_choices"}}``
    for the parser and every sub-command under it (path "" is the top level, "kvcomm eval" a nested one)."""
    node: dict[str, Any] = {"subcommands": [], "options": [], "choices": {}, "takes_value": [], "positional_choices": []}
    tree = {path: node}
    for action in parser._actions:  # argparse has no public walk of a parser's actions
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                node["subcommands"].append(name)
                tree.update(command_tree(child, f"{path} {name}".strip()))
            continue
        if action.help == argparse.SUPPRESS:
            continue
        if not action.option_strings:  # a positional: only its choices can be completed
            node["positional_choices"].extend(str(c) for c in action.choices or ())
            continue
        node["options"].extend(action.option_strings)
        if action.nargs != 0:  # store_true / count / help / version take no value
            node["takes_value"].extend(action.option_strings)
            if action.choices:
                for option in action.option_strings:
                    node["choices"][option] = [str(c) for c in action.choices]
    return tree


def _words(words) -> str:
    return " ".join(w for w in words if _PLAIN_WORD.match(w))


def _case(function: str, branches: dict[str, str]) -> str:
    lines = [f"{function}() {{", '    case "$1" in']
    for key, value in branches.items():
        if value:
            lines.append(f'        "{key}") echo "{value}" ;;')
    lines += ["    esac", "}", ""]
    return "\n".join(lines)


def _tables(tree: dict[str, dict]) -> str:
    """Shell functions (valid in bash and zsh) that answer from the tree: sub-commands of a path,
    the choices of its positional arguments, options of a path, the choices of "PATH|OPTION", and whether "PATH|OPTION" takes a value."""
    subs = {path: _words(node["subcommands"]) for path, node in tree.items()}
    positionals = {path: _words(node["positional_choices"]) for path, node in tree.items()}
    options = {path: _words(node["options"]) for path, node in tree.items()}
    choices = {f"{path}|{opt}": _words(values) for path, node in tree.items() for opt, values in node["choices"].items()
               if _PLAIN_WORD.match(opt)}
    takes = {f"{path}|{opt}": "1" for path, node in tree.items() for opt in node["takes_value"] if _PLAIN_WORD.match(opt)}
    return "".join((_case("_gpubench_subcommands", subs), _case("_gpubench_positionals", positionals),
                    _case("_gpubench_options", options),
                    _case("_gpubench_choices", choices), _case("_gpubench_takes_value", takes)))


# The command path is the sub-command words typed so far; an option that takes a value skips the
# word after it (so `replay --out run` does not read "run" as a sub-command).
_PATH_WALK = """\
_gpubench_path() {
    # $@: the words before the one being completed, without the program name.
    local cmd_path="" skip="" w
    for w in "$@"; do
        if [ -n "$skip" ]; then skip=""; continue; fi
        case "$w" in
            --*=*) ;;
            -*) [ -n "$(_gpubench_takes_value "$cmd_path|$w")" ] && skip=1 ;;
            *) case " $(_gpubench_subcommands "$cmd_path") " in
                   *" $w "*) cmd_path="${cmd_path:+$cmd_path }$w" ;;
               esac ;;
        esac
    done
    echo "$cmd_path"
}
"""

_BASH_MAIN = """\
_gpubench() {
    local cur="${COMP_WORDS[COMP_CWORD]}" prev="" cmd_path
    [ "$COMP_CWORD" -gt 1 ] && prev="${COMP_WORDS[COMP_CWORD-1]}"
    cmd_path="$(_gpubench_path "${COMP_WORDS[@]:1:COMP_CWORD-1}")"
    COMPREPLY=()
    if [ -n "$prev" ] && [ -n "$(_gpubench_takes_value "$cmd_path|$prev")" ]; then
        local values="$(_gpubench_choices "$cmd_path|$prev")"
        if [ -n "$values" ]; then
            COMPREPLY=($(compgen -W "$values" -- "$cur"))
        else
            COMPREPLY=($(compgen -f -- "$cur"))
        fi
        return 0
    fi
    if [[ "$cur" == -* ]]; then
        COMPREPLY=($(compgen -W "$(_gpubench_options "$cmd_path")" -- "$cur"))
        return 0
    fi
    local subs="$(_gpubench_subcommands "$cmd_path") $(_gpubench_positionals "$cmd_path")"
    if [ -n "${subs// /}" ]; then
        COMPREPLY=($(compgen -W "$subs" -- "$cur"))
    else
        COMPREPLY=($(compgen -f -- "$cur"))
    fi
    return 0
}
complete -o filenames -F _gpubench gpubench
"""

_ZSH_MAIN = """\
_gpubench() {
    local cur="${words[CURRENT]}" prev="" cmd_path values subs
    (( CURRENT > 2 )) && prev="${words[CURRENT-1]}"
    cmd_path="$(_gpubench_path "${(@)words[2,CURRENT-1]}")"
    if [[ -n "$prev" && -n "$(_gpubench_takes_value "$cmd_path|$prev")" ]]; then
        values="$(_gpubench_choices "$cmd_path|$prev")"
        if [[ -n "$values" ]]; then compadd -- ${=values}; else _files; fi
        return
    fi
    if [[ "$cur" == -* ]]; then
        compadd -- ${=$(_gpubench_options "$cmd_path")}
        return
    fi
    subs="$(_gpubench_subcommands "$cmd_path") $(_gpubench_positionals "$cmd_path")"
    if [[ -n "${subs// /}" ]]; then compadd -- ${=subs}; else _files; fi
}
compdef _gpubench gpubench
"""


def script(parser: argparse.ArgumentParser, shell: str) -> str:
    """The completion script of ``parser`` for ``shell`` (bash or zsh)."""
    if shell not in SHELLS:
        raise ValueError(f"shell must be one of {SHELLS}, got {shell!r}")
    header = "#compdef gpubench\n" if shell == "zsh" else ""
    header += f"# {shell} completion for gpubench, generated by `gpubench completion {shell}` from its parser.\n\n"
    return header + _tables(command_tree(parser)) + _PATH_WALK + "\n" + (_BASH_MAIN if shell == "bash" else _ZSH_MAIN)
