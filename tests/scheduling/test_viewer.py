"""Viewer: data loading, a real server on 127.0.0.1, the CLI, and a real headless Chromium.

The browser tests drive Debian's Chromium through chromedriver (selenium); they skip, saying so,
only when chromium/chromedriver are missing. Screenshots land in pytest's tmp dir
(``GPUBENCH_VIEWER_SHOTS=DIR`` keeps them somewhere to look at).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pandas as pd
import pytest

from common.errors import ResultsFormatError
from scheduling.viewer.data import bin_steps, load_run
from scheduling.viewer.server import ViewerServer, export_html, render_page

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
needs_browser = pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER), reason="chromium and chromedriver are not installed (apt-get install chromium chromium-driver)")


def write_replay_dir(out_dir: Path, *, seed: int = 0, num_jobs: int = 30, jps: float = 3.0) -> Path:
    """A replay directory written by the real engine (the format ``gpubench replay`` writes): short
    multi-turn agents of two prefix groups in a pool small enough to preempt, a constant step."""
    from scheduling.experiments.replay import ReplayConfig, run_replay, write_outputs
    from scheduling.workload.trace_synth import SyntheticParams, synthetic_jobs
    from scheduling.workload.traces import with_poisson_arrivals

    params = SyntheticParams(turns_mean=6, turns_min=2, turns_max=10, system_tokens_min=400, system_tokens_max=800,
                             obs_tokens_median=150, obs_tokens_max=1500, task_tokens_median=200,
                             out_tokens_median=60, out_tokens_max=200, num_prefix_groups=2)
    jobs = with_poisson_arrivals(synthetic_jobs(num_jobs, seed=seed, params=params), jps, seed=seed)
    config = ReplayConfig(num_gpu_blocks=420, max_num_batched_tokens=512, max_num_seqs=10,
                          step_cost="constant:0.02", seed=seed)
    return write_outputs(run_replay(jobs, config), out_dir, command="tests/scheduling/test_viewer.py")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return write_replay_dir(tmp_path_factory.mktemp("replay") / "run")


def test_load_run_totals_match_files(run_dir):
    data = load_run(run_dir)
    steps = pd.read_csv(run_dir / "steps.csv")
    assert data["totals"]["num_steps"] == len(steps)
    assert data["totals"]["num_preemptions"] == steps["num_preemptions"].sum() > 0
    assert sum(data["break_reasons"].values()) == len(steps)
    assert len(data["jobs"]["job_id"]) == len(pd.read_csv(run_dir / "jobs.csv"))
    json.dumps(data)  # JSON-able


def test_binning_keeps_totals(run_dir):
    steps = pd.read_csv(run_dir / "steps.csv")
    binned = bin_steps(steps, 100)
    assert len(binned) == 100
    for col in ("num_prefill_tokens", "num_decode_tokens", "num_preemptions"):
        assert binned[col].sum() == steps[col].sum()
    assert binned["kv_used_blocks"].max() == steps["kv_used_blocks"].max()
    data = load_run(run_dir, max_step_points=100)
    assert data["steps_binned"] and data["totals"]["num_steps"] == len(steps)


def test_load_run_errors(tmp_path, run_dir):
    with pytest.raises(ResultsFormatError, match="not a directory"):
        load_run(tmp_path / "nope")
    bad = tmp_path / "bad"
    shutil.copytree(run_dir, bad)
    (bad / "summary.json").write_text("{oops")
    with pytest.raises(ResultsFormatError, match=r"summary.json: invalid JSON"):
        load_run(bad)
    shutil.copy(run_dir / "summary.json", bad / "summary.json")
    pd.read_csv(run_dir / "steps.csv").drop(columns=["num_running"]).to_csv(bad / "steps.csv", index=False)
    with pytest.raises(ResultsFormatError, match=r"steps.csv: missing column\(s\) num_running"):
        load_run(bad)
    (bad / "turns.csv").unlink()
    shutil.copy(run_dir / "steps.csv", bad / "steps.csv")
    with pytest.raises(ResultsFormatError, match=r"turns.csv: missing"):
        load_run(bad)


def test_page_is_self_contained(run_dir):
    page = render_page(load_run(run_dir))
    assert "/*__" not in page
    assert "http://" not in page and "https://" not in page
    # every referenced resource is inline (data: URI); nothing is fetched but data.json when served
    refs = re.findall(r'(?:src|href)\s*=\s*["\']([^"\']*)', page)
    assert all(r.startswith("data:") for r in refs), refs


def test_server_routes_on_loopback(run_dir):
    with ViewerServer(run_dir) as server:
        assert server.httpd.server_address[0] == "127.0.0.1" and server.port > 0
        page = urllib.request.urlopen(server.url, timeout=10).read().decode()
        assert "<canvas" not in page and "chart-batch" in page  # canvases are drawn by the script
        data = json.loads(urllib.request.urlopen(server.url + "data.json", timeout=10).read())
        assert data["totals"]["num_steps"] == len(pd.read_csv(run_dir / "steps.csv"))
        summary = json.loads(urllib.request.urlopen(server.url + "summary.json", timeout=10).read())
        assert summary == json.loads((run_dir / "summary.json").read_text())
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(server.url + "../etc/passwd", timeout=10)
        assert info.value.code == 404


def test_cli_export_and_errors(run_dir, tmp_path):
    out = tmp_path / "page.html"
    cmd = [sys.executable, "-m", "gpubench.cli", "view", str(run_dir), "--export", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert out.stat().st_size > 10_000 and "gpubench-data" in out.read_text()
    proc = subprocess.run([sys.executable, "-m", "gpubench.cli", "view", str(tmp_path / "missing"), "--no-open"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "not a directory" in proc.stderr


@pytest.mark.parametrize("sigint_ignored_at_start", [False, True], ids=["terminal", "background-job"])
def test_cli_serves_until_interrupted(run_dir, sigint_ignored_at_start):
    # A background job of a non-interactive shell starts with SIGINT ignored; Ctrl-C (SIGINT) must
    # still stop the server.
    import signal

    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored_at_start else None
    proc = subprocess.Popen([sys.executable, "-m", "gpubench.cli", "view", str(run_dir), "--no-open"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, preexec_fn=ignore)
    try:
        line = proc.stdout.readline()
        url = line.split(" at ")[1].split()[0]
        assert url.startswith("http://127.0.0.1:")
        assert b"gpubench step log" in urllib.request.urlopen(url, timeout=10).read()
    finally:
        proc.send_signal(2)  # SIGINT, as Ctrl-C
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()  # say why it hung instead of leaving a server behind
            _, err = proc.communicate(timeout=10)
            raise AssertionError(f"gpubench view did not stop within 20 s of SIGINT; stderr: {err[-2000:]!r}") from None
    assert proc.returncode == 0


# ---------------------------------------------------------------------------------------------
# Real browser
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("chromium and chromedriver are not installed")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1400,2400",
                 f"--user-data-dir={tmp_path_factory.mktemp('chrome-profile')}"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    yield driver
    driver.quit()


def _wait_ready(driver, timeout_s=30.0) -> dict:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        state = driver.execute_script(
            "const v = window.gpubenchViewer; return v ? {ready: v.ready, error: v.error} : null;")
        if state and (state["ready"] or state["error"]):
            assert not state["error"], state["error"]
            return state
        time.sleep(0.1)
    raise AssertionError("viewer did not become ready")


def _ink_fraction(driver, canvas_id: str) -> float:
    """Share of a chart's canvas pixels that are not transparent (something was drawn)."""
    return driver.execute_script("""
        const c = document.querySelector('#' + arguments[0] + ' canvas');
        if (!c || !c.width) return 0;
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++;
        return n / (c.width * c.height);""", canvas_id)


CHARTS = ("chart-batch", "chart-step-tokens", "chart-step-decode", "chart-queue", "chart-kv", "chart-pool", "chart-break", "chart-preempt",
          "chart-hit", "chart-ttft", "chart-jobs")


def _check_page(driver, run_dir: Path, shot: Path) -> None:
    _wait_ready(driver)
    summary = json.loads((run_dir / "summary.json").read_text())["metrics"]
    js = driver.execute_script("return window.gpubenchViewer.summary;")
    for key in ("num_jobs", "num_turns", "steps", "preemptions", "jct_p50_s", "jct_mean_s", "gpu_prefix_hit_rate"):
        assert js[key] == pytest.approx(summary[key], rel=1e-6, abs=1e-9), key
    assert driver.execute_script("return window.gpubenchViewer.mismatches;") == []
    marks = driver.execute_script("return window.gpubenchViewer.charts;")
    has_pool = max(pd.read_csv(run_dir / "steps.csv")["pool_total_blocks"]) > 0
    for chart in CHARTS:
        if chart == "chart-pool" and not has_pool:  # no pool in this run: axes and a note, no data
            assert marks[chart]["marks"] == 0
            continue
        assert marks[chart]["marks"] > 0, chart
        assert _ink_fraction(driver, chart) > 0.01, chart
    _check_step_tokens(driver, json.loads((run_dir / "summary.json").read_text())["config"]["max_num_batched_tokens"])
    # the timeline draws one row per shown job
    assert driver.execute_script("return window.gpubenchViewer.data.timeline_jobs.length;") == summary["num_jobs"]
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == [], errors
    driver.save_screenshot(str(shot))
    assert shot.stat().st_size > 20_000


def _check_step_tokens(driver, budget: int) -> None:
    """The per-step chart: no drawn column above the token budget (a bin's sum once peaked at ~5x
    it), and decode tokens drawn, in the stacked chart and on their own scale."""
    charts = driver.execute_script("return window.gpubenchViewer.charts;")
    assert driver.execute_script("return window.gpubenchViewer.data.token_budget;") == budget
    stacked = charts["chart-step-tokens"]
    assert 0 < stacked["stackMax"] <= budget * (1 + 1e-9)
    assert stacked["seriesMarks"]["decode tokens"] > 0 and stacked["seriesMarks"]["prefill tokens"] > 0
    assert stacked["seriesMarks"][f"token budget ({budget:,})"] > 0
    assert charts["chart-step-decode"]["seriesMarks"]["decode tokens per step"] > 0
    assert _ink_fraction(driver, "chart-step-decode") > 0.01


def _shot_dir(tmp_path: Path) -> Path:
    keep = os.environ.get("GPUBENCH_VIEWER_SHOTS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        return Path(keep)
    return tmp_path


@needs_browser
def test_browser_served_page(browser, run_dir, tmp_path):
    with ViewerServer(run_dir) as server:
        browser.get(server.url)
        _check_page(browser, run_dir, _shot_dir(tmp_path) / "viewer_served.png")


@needs_browser
def test_browser_exported_file(browser, run_dir, tmp_path):
    page = export_html(run_dir, tmp_path / "export.html")
    browser.get(page.as_uri())  # file:// with no server: the data must be embedded
    _check_page(browser, run_dir, _shot_dir(tmp_path) / "viewer_export.png")


@needs_browser
def test_browser_on_real_replay_output(browser, tmp_path):
    """The viewer on what the real engine writes (not the fixture)."""
    from scheduling.experiments.replay import ReplayConfig, run_replay, write_outputs
    from scheduling.workload.trace_synth import SyntheticParams, synthetic_jobs
    from scheduling.workload.traces import with_poisson_arrivals

    params = SyntheticParams(turns_mean=6, turns_max=10, obs_tokens_median=300)
    jobs = with_poisson_arrivals(synthetic_jobs(12, 0, params), jps=1.0, seed=0)
    out = tmp_path / "real"
    write_outputs(run_replay(jobs, ReplayConfig(sku="l40s", model="llama-3.1-8b", policy="continuum", seed=0)), out)
    data = load_run(out)
    assert data["totals"]["num_steps"] > 0
    with ViewerServer(out) as server:
        browser.get(server.url)
        _wait_ready(browser)
        assert browser.execute_script("return window.gpubenchViewer.mismatches;") == []
        # The serving metrics users ask for, recomputed in the page from the tables, equal the summary's.
        shown = browser.execute_script("return window.gpubenchViewer.summary;")
        metrics = json.loads((out / "summary.json").read_text())["metrics"]
        for key in ("tpot_p50_s", "tpot_p90_s", "tpot_p99_s", "ttft_p99_s", "slo_turn_share", "goodput_tok_per_s"):
            assert shown[key] == pytest.approx(metrics[key], rel=1e-3, abs=1e-6), key
        _check_step_tokens(browser, 2048)  # vllm serve's budget on an L40S
        marks = browser.execute_script("return window.gpubenchViewer.charts;")
        empty_ok = {"chart-pool"} | ({"chart-preempt"} if data["totals"]["num_preemptions"] == 0 else set())
        assert {c: marks[c]["marks"] for c in CHARTS if c not in empty_ok and marks[c]["marks"] == 0} == {}
        assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []
        browser.save_screenshot(str(_shot_dir(tmp_path) / "viewer_real.png"))


def test_viewer_refuses_foreign_hosts_and_closes_idle_sockets(tmp_path, monkeypatch):
    """DNS rebinding: a request whose Host is not 127.0.0.1/localhost gets 403; an idle connection
    is closed after the handler's timeout instead of holding a thread forever."""
    import http.client
    import socket

    from scheduling.experiments.replay import ReplayConfig, run_replay, write_outputs
    from scheduling.viewer import server as server_mod
    from scheduling.workload.trace_synth import SyntheticParams, synthetic_jobs
    from scheduling.workload.traces import with_poisson_arrivals

    jobs = with_poisson_arrivals(synthetic_jobs(3, 0, SyntheticParams(turns_mean=3, turns_max=4)), jps=1.0, seed=0)
    out = tmp_path / "run"
    write_outputs(run_replay(jobs, ReplayConfig(sku="h100-sxm", step_cost="constant:0.01")), out)
    monkeypatch.setattr(server_mod._Handler, "timeout", 1)
    with server_mod.ViewerServer(out) as srv:
        for host, status in (("127.0.0.1", 200), ("localhost:8080", 200), ("evil.example.com", 403),
                             ("127.0.0.1.evil.example", 403)):
            conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
            conn.putrequest("GET", "/data.json", skip_host=True)
            conn.putheader("Host", host)
            conn.endheaders()
            assert conn.getresponse().status == status, host
            conn.close()
        idle = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        idle.settimeout(5)
        assert idle.recv(1) == b""  # the server closed it after ~1 s of silence
        idle.close()


def test_binned_steps_carry_their_count_so_the_page_draws_tokens_per_step():
    import pandas as pd

    from scheduling.viewer.data import bin_steps

    steps = pd.DataFrame({"step": range(1, 101), "t_s": [i * 0.01 for i in range(100)], "dur_s": [0.01] * 100,
                          "num_prefill_tokens": [8192] * 100, "num_decode_tokens": [4] * 100,
                          "num_running": [5] * 100, "break_reason": ["token_budget"] * 100})
    binned = bin_steps(steps, 10)
    assert len(binned) == 10 and binned["steps_in_bin"].sum() == 100
    per_step = binned["num_prefill_tokens"] / binned["steps_in_bin"]
    assert (per_step == 8192).all()  # the budget, not ten times it
    assert binned["num_prefill_tokens"].sum() == 819_200  # totals kept for the summary


@needs_browser
def test_browser_binned_step_log_stays_under_the_budget(browser, run_dir, tmp_path):
    """A step log binned to a few points (as a long replay is): the page divides each bin by its
    step count, so the per-step chart still peaks at or below the budget, not at a bin's sum."""
    data = load_run(run_dir, max_step_points=40)
    assert data["steps_binned"]
    budget = data["token_budget"]
    sums = [p + d for p, d in zip(data["steps"]["num_prefill_tokens"], data["steps"]["num_decode_tokens"])]
    assert max(sums) > budget  # what the old chart drew
    page = tmp_path / "binned.html"
    page.write_text(render_page(data), encoding="utf-8")
    browser.get(page.as_uri())
    _wait_ready(browser)
    _check_step_tokens(browser, budget)


def test_token_budget_read_from_the_run():
    from scheduling.viewer.data import token_budget

    assert token_budget({"config": {"max_num_batched_tokens": 512}}) == 512
    live = {"config": {"engine": "vllm"}, "metrics": {"engine": {"max_num_batched_tokens": 4096}}}
    assert token_budget(live) == 4096
    assert token_budget({"config": {"sku": "h100-sxm", "max_num_batched_tokens": None}}) == 8192
    assert token_budget({"config": {"sku": "no-such-gpu"}}) is None and token_budget({}) is None


def _two_policies(tmp_path) -> list[Path]:
    """FCFS and Continuum replayed on the same jobs (the comparison the viewer is asked for)."""
    from scheduling.experiments.replay import ReplayConfig, run_replay, write_outputs
    from scheduling.workload.trace_synth import SyntheticParams, synthetic_jobs
    from scheduling.workload.traces import with_poisson_arrivals

    jobs = with_poisson_arrivals(synthetic_jobs(10, 0, SyntheticParams(turns_mean=5, turns_max=8)), jps=1.0, seed=0)
    dirs = []
    for policy in ("fcfs", "continuum"):
        out = tmp_path / "runs" / policy
        write_outputs(run_replay(jobs, ReplayConfig(sku="l40s", policy=policy, seed=0)), out)
        dirs.append(out)
    return dirs


def _check_compare_page(driver, dirs: list[Path], labels: list[str], shot: Path) -> None:
    _wait_ready(driver)
    assert driver.execute_script("return window.gpubenchViewer.mismatches;") == []
    shown = driver.execute_script("return window.gpubenchViewer.summary;")
    assert sorted(shown) == sorted(labels)
    for label, d in zip(labels, dirs):
        metrics = json.loads((d / "summary.json").read_text())["metrics"]
        for key in ("num_jobs", "num_turns", "steps", "jct_mean_s", "ttft_p90_s", "gpu_prefix_hit_rate"):
            assert shown[label][key] == pytest.approx(metrics[key], rel=1e-6, abs=1e-9), (label, key)
        # the table shows the same number in this run's column
        cell = driver.execute_script(
            "return document.querySelector(`#compare-summary td[data-run=\"${arguments[0]}\"][data-key=\"jct_mean_s\"]`)"
            ".dataset.value;", label)
        assert float(cell) == pytest.approx(metrics["jct_mean_s"], rel=1e-6)
    header = driver.execute_script(
        "return [...document.querySelectorAll('#compare-summary td.run')].map(td => td.textContent);")
    assert header == labels
    charts = driver.execute_script("return window.gpubenchViewer.charts;")
    for chart in ("cmp-tokens", "cmp-running", "cmp-kv", "cmp-ttft", "cmp-jct", "cmp-hit"):
        assert all(charts[chart]["seriesMarks"][label] > 0 for label in labels), (chart, charts[chart])
        assert _ink_fraction(driver, chart) > 0.005, chart
    _check_compare_timelines(driver, dirs, labels)
    assert [e for e in driver.get_log("browser") if e["level"] == "SEVERE"] == []
    driver.save_screenshot(str(shot))


def _check_compare_timelines(driver, dirs: list[Path], labels: list[str]) -> None:
    """Compared runs once lost the per-job timeline: now each run has its own, titled with its
    label, one bar group per turn of its first jobs, on one time axis shared by every run."""
    charts = driver.execute_script("return window.gpubenchViewer.charts;")
    titles = driver.execute_script(
        "return [...document.querySelectorAll('section[data-run]')].map(s => [s.dataset.run, s.querySelector('h2').textContent,"
        " !!s.querySelector('.legend-row'), s.querySelector('.chart').id]);")
    assert [t[0] for t in titles] == labels
    for i, (label, d) in enumerate(zip(labels, dirs)):
        _, title, has_key, chart = titles[i]
        assert chart == f"cmp-jobs-{i}" and has_key and title.startswith(f"Per-job timelines: {label}")
        turns = pd.read_csv(d / "turns.csv")
        assert charts[chart]["marks"] == len(turns) > 0  # every turn of these (few) jobs drawn
        assert _ink_fraction(driver, chart) > 0.01, chart


@needs_browser
def test_browser_compares_runs_side_by_side(browser, tmp_path):
    dirs = _two_policies(tmp_path)
    page = tmp_path / "compare.html"
    proc = subprocess.run([sys.executable, "-m", "gpubench.cli", "view", *map(str, dirs), "--export", str(page)],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    browser.get(page.as_uri())
    _check_compare_page(browser, dirs, ["fcfs", "continuum"], _shot_dir(tmp_path) / "viewer_compare_export.png")
    with ViewerServer(dirs) as server:
        browser.get(server.url)
        _check_compare_page(browser, dirs, ["fcfs", "continuum"], _shot_dir(tmp_path) / "viewer_compare_served.png")
        listed = json.loads(urllib.request.urlopen(server.url + "summary.json", timeout=10).read())
        assert [d["config"]["policy"] for d in listed] == ["fcfs", "continuum"]


def test_compared_runs_with_one_name_are_labelled_by_their_parents(tmp_path):
    from scheduling.viewer.data import load_runs

    a = write_replay_dir(tmp_path / "a" / "run", seed=0)
    b = write_replay_dir(tmp_path / "b" / "run", seed=1)
    assert [r["label"] for r in load_runs([a, b])["runs"]] == ["a/run", "b/run"]


@pytest.mark.parametrize("case", ["twice", "one-missing"])
def test_compare_errors_are_one_line(run_dir, tmp_path, case):
    second = run_dir if case == "twice" else tmp_path / "missing"
    proc = subprocess.run([sys.executable, "-m", "gpubench.cli", "view", str(run_dir), str(second), "--export",
                           str(tmp_path / "x.html")], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert ("given twice" if case == "twice" else "not a directory") in proc.stderr
    assert not (tmp_path / "x.html").exists()
