"""argparse ``type=`` callables shared by the sub-commands (their errors are one usage line, exit 2)."""
from __future__ import annotations

import argparse


def seed(text: str) -> int:
    """A random seed: an integer >= 0 (numpy refuses negative seeds with a traceback)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a seed is an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a seed is an integer >= 0, got {value}")
    return value
