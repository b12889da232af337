"""Property-based: every sub-command, fed a malformed option value or a malformed file of each
kind it reads, exits 2 with exactly one line on stderr, no traceback, and writes nothing.

The values and files come from tests/gpubench/badinput.py (each listed value is invalid for its
option, so an exit 0 is a silent acceptance); hypothesis draws combinations of command, option
and value, and of file kind, break and reader. In-process (``gpubench.cli.main``), derandomized,
no example database: the same examples every run. scripts/bad_input_audit.py runs all of them.
"""
from __future__ import annotations

import shutil

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from . import badinput as bi

SETTINGS = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
BREAKS = bi.file_breaks()


@pytest.fixture(scope="module")
def space(tmp_path_factory):
    root = tmp_path_factory.mktemp("badinput")
    bi.make_fixtures(root / "in")
    return root


def _check(space, template):
    d, work = space / "in", space / "work"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir()
    argv = bi.fill(template, d, work / "out")
    before = bi.snapshot(space)
    o = bi.invoke(argv, work, timeout_s=60)
    after = bi.snapshot(space)
    v = bi.verdict(o, before, after)
    if v != bi.CLEAN:
        bi.make_fixtures(d)  # a failing case must not taint the next example
    assert v == bi.CLEAN, f"{v}: gpubench {' '.join(argv)}\n{bi.describe(o, before, after)}"


def _option_value_form(opt, value):
    # --opt=value for values argparse would read as an option (-1) or that are empty
    return [f"{opt}={value}"] if value.startswith("-") or not value else [opt, value]


@SETTINGS
@given(case=st.sampled_from(bi.OPTIONS), data=st.data())
def test_a_malformed_option_is_one_line_exit_2(space, case, data):
    base, opt, kind = case
    value = data.draw(st.sampled_from(bi.BAD_VALUES[kind]), label="value")
    _check(space, [*base, *_option_value_form(opt, value)])


@SETTINGS
@given(kind=st.sampled_from(sorted(BREAKS)), data=st.data())
def test_a_malformed_file_is_one_line_exit_2(space, kind, data):
    name = data.draw(st.sampled_from(sorted(BREAKS[kind])), label="break")
    reader = data.draw(st.sampled_from(bi.READERS[kind]), label="reader")
    f = str(bi.fixture_path(space / "in", kind, name))
    _check(space, [a.replace("{f}", f) for a in reader])


@SETTINGS
@given(argv=st.sampled_from(bi.SET_CASES + bi.OTHER_CASES))
def test_a_misspelled_set_key_or_a_bad_path_is_one_line_exit_2(space, argv):
    _check(space, argv)


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(min_size=1, max_size=12).filter(lambda s: s.strip()),
       probe=st.sampled_from(["stream", "l2", "gemm", "launch", "peak", "torch_ops", "strem", "nope"]))
def test_an_unknown_set_key_for_run_is_refused_before_anything_runs(space, text, probe):
    """Arbitrary --set names: a known key is ruled out, so each is refused (a misspelled key used
    to be ignored, and the run measured at full size)."""
    from gpubench.backends.probe_common import SET_OPTIONS

    name = "".join(c for c in text if c.isalnum() or c == "_") or "x"
    if name in SET_OPTIONS.get(probe, ()):
        name += "_typo"
    _check(space, ["run", "--device", "cpu", "--probes", "launch", "--out", "{o}", "--set", f"{probe}.{name}=1"])


def test_the_harness_catches_what_it_should(space):
    """The checks themselves can fail: a valid command is a silent acceptance, a raised exception a traceback."""
    o = bi.invoke(["predict", "--sku", "h100"], space, timeout_s=60)
    assert bi.verdict(o, {}, {}) == bi.ACCEPTED
    o = bi.invoke(["show", "{d}"], space)  # a literal unfilled path: one clean line
    assert bi.verdict(o, {}, {}) == bi.CLEAN
    assert bi.verdict(bi.Outcome(1, "", "Traceback (most recent call last):\n"), {}, {}) == bi.TRACEBACK
    assert bi.verdict(bi.Outcome(2, "", "gpubench: error: x\n"), {}, {"f": (1, 1)}) == bi.WROTE
    assert bi.verdict(bi.Outcome(2, "", "gpubench: error: x\nmore\n"), {}, {}) == bi.WRONG_EXIT
