"""The help formatter every sub-command uses, and the hidden aliases that keep old option names working."""
from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Append ``(default: X)`` to an option's help only when it says something: not for a default
    of None or False, and not when the help already names its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False) or "default" in text:
            return text
        return super()._get_help_string(action) or ""


class DeprecatedAlias(argparse.Action):
    """An old spelling of an option, kept so that scripts written against it still run: it sets the
    canonical option's destination, says once on stderr which name to use instead, and is hidden
    from --help and shell completion (so new users only learn the canonical name)."""

    def __init__(self, option_strings, dest, canonical: str, nargs=None, const=None, **kwargs):
        kwargs.pop("help", None)
        # SUPPRESS: the canonical option (added first) supplies the default, whatever the order.
        kwargs.setdefault("default", argparse.SUPPRESS)
        super().__init__(option_strings, dest, nargs=nargs, const=const, help=argparse.SUPPRESS, **kwargs)
        self.canonical = canonical

    def __call__(self, parser, namespace, values, option_string=None):
        import sys

        print(f"{parser.prog}: note: {option_string} is deprecated, use {self.canonical} (same meaning)",
              file=sys.stderr)
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)


def add_deprecated_flag(parser: argparse.ArgumentParser, old: str, canonical: str, dest: str) -> None:
    """``old`` as a hidden alias of the store_true option ``canonical`` (whose destination is ``dest``)."""
    parser.add_argument(old, action=DeprecatedAlias, canonical=canonical, dest=dest, nargs=0, const=True)
