"""Malformed inputs for every sub-command, and the check that each is refused cleanly.

Shared by tests/gpubench/test_bad_input_props.py (hypothesis draws from these) and
scripts/bad_input_audit.py (runs all of them and counts the outcomes).

A case is an argv list with ``{d}`` (the directory of fixture files) and ``{o}`` (the output the case
names) placeholders. ``invoke`` runs ``gpubench.cli.main`` in this process with stdout/stderr
captured; ``verdict`` says whether the outcome is clean: exit 2, exactly one non-blank line on
stderr starting ``gpubench`` and saying ``error``, no ``Traceback``, and no file created, changed
or removed anywhere in the case's working directory (the fixtures and the named output included:
a refused command writes nothing).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CLEAN, TRACEBACK, ACCEPTED, WRONG_EXIT, HUNG, WROTE = (
    "handled cleanly", "traceback", "silently accepted", "wrong exit code or not one line", "hung", "wrote files")

# --------------------------------------------------------------------------------------------
# Malformed option values. Each option names the kind of value it takes; every value listed for
# a kind is invalid for it (so an exit 0 is a silent acceptance, never a legitimate run).
BAD_VALUES = {
    # integers >= 1
    "posint": ["0", "-1", "-5", "x", "", "1.5", "nan", "inf", "1e3", "0x10", "99999999999999999999999"],
    # integers >= 0
    "nonnegint": ["-1", "-7", "x", "", "2.5", "nan", "inf", "99999999999999999999999"],
    # finite floats > 0
    "posfloat": ["0", "-1", "-0.5", "x", "", "nan", "NaN", "inf", "-inf", "1e400"],
    # finite floats >= 0
    "nonnegfloat": ["-1", "-0.001", "x", "", "nan", "inf", "-inf", "1e400"],
    # fractions in (0, 1]
    "fraction": ["0", "-0.1", "1.5", "2", "x", "", "nan", "inf"],
    # fractions in [0, 1]
    "unit": ["-0.1", "1.5", "2", "x", "", "nan", "inf", "-inf"],
    # a names list or a name: empty and misspelled
    "name": ["", "nope", "h10O", "llama-9000", " ", "\x00", "ü"],
    # a random seed (an integer >= 0)
    "seed": ["-1", "-7", "x", "", "2.5", "nan", "inf", "99999999999999999999999"],
    # a port
    "port": ["-1", "65536", "x", "", "nan", "99999999999"],
}

_SYN = ["replay", "--jobs", "2", "--jps", "1", "--no-progress", "--no-step-log", "--out", "{o}"]
_SWEEP = ["sweep", "--jobs", "2", "--skus", "h100-sxm", "--jps", "1", "--policies", "fcfs", "--workers", "1",
          "--no-plots", "--no-progress", "--out", "{o}"]

# (sub-command argv that runs quickly when valid, option, kind)
OPTIONS = [
    (["predict", "--sku", "h100"], "--batch", "posint"),
    (["predict", "--sku", "h100"], "--context", "nonnegint"),
    (["predict", "--sku", "h100", "--phase", "prefill"], "--new-tokens", "posint"),
    (["predict"], "--sku", "name"),
    (["predict", "--sku", "h100"], "--model", "name"),
    (["predict", "--sku", "h100"], "--dtype", "name"),
    (_SYN, "--jps", "posfloat"),
    (["replay", "--jps", "1", "--no-progress", "--out", "{o}"], "--jobs", "posint"),
    (_SYN, "--seed", "seed"),
    (_SYN, "--max-num-batched-tokens", "posint"),
    (_SYN, "--max-num-seqs", "posint"),
    (_SYN, "--block-size", "posint"),
    (_SYN, "--num-gpu-blocks", "posint"),
    (_SYN, "--gpu-memory-utilization", "fraction"),
    (_SYN, "--activation-reserve-gib", "nonnegfloat"),
    (_SYN + ["--policy", "continuum"], "--ttl-s", "nonnegfloat"),
    (_SYN + ["--policy", "continuum", "--ttl-rule", "tool-mean"], "--tool-mean-threshold-s", "nonnegfloat"),
    (_SYN + ["--policy", "continuum", "--ttl-rule", "expected-benefit"], "--eta", "nonnegfloat"),
    (_SYN + ["--policy", "continuum", "--ttl-rule", "expected-benefit"], "--prior-mean-s", "nonnegfloat"),
    (_SYN + ["--policy", "cpu-offload"], "--cpu-gib", "posfloat"),
    (_SYN + ["--policy", "cpu-offload"], "--offload-link-gbs", "posfloat"),
    (_SYN + ["--policy", "cpu-offload"], "--offload-transfer-latency-ms", "nonnegfloat"),
    (_SYN + ["--policy", "lmcache"], "--lmcache-chunk-tokens", "posint"),
    (_SYN + ["--policy", "lmcache"], "--lmcache-cpu-gib", "posfloat"),
    (_SYN + ["--policy", "lmcache"], "--lmcache-store-chunk-ms", "nonnegfloat"),
    (_SYN + ["--policy", "lmcache"], "--lmcache-retrieve-chunk-ms", "nonnegfloat"),
    (_SYN, "--sku", "name"),
    (_SYN, "--model", "name"),
    (_SWEEP, "--jobs", "posint"),
    (_SWEEP, "--workers", "posint"),
    (_SWEEP, "--jps", "posfloat"),
    (_SWEEP, "--seeds", "seed"),
    (_SWEEP, "--skus", "name"),
    (_SWEEP, "--policies", "name"),
    (_SWEEP, "--model", "name"),
    (["trace", "stats"], "--jobs", "posint"),
    (["trace", "stats", "--jobs", "5"], "--seed", "seed"),
    (["trace", "swesmith", "--out", "{o}.jsonl"], "--jobs", "posint"),
    (["trace", "swesmith", "--jobs", "2", "--out", "{o}.jsonl"], "--seed", "seed"),
    (["run", "--device", "cpu", "--probes", "launch", "--out", "{o}"], "--repeats", "posint"),
    (["run", "--device", "cpu", "--probes", "launch", "--out", "{o}"], "--probe-budget-s", "posfloat"),
    (["run", "--device", "cpu", "--out", "{o}"], "--probes", "name"),
    (["run", "--out", "{o}"], "--device", "name"),
    (["run", "--device", "cpu", "--out", "{o}"], "--sku", "name"),
    (["compare", "{d}/run_ok", "{d}/run_ok"], "--fail-slower", "nonnegfloat"),
    (["fit", "{d}/run_ok", "-o", "{o}.json"], "--dtype", "name"),
    (["evaluate", "{d}/rows_ok.parquet", "--out", "{o}"], "--sku", "name"),
    (["evaluate", "{d}/rows_ok.parquet", "--out", "{o}"], "--seed", "seed"),
    (["profile", "--out", "{o}.parquet"], "--model", "name"),
    (["profile", "--model", "tiny-llama", "--out", "{o}.parquet"], "--threads", "posint"),
    (["profile", "--model", "tiny-llama", "--out", "{o}.parquet"], "--max-points", "posint"),
    (["profile", "--model", "tiny-llama", "--out", "{o}.parquet"], "--ops-subset", "nonnegint"),
    (["profile", "--model", "tiny-llama", "--out", "{o}.parquet"], "--block-size", "posint"),
    (["profile", "--model", "tiny-llama", "--out", "{o}.parquet"], "--max-num-seqs", "posint"),
    (["profile", "--model", "tiny-llama", "--out", "{o}.parquet"], "--max-num-batched-tokens", "posint"),
    (["view", "{d}/replay_ok", "--export", "{o}.html"], "--max-jobs", "posint"),
    (["view", "{d}/replay_ok", "--no-open"], "--port", "port"),
    (["kvcomm", "eval", "--out", "{o}"], "--n", "posint"),
    (["kvcomm", "eval", "--out", "{o}"], "--threads", "posint"),
    (["kvcomm", "eval", "--out", "{o}"], "--max-tokens", "posint"),
    (["kvcomm", "eval", "--out", "{o}"], "--ratio", "unit"),
    (["kvcomm", "eval", "--out", "{o}"], "--tasks", "name"),
    (["kvcomm", "eval", "--out", "{o}"], "--protocols", "name"),
    (["kvcomm", "eval", "--out", "{o}"], "--model", "name"),
    (["vllm", "generate", "hello"], "--max-tokens", "posint"),
    (["vllm", "generate", "hello"], "--threads", "posint"),
    (["vllm", "serve"], "--port", "port"),
    (["vllm", "serve"], "--threads", "posint"),
]

# Misspelled --set keys and malformed --set values.
SET_CASES = [
    _SWEEP + ["--set", "max_num_seqz=3"], _SWEEP + ["--set", "fcfs.max_num_seqs=x"], _SWEEP + ["--set", "=3"],
    _SWEEP + ["--set", "nokey"], _SWEEP + ["--set", "block_size=0"], _SWEEP + ["--set", "gpu_memory_utilization=nan"],
    _SWEEP + ["--set", "continuum.ttl_s=-1"], _SWEEP + ["--set", "nopolicy.ttl_s=1"],
    _SWEEP + ["--set", "max_num_seqs=1.5"], _SWEEP + ["--set", "jps=1"],
    ["run", "--device", "cpu", "--probes", "launch", "--out", "{o}", "--set", "stream.max_aray_bytes=1"],
    ["run", "--device", "cpu", "--probes", "launch", "--out", "{o}", "--set", "straem.max_array_bytes=1"],
    ["run", "--device", "cpu", "--probes", "launch", "--out", "{o}", "--set", "stream.max_array_bytes=x"],
    ["run", "--device", "cpu", "--probes", "launch", "--out", "{o}", "--set", "stream.max_array_bytes=-1"],
    ["run", "--device", "cpu", "--probes", "launch", "--out", "{o}", "--set", "stream.max_array_bytes=nan"],
    ["run", "--device", "cpu", "--probes", "launch", "--out", "{o}", "--set", "launch.max_count=0"],
    ["run", "--device", "cpu", "--probes", "launch", "--out", "{o}", "--set", "stream"],
    ["run", "--device", "cpu", "--probes", "launch", "--out", "{o}", "--set", "=1"],
    ["run", "--device", "cpu", "--probes", "launch", "--out", "{o}", "--set", "gemm.num_reps=inf"],
    ["run", "--device", "cpu", "--probes", "launch", "--out", "{o}", "--set", ".x=1"],
]

# Other malformed invocations: contradictions, missing required inputs, wrong paths.
OTHER_CASES = [
    ["predict", "--sku", "h100", "--batch-json", "[[1, 2]"], ["predict", "--sku", "h100", "--batch-json", "{}"],
    ["predict", "--sku", "h100", "--batch-json", "[]"], ["predict", "--sku", "h100", "--batch-json", "[[-1, 2]]"],
    ["predict", "--sku", "h100", "--batch-json", "[[0, 0]]"], ["predict", "--sku", "h100", "--batch-json", '[["a", 2]]'],
    ["predict", "--sku", "h100", "--batch-json", "[[1, 2, 3]]"], ["predict", "--sku", "h100", "--batch-json", "[[NaN, 2]]"],
    ["predict", "--sku", "h100", "--batch-json", "[[1.5, 2]]"], ["predict", "--sku", "h100", "--batch-json", "[1, 2]"],
    ["replay", "--out", "{o}"], ["replay", "--jobs", "2", "--out", "{o}"],
    ["replay", "--jobs", "0", "--trace", "{d}/trace_ok.jsonl", "--out", "{o}"],
    ["replay", "--jobs", "2", "--jps", "1", "--set", "nope=1", "--out", "{o}"],
    ["replay", "--jobs", "2", "--jps", "1", "--set", "lmcache.chunk_tokens=64", "--out", "{o}"],
    ["replay", "--jobs", "2", "--jps", "1", "--policy", "continuum", "--set", "continuum.ttl_s=-1", "--out", "{o}"],
    ["replay", "--jobs", "2", "--jps", "1", "--set", "max_num_seqs=0", "--out", "{o}"],
    ["replay", "--jobs", "2", "--jps", "1", "--out", "{d}/afile"],
    ["replay", "--trace", "{d}/nothere.jsonl", "--out", "{o}"], ["replay", "--trace", "{d}", "--out", "{o}"],
    ["replay", "--jobs", "2", "--jps", "1", "--policy", "fcfs", "--cpu-gib", "8", "--out", "{o}"],
    ["replay", "--jobs", "2", "--jps", "1", "--policy", "fcfs", "--ttl-s", "3", "--out", "{o}"],
    ["replay", "--jobs", "2", "--jps", "1", "--step-cost", "nope", "--out", "{o}"],
    ["replay", "--jobs", "2", "--jps", "1", "--step-cost", "measured:{d}/nothere", "--out", "{o}"],
    ["replay", "--jobs", "2", "--jps", "1", "--trace-out", "{d}/afile/x.json", "--out", "{o}"],
    ["show", "{d}/nothere"], ["show", "{d}/afile"], ["show", "{d}"], ["compare", "{d}/run_ok", "{d}/nothere"],
    ["compare", "{d}/nothere", "{d}/run_ok"], ["fit", "{d}/nothere"], ["fit", "{d}/afile"],
    ["fit", "{d}/run_ok", "-o", "{d}/afile/x.json"],
    ["evaluate", "{d}/nothere.parquet", "--out", "{o}"], ["evaluate", "{d}", "--out", "{o}"],
    ["evaluate", "{d}/rows_ok.parquet", "--out", "{d}/afile"],
    ["run", "--device", "cpu", "--resume", "{d}/nothere"], ["run", "--device", "cpu", "--resume", "{d}/afile"],
    ["run", "--device", "cpu", "--out", "{d}/afile"],
    ["trace", "stats", "{d}/nothere.jsonl"], ["trace", "stats", "{d}"],
    ["trace", "stats", "--jobs", "5", "--plot", "{d}/afile/x.png"],
    ["trace", "swesmith", "--jobs", "2", "--out", "{o}.txt"], ["trace", "swesmith", "--jobs", "2", "--out", "{o}"],
    ["trace", "swesmith", "--jobs", "2", "--out", "{d}/afile/x.jsonl"],
    ["view", "{d}/nothere", "--export", "{o}.html"], ["view", "{d}/run_ok", "--export", "{o}.html"],
    ["view", "{d}/replay_ok", "--export", "{d}/afile/x.html"],
    ["compare-replay", "{d}/replay_ok", "{d}/nothere"], ["compare-replay", "{d}/run_ok", "{d}/replay_ok"],
    ["profile", "--model", "tiny-llama", "--out", "{o}.csv"], ["profile", "--model", "tiny-llama"],
    ["profile", "--model", "tiny-llama", "--device", "tpu", "--out", "{o}.parquet"],
    ["profile", "--model", "tiny-llama", "--out", "{d}/afile/x.parquet"],
    ["kvcomm", "eval", "--tasks", ",", "--out", "{o}"], ["kvcomm", "eval", "--protocols", ",", "--out", "{o}"],
    ["kvcomm", "eval", "--ratio", "0.1,x", "--out", "{o}"],
    ["kvcomm", "eval", "--boundary-k", "-1", "--out", "{o}"], ["kvcomm", "eval", "--out", "{d}/afile"],
    ["completion", "fish"], ["completion"], ["skus", "--nope"], ["nope"], ["--nope"], ["run", "--sku"],
    ["vllm", "generate", ""], ["vllm", "nope"],
]

# --------------------------------------------------------------------------------------------
# Malformed files. Each kind has a valid file (``*_ok``) and ways to break it; a command reads it.


def _json_breaks(valid: dict, fields: dict, optional=()) -> dict[str, bytes]:
    """name -> bytes: whole-file breaks, then each named field set to each bad value, or removed
    (unless the field is optional)."""
    text = json.dumps(valid, indent=1)
    out = {
        "empty": b"", "blank": b"\n \n", "binary": b"\xff\xfe\x00\x01\x80binary\xc3",
        "latin1": ("{" + f'"a": "{chr(233)}"' + "}").encode("latin-1"), "truncated": text[: len(text) // 2].encode(),
        "list": b"[1, 2]", "null": b"null", "number": b"42", "string": b'"x"', "nan": b"NaN",
        "bom_garbage": b"\xef\xbb\xbf{oops",
    }
    for field, bads in fields.items():
        if field not in optional:
            out[f"{field}-missing"] = json.dumps({k: v for k, v in valid.items() if k != field}).encode()
        for i, bad in enumerate(bads):
            out[f"{field}-{i}"] = json.dumps({**valid, field: bad}, allow_nan=True).encode()
    return out


_BAD_INT = ["x", -1, 0, 1.5, None, [], True, float("nan"), 1e300]
_BAD_NUM = ["x", -1.0, None, [], float("nan"), float("inf")]


def _config_ok() -> dict:
    return json.loads((REPO / "common/model_configs/tiny-llama.json").read_text())


def _calibration_ok() -> dict:
    return json.loads((REPO / "results/vllm-cpu/calibration-cpu.json").read_text())


def _trace_ok() -> list[dict]:
    return [{"job_id": f"j{i}", "prefix_group": "g", "system_tokens": 64, "arrival_s": float(i),
             "turns": [{"input_tokens": 32, "output_tokens": 8, "tool": "bash", "tool_s": 0.5},
                       {"input_tokens": 16, "output_tokens": 4, "tool": None, "tool_s": 0.0}]} for i in range(3)]


RUN_SRC = REPO / "results/eval/cpu/probes/cpu/20261201T112057Z-vm"
REPLAY_SRC = REPO / "results/vllm-cpu/sim-scaled"
ROWS_SRC = REPO / "results/steps/cpu-llama-60m.parquet"


def _jsonl(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def file_breaks() -> dict[str, dict[str, bytes]]:
    """kind -> {break name -> file bytes}."""
    config = _json_breaks(_config_ok(), {f: _BAD_INT for f in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
        "vocab_size", "head_dim")}, optional=("num_key_value_heads", "head_dim"))
    for f in ("num_key_value_heads", "head_dim"):  # null means absent (derived) for these two
        config.pop(f"{f}-{_BAD_INT.index(None)}")
    ok = {k: v for k, v in _config_ok().items() if k != "head_dim"}
    config["heads-not-dividing-hidden"] = json.dumps({**ok, "num_attention_heads": 3, "num_key_value_heads": 3}).encode()
    config["kv-heads-not-dividing-heads"] = json.dumps({**ok, "num_key_value_heads": 3}).encode()
    config["kv-heads-above-heads"] = json.dumps({**ok, "num_key_value_heads": 8}).encode()
    cal = _calibration_ok()
    calibration = _json_breaks(cal, {"schema": [1, "gpubench.calibration/9", None], "sku": [1, "nope", None],
                                     **{k: ["x", [], 1] for k in cal if isinstance(cal[k], dict)}},
                               optional=("schema", "meta", "hardware", "host_residual", "curves", "cpu_ops"))
    trace_rows = _trace_ok()
    trace = {
        "empty": b"", "blank": b"\n\n", "binary": b"\xff\xfe\x00\x01binary\n", "truncated": _jsonl(trace_rows)[:150],
        "list_line": b"[1, 2]\n", "null_line": b"null\n", "mid_garbage": _jsonl(trace_rows[:1]) + b"{oops\n" + _jsonl(trace_rows[1:]),
    }
    ge0 = [v for v in _BAD_INT if v != 0]  # token counts may be 0; a null time is the default
    opt_num = [v for v in _BAD_NUM if v is not None]
    for field, bads in {"job_id": [1, "", None], "system_tokens": ge0, "arrival_s": opt_num,
                        "turns": [[], "x", None, [1], [{}]], "prefix_group": [1, ""]}.items():
        for i, bad in enumerate(bads):
            rows = [dict(r) for r in trace_rows]
            rows[1][field] = bad
            trace[f"{field}-{i}"] = _jsonl(rows).replace(b"Infinity", b"Infinity")
    for field, bads in {"input_tokens": ge0, "output_tokens": _BAD_INT, "tool_s": opt_num, "tool": [1, ""]}.items():
        for i, bad in enumerate(bads):
            rows = json.loads(json.dumps(trace_rows))
            rows[2]["turns"][0][field] = bad
            trace[f"turn_{field}-{i}"] = _jsonl(rows)
    manifest = json.loads((RUN_SRC / "manifest.json").read_text())
    run = {f"manifest-{k}": v for k, v in _json_breaks(manifest, {
        "schema_version": ["1", 99, None, 1.5, True], "probes": [[], "x", None], "sku": [None, 1, "nope"],
        "device": ["x", 1, []]}, optional=("device",)).items()}
    stream = (RUN_SRC / "stream.jsonl").read_bytes().splitlines(keepends=True)[:6]
    run.update({
        "stream-binary": b"".join(stream[:2]) + b"\xff\xfe\n" + b"".join(stream[2:]),
        "stream-mid_garbage": b"".join(stream[:2]) + b"{oops\n" + b"".join(stream[2:]),
        "stream-list_line": b"".join(stream[:2]) + b"[1]\n", "stream-nokey": b"".join(stream[:2]) + b'{"a": 1}\n',
        "stream-duplicate": b"".join(stream) + stream[0],
    })
    row0 = json.loads(stream[0])
    for field in [k for k, v in row0.items() if isinstance(v, (int, float)) and not isinstance(v, bool)][:6]:
        for i, bad in enumerate(["x", [], {}, True]):  # (null is allowed: a figure not measured)
            run[f"stream-{field}-{i}"] = b"".join(stream[1:]) + json.dumps({**row0, field: bad}).encode() + b"\n"
    rows = {"empty": b"", "binary": b"\xff\xfe\x00\x01binary", "truncated": ROWS_SRC.read_bytes()[:3000],
            "csv_garbage": b"a,b\n1,2\n", "csv_binary": b"\xff\xfe,\x00\n"}
    return {"config": config, "calibration": calibration, "trace": trace, "run": run, "rows": rows}


# kind -> command templates reading a file of that kind at {f}
READERS = {
    "config": [["predict", "--sku", "h100", "--model", "{f}"], _SYN + ["--model", "{f}"],
               ["profile", "--model", "{f}", "--out", "{o}.parquet"], _SWEEP + ["--model", "{f}"]],
    "calibration": [["predict", "--calibration", "{f}"], ["evaluate", "{d}/rows_ok.parquet", "--calibration", "{f}", "--out", "{o}"],
                    _SYN + ["--sku", "cpu", "--calibration", "{f}"]],
    "trace": [["replay", "--trace", "{f}", "--no-progress", "--out", "{o}"], ["trace", "stats", "{f}"],
              _SWEEP + ["--trace", "{f}"]],
    "run": [["show", "{f}"], ["fit", "{f}", "-o", "{o}.json"], ["compare", "{d}/run_ok", "{f}"],
            ["run", "--resume", "{f}"]],
    "rows": [["evaluate", "{f}", "--out", "{o}"]],
}
ROWS_EXT = {"csv_garbage": ".csv", "csv_binary": ".csv"}


def make_fixtures(d: Path) -> None:
    """Valid inputs (``*_ok``) and one file (or run directory) per break, under ``d``."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "afile").write_text("x")
    (d / "config_ok.json").write_text(json.dumps(_config_ok()))
    (d / "calibration_ok.json").write_text(json.dumps(_calibration_ok()))
    (d / "trace_ok.jsonl").write_bytes(_jsonl(_trace_ok()))
    shutil.copyfile(ROWS_SRC, d / "rows_ok.parquet")
    run_ok = d / "run_ok"
    run_ok.mkdir(exist_ok=True)
    for name in ("manifest.json", "stream.jsonl", "launch.jsonl", "peak.jsonl"):
        shutil.copyfile(RUN_SRC / name, run_ok / name)
    shutil.copytree(REPLAY_SRC, d / "replay_ok", dirs_exist_ok=True)
    for kind, breaks in file_breaks().items():
        for name, data in breaks.items():
            path = fixture_path(d, kind, name)
            if kind == "run":
                shutil.copytree(run_ok, path, dirs_exist_ok=True)
                target = path / ("manifest.json" if name.startswith("manifest-") else "stream.jsonl")
                target.write_bytes(data)
            else:
                path.write_bytes(data)


def fixture_path(d: Path, kind: str, name: str) -> Path:
    ext = {"config": ".json", "calibration": ".json", "trace": ".jsonl", "run": "", "rows": ROWS_EXT.get(name, ".parquet")}[kind]
    return d / f"{kind}__{name}{ext}"


def all_cases(d: Path) -> list[tuple[str, list[str]]]:
    """(label, argv template) for every malformed input, in a fixed order."""
    out = []
    for base, opt, kind in OPTIONS:
        for v in BAD_VALUES[kind]:
            out.append((f"option {opt} {v!r} ({base[0]})",
                        [*base, f"{opt}={v}" if v.startswith("-") or not v else opt, *([] if v.startswith("-") or not v else [v])]))
    for argv in SET_CASES + OTHER_CASES:
        out.append(("argv " + " ".join(argv), list(argv)))
    for kind, breaks in file_breaks().items():
        for name in breaks:
            for reader in READERS[kind]:
                f = str(fixture_path(d, kind, name))
                out.append((f"{kind} {name} ({' '.join(reader[:2])})", [a.replace("{f}", f) for a in reader]))
    return out


# --------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    rc: int | None
    stdout: str
    stderr: str
    hung: bool = False


class _Timeout(BaseException):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def invoke(argv: list[str], cwd: Path, timeout_s: float = 30.0) -> Outcome:
    """``gpubench.cli.main(argv)`` in this process, in ``cwd``, stdout/stderr captured; an exception
    that escapes main is printed as Python would print it (so a traceback shows as one)."""
    import traceback

    from gpubench.cli import main

    out, err = io.StringIO(), io.StringIO()
    old_cwd = os.getcwd()
    old_handler = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    rc, hung = None, False
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(argv)
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if not isinstance(e.code, int) and e.code is not None:
                    print(e.code, file=err)
            except _Timeout:
                hung = True
            except BaseException:  # noqa: BLE001 - what a user would see
                traceback.print_exc(file=err)
                rc = 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        os.chdir(old_cwd)
    return Outcome(rc, out.getvalue(), err.getvalue(), hung)


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """relative path -> (size, mtime_ns) of every file and directory under root."""
    snap = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            snap[os.path.relpath(p, root)] = (st.st_size if name in filenames else -1, st.st_mtime_ns if name in filenames else 0)
    return snap


def verdict(o: Outcome, before: dict, after: dict) -> str:
    if o.hung:
        return HUNG
    text = o.stderr + o.stdout
    if "Traceback" in text:
        return TRACEBACK
    if o.rc == 0:
        return ACCEPTED
    lines = [ln for ln in o.stderr.splitlines() if ln.strip()]
    if o.rc != 2 or len(lines) != 1 or not lines[0].startswith("gpubench") or "error" not in lines[0]:
        return WRONG_EXIT
    if _changes(before, after):
        return WROTE
    return CLEAN


def _changes(before: dict, after: dict) -> list[str]:
    """Paths created, changed or removed (a lock file too: refused input takes no lock)."""
    return [k for k in sorted(set(before) | set(after)) if before.get(k) != after.get(k)]


def fill(argv: list[str], d: Path, o: Path) -> list[str]:
    return [a.replace("{d}", str(d)).replace("{o}", str(o)) for a in argv]


def describe(o: Outcome, before: dict, after: dict) -> str:
    changed = _changes(before, after)
    return f"rc={o.rc} changed={changed[:5]} stderr={o.stderr[-600:]!r} stdout={o.stdout[-200:]!r}"
