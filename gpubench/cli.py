"""The one console script. Each package registers its own sub-commands; this module only assembles.

A registrar is ``register(subparsers)``: it adds parsers and sets ``func=callable(args) -> int``.
"""
import argparse
import math
import os
import sys

from common.errors import GpubenchError
from gpubench import __version__

# Packages whose cli.py registers sub-commands, in the order --help lists them.
_REGISTRARS = ("gpubench.bench_cli", "predictor.cli", "predictor.eval_cli", "predictor.silicon_cli",
               "scheduling.cli", "scheduling.compare_cli", "scheduling.trace_cli", "scheduling.view_cli", "scheduling.slo.cli",
               "kvcomm.cli", "vllmref.cli", "gpubench.completion")


MAX_INT = 2**63 - 1  # an integer option beyond int64 is a typo (numpy and the engine cannot hold it)


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the usage text is a --help away), exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def _get_value(self, action, arg_string):
        # Checks every option shares: an empty value (an unset shell variable) is a mistake, not
        # "use the default"; a number option takes a finite float (NaN and inf slip past every
        # comparison a command makes) or an integer that fits in 64 bits.
        name = "/".join(action.option_strings) or action.dest
        if action.option_strings and not arg_string.strip():
            self.error(f"argument {name}: expected a value, got an empty string")
        value = super()._get_value(action, arg_string)
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, float) and not math.isfinite(v):
                self.error(f"argument {name}: must be a finite number, got {arg_string!r}")
            if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_INT:
                self.error(f"argument {name}: {arg_string!r} is out of range (at most {MAX_INT:.3g})")
        return value


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = OneLineErrorParser(
        prog="gpubench",
        description="Characterize a GPU or CPU for LLM inference, predict step times, replay agent workloads.",
    )
    parser.add_argument("--version", action="version", version=f"gpubench {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for modname in _REGISTRARS:
        try:
            mod = importlib.import_module(modname)
        except ModuleNotFoundError as exc:
            if exc.name != modname:
                raise
            continue
        mod.register(sub)
    return parser


# Options naming a file or directory a command writes into (or, for --resume, appends to). `run --out`
# is a root under which every run makes a new directory: nothing in it is rewritten, but a root that
# holds committed files (the checkout's results/, results/cpu, ...) would put the user's run among the
# committed ones, so it is refused too, with its own hint (RUN_OUT_HINT).
RUN_OUT_HINT = ("a run there lands among the committed results: leave --out out (./gpubench-results) or choose "
                "another root; to add one there on purpose (a committed COMMAND line), put GPUBENCH_REGENERATE=1 "
                "in front")
WRITTEN_OPTIONS = {"out": "--out", "output": "--out", "trace_out": "--trace-out", "csv": "--csv", "plot": "--plot",
                   "resume": "--resume", "export": "--export"}


# What an interrupted command left, and how to go on: a run resumes into its directory, profile
# resumes its rows file when the same command runs again (its finished rows are in a sidecar).
INTERRUPTED_HINT = {"run": "; what was measured is on disk (resume with --resume RUN_DIR)",
                    "profile": "; the rows measured so far are on disk (run the same command again to resume)"}


def check_outputs(args: argparse.Namespace) -> None:
    """Before any work: refuse to rewrite committed files (outdir.refuse_committed) through any
    option that names what the command writes."""
    from common.outdir import refuse_committed

    command = getattr(args, "command", None)
    for dest, option in WRITTEN_OPTIONS.items():
        value = getattr(args, dest, None)
        if value is None or not isinstance(value, (str, os.PathLike)):
            continue
        refuse_committed(value, option, RUN_OUT_HINT if (command == "run" and dest == "out") else None)
    if command == "show" and getattr(args, "plots", False) and getattr(args, "out", None) is None:
        refuse_committed(args.run_dir, "show --plots (next to the run)")


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        check_outputs(args)
        return int(args.func(args) or 0)
    except GpubenchError as err:
        print(f"gpubench: error: {err}", file=sys.stderr)
        return 2
    except UnicodeDecodeError as err:
        # An input file that is not UTF-8 text (a binary, a truncated download): the user's file,
        # not a fault of gpubench. The reader that hit it may not know the path; the position helps.
        print(f"gpubench: error: an input file is not UTF-8 text ({err.reason} at byte {err.start})", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader of stdout went away (`gpubench ... | head`): not an error of the user's input.
        # Point stdout at /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports a command ended by a closed pipe
    except OSError as err:
        # A path the user named that cannot be read or written (missing, a directory where a file
        # is expected, no permission, a full disk): one line that names it.
        where = f" {err.filename}" if err.filename else ""
        print(f"gpubench: error: cannot use{where}: {err.strerror or err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"gpubench: interrupted{INTERRUPTED_HINT.get(str(getattr(args, 'command', '')), '')}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
