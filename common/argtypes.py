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


def seed32(text: str) -> int:
    """A seed that numpy's legacy RandomState and scikit-learn take: 0 <= seed < 2**32."""
    value = seed(text)
    if value >= 2**32:
        raise argparse.ArgumentTypeError(f"a seed here is an integer in [0, 2**32), got {value}")
    return value


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (a count of threads, points, blocks, tokens)."""
    return _int_at_least(text, 1)


def nonneg_int(text: str) -> int:
    """An integer >= 0."""
    return _int_at_least(text, 0)


def port(text: str) -> int:
    """A TCP port, 0..65535 (0: the system picks a free one)."""
    value = nonneg_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port is an integer in 0..65535, got {value}")
    return value
