"""Calibration from run directories written with RunWriter: synthetic rows with known answers."""
import json
import subprocess
import sys

import numpy as np
import pytest

from common.errors import ConfigError, ResultsFormatError
from common.stats import summarize
from gpubench.results import RunWriter
from predictor import Calibration, HardwareSpec, StepModel, efficiency as eff
from predictor.calibrate import defaults, fit_eta_mem, fit_run, hardware_from_run

# Known answers the synthetic GPU run is generated from
H100 = dict(eta_max=0.85, x_half=0.30, f_clk=0.72, active=0.95, duty=0.80, launch=2.2e-6, graph=1.2e-6,
            l2_bytes=52_428_800, sms=132, bw=3350e9)
CPU = dict(bw=12.5e9, eta_max=0.97, x_half=0.004, active=0.9, duty=0.75, dispatch=6.0e-6, llc=32 * 2**20)


def _row(probe, key, t_s, rng, **fields):
    """A schema row whose repetitions scatter 1 % around t_s (the median)."""
    times = list(t_s * (1 + 0.01 * rng.standard_normal(11)))
    times[0] *= 1.5  # warm-up-ish first repetition (discarded by summarize)
    s = summarize(times)
    return {"key": key, "probe": probe, "times_s": times, **s, "valid": True, **fields}


def _gbps(nbytes, t):
    return {"gbps_median": nbytes / t / 1e9, "gbps_best": nbytes / (0.97 * t) / 1e9}


def write_gpu_run(root, rng, *, with_clock=True, probes=("stream", "l2", "launch", "peak", "gemm")):
    k = H100
    w = RunWriter.create(root, sku="h100-sxm", host="synthetic", probes=list(probes), argv=["synthetic"],
                         device={"backend": "cuda", "name": "NVIDIA H100 80GB HBM3",
                                 "properties": {"sm_count": k["sms"], "l2_bytes": k["l2_bytes"]}})
    noise = lambda: 1 + 0.01 * rng.standard_normal()  # noqa: E731
    if "l2" in probes:
        ws = 64 * 1024.0
        while ws < 8 * k["l2_bytes"]:
            eta = eff.eta_mem(ws / k["l2_bytes"], k["eta_max"], k["x_half"]) * noise()
            t = ws / (k["bw"] * eta)
            w.append("l2", _row("l2", f"l2_cold_{int(ws)}", t, rng, mode="cold", working_set_bytes=ws, bytes=ws,
                                passes=1, backend="cuda", **_gbps(ws, t)))
            ws *= 1.25
    if "stream" in probes:
        for arr in (k["l2_bytes"] / 8, k["l2_bytes"] / 2, 2 * k["l2_bytes"], 8 * k["l2_bytes"]):
            nbytes = 3 * arr
            t = nbytes / (k["bw"] * eff.eta_mem(nbytes / k["l2_bytes"], k["eta_max"], k["x_half"]) * noise())
            w.append("stream", _row("stream", f"stream_triad_bf16_{int(arr)}", t, rng, kernel="triad", dtype="fp32",
                                    array_bytes=arr, bytes=nbytes, backend="cuda", **_gbps(nbytes, t)))
            # copy rows must not enter the fit (write-allocate): make them wildly off
            w.append("stream", _row("stream", f"stream_copy_bf16_{int(arr)}", t / 5, rng, kernel="copy", dtype="fp32",
                                    array_bytes=arr, bytes=2 * arr, backend="cuda", **_gbps(nbytes, t / 5)))
    if "launch" in probes:
        for kind, per in (("device_interval", k["launch"]), ("graph_node", k["graph"]), ("host_enqueue", 4e-6)):
            for count in (1, 100, 10000):
                p = per * (3 if count == 1 else 1)
                w.append("launch", {**_row("launch", f"launch_{kind}_{count}", p * count, rng), "kind": kind,
                                    "count": count, "per_launch_s_median": p, "per_launch_s_min": 0.95 * p})
    spec = HardwareSpec.from_sku("h100").peak("bf16")
    spec_mhz = HardwareSpec.from_sku("h100").spec_clock_mhz  # clock factors are against the clock P is quoted at
    clock = {"clock_mhz_mean": k["f_clk"] * spec_mhz, "clock_max_ref_mhz": 1980.0} if with_clock else \
        {"clock_mhz_mean": None, "clock_max_ref_mhz": None}
    if "peak" in probes:
        # the peak loop runs short, at 0.9 of the spec clock
        tf = spec * 0.9 * k["active"] / 1e12
        w.append("peak", {**_row("peak", "peak_tc_bf16", 1.0 / tf, rng), "dtype": "bf16", "unit": "tensor_core",
                          "tflops_median": tf, "tflops_best": tf * 1.01, "spec_tflops": spec / 1e12,
                          "clock_mhz_mean": 0.9 * spec_mhz, "clock_max_ref_mhz": 1980.0})
        w.append("peak", {**_row("peak", "peak_tc_fp16", 1.0, rng), "dtype": "fp16", "unit": "tensor_core",
                          "tflops_median": 1.0, "tflops_best": 1.0, "spec_tflops": spec / 1e12})
    if "gemm" in probes:
        for n, kk in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
            for m in (1, 8, 64, 512, 2048, 8192, 16384):
                flops = 2.0 * m * n * kk
                nbytes = 2.0 * (m * kk + kk * n + m * n)
                cl = eff.eta_cluster(m, n, kk, k["sms"], eff.tile_shape("hopper"))
                t_c = flops / (spec * k["f_clk"] * cl * k["active"] * k["duty"])
                t_m = (nbytes + k["x_half"] * k["l2_bytes"]) / (k["bw"] * k["eta_max"])
                t = max(t_c, t_m)
                w.append("gemm", {**_row("gemm", f"gemm_bf16_{m}_{n}_{kk}", t, rng), "dtype": "bf16", "m": m, "n": n,
                                  "k": kk, "flops": flops, "bytes": nbytes, "tflops_median": flops / t / 1e12,
                                  "tflops_best": flops / t / 1e12, "library": "cublas", **clock})
    if "kernels" in probes:
        for op, eager, graph in (("add", 2.6e-6, 1.6e-6), ("gemv", 3.4e-6, 2.5e-6), ("reduce", 3.0e-6, 2.1e-6)):
            for mode, per in (("eager", eager), ("graph", graph)):
                w.append("kernels", {**_row("kernels", f"kernels_floor_{op}_{mode}", per * 256, rng), "kind": "floor",
                                     "op": op, "mode": mode, "count": 256})
        for b in (1, 4, 16, 64):
            for ctx in (16, 1024, 4096):
                nbytes = 2 * b * 8 * ctx * 128 * 2 + 2 * b * 32 * 128 * 2
                t = (K_ATTN["fixed"] + K_ATTN["seq"] * b + nbytes / (k["bw"] * k["eta_max"]) + k["graph"])
                w.append("kernels", {**_row("kernels", f"kernels_attn_decode_bf16_b{b}_l{ctx}", t, rng),
                                     "kind": "attn_decode", "batch": b, "context": ctx, "bytes": nbytes, "count": 1})
    return w.run_dir


K_ATTN = dict(fixed=4.8e-6, seq=0.06e-6)  # decode attention's floor and time per sequence (kernels probe)


def write_cpu_run(root, rng, *, dispatch_kind="torch_dispatch", clock_ratio=None):
    k = CPU
    w = RunWriter.create(root, sku="cpu", host="synthetic", probes=["stream", "l2", "launch", "peak", "gemm"],
                         argv=["synthetic"], device={"backend": "cpu", "name": "synthetic CPU",
                                                     "properties": {"num_cpus": 2, "llc_bytes": k["llc"]}})
    law = lambda nbytes: eff.eta_mem(nbytes / k["llc"], k["eta_max"], k["x_half"])  # noqa: E731
    # the plateau the fit uses as B: the triad headline (best) of the largest array
    for arr in (k["llc"] / 8, k["llc"], 4 * k["llc"], 16 * k["llc"]):
        nbytes = 3 * arr
        t = nbytes / (k["bw"] * law(nbytes))
        w.append("stream", {**_row("stream", f"stream_triad_fp64_{int(arr)}", t, rng), "kernel": "triad",
                            "dtype": "fp64", "array_bytes": arr, "bytes": nbytes,
                            "gbps_median": nbytes / t / 1e9, "gbps_best": nbytes / t / 1e9})
    ws = 64 * 1024.0
    while ws < 8 * k["llc"]:
        t = ws / (k["bw"] * law(ws) * (1 + 0.01 * rng.standard_normal()))
        w.append("l2", {**_row("l2", f"l2_cold_{int(ws)}", t, rng), "mode": "cold", "working_set_bytes": ws,
                        "bytes": ws, "passes": 1, **_gbps(ws, t)})
        ws *= 1.25
    kinds = [("omp_fork_join", 2e-6), ("py_ext_call", 0.3e-6)] + ([(dispatch_kind, k["dispatch"])] if dispatch_kind else [])
    for kind, per in kinds:
        w.append("launch", {**_row("launch", f"launch_{kind}_1000", per * 1000, rng), "kind": kind, "count": 1000,
                            "per_launch_s_median": per, "per_launch_s_min": per * 0.9})
    hw = HardwareSpec.from_sku("cpu")
    spec = hw.peak("fp32")
    f = clock_ratio or 1.0
    tf = spec * f * k["active"] / 1e12
    clock = {}
    if clock_ratio:  # the peak probe's dependent-add clock row, and the clock on the FMA row
        mhz = clock_ratio * hw.spec_clock_mhz
        w.append("peak", {**_row("peak", "peak_clock_int64", 1e-3, rng), "dtype": "int64", "unit": "dependent_add",
                          "clock_mhz_measured": mhz, "clock_mhz_median": mhz})
        clock = {"clock_mhz_measured": mhz, "spec_clock_mhz": hw.spec_clock_mhz}
    w.append("peak", {**_row("peak", "peak_fma_fp32", 1 / tf, rng), "dtype": "fp32", "unit": "vector_fma",
                      "tflops_median": tf, "tflops_best": tf, "spec_tflops": spec / 1e12, **clock})
    for m in (1, 16, 256, 1024):
        n = kk = 1024
        flops, nbytes = 2.0 * m * n * kk, 4.0 * (m * kk + kk * n + m * n)
        cl = eff.eta_cluster(m, n, kk, 2, eff.tile_shape("cpu"))
        t = max(flops / (spec * f * cl * k["active"] * k["duty"]), (nbytes + k["x_half"] * k["llc"]) / (k["bw"] * k["eta_max"]))
        w.append("gemm", {**_row("gemm", f"gemm_fp32_{m}", t, rng), "dtype": "fp32", "m": m, "n": n, "k": kk,
                          "flops": flops, "bytes": nbytes, "tflops_median": flops / t / 1e12,
                          "tflops_best": flops / t / 1e12, "library": "numpy-blas:openblas"})
    return w.run_dir


def test_fit_eta_mem_recovers_known_law():
    rng = np.random.default_rng(1)
    x = np.geomspace(1e-3, 10, 40)
    eta = eff.eta_mem(x, 0.8, 0.3) * (1 + 0.02 * rng.standard_normal(x.size))
    a, b, ea, eb, mape = fit_eta_mem(x, eta)
    assert a == pytest.approx(0.8, rel=0.03) and b == pytest.approx(0.3, rel=0.05)
    assert 0 < ea < 0.05 and 0 < eb < 0.05 and mape < 0.03
    with pytest.raises(ValueError, match=">= 3 distinct"):
        fit_eta_mem([1, 1, 1], [0.5, 0.5, 0.5])


def test_fit_gpu_run_recovers_every_parameter(tmp_path):
    run = write_gpu_run(tmp_path, np.random.default_rng(2))
    cal = fit_run(run)
    p = cal.params
    assert p["eta_max"].value == pytest.approx(H100["eta_max"], rel=0.03)
    assert p["x_half"].value == pytest.approx(H100["x_half"], rel=0.06)
    assert p["f_clk"].value == pytest.approx(H100["f_clk"])
    assert p["eta_active"].value == pytest.approx(H100["active"], rel=0.01)
    assert p["eta_duty"].value == pytest.approx(H100["duty"], rel=0.03)
    assert p["t_launch_s"].value == pytest.approx(H100["launch"])  # largest count, not the count-1 outlier
    assert p["t_graph_node_s"].value == pytest.approx(H100["graph"])
    for name in ("eta_max", "x_half", "f_clk", "eta_active", "eta_duty", "t_launch_s", "t_graph_node_s"):
        assert p[name].tier == "measured" and str(run) in p[name].source, name
        assert p[name].error is not None and p[name].error >= 0, name
    assert cal.hardware["num_sms"].value == 132 and cal.hardware["l2_bytes"].value == H100["l2_bytes"]
    assert cal.host_residual["s_floor_ms"].tier == "published"
    assert cal.meta["fit"]["gemm_identity_mape"] < 0.05
    assert cal.meta["fit"]["warnings"] == []


def test_fit_takes_decode_attentions_floor_and_per_sequence_time_from_the_kernels_probe(tmp_path):
    """From probes alone (no kernel tables): the attention floor and per-sequence time the step model
    charges, net of the bytes at the fitted streaming rate and one graph-node interval; the tiny
    kernels' floors go to the report beside the empty graph node."""
    run = write_gpu_run(tmp_path, np.random.default_rng(5), probes=("stream", "l2", "launch", "peak", "gemm", "kernels"))
    cal = fit_run(run)
    p = cal.params
    assert p["t_attn_fixed_s"].value == pytest.approx(K_ATTN["fixed"], rel=0.1)
    assert p["t_attn_seq_s"].value == pytest.approx(K_ATTN["seq"], rel=0.25)
    assert p["t_attn_fixed_s"].tier == "measured" and "kernels probe" in p["t_attn_fixed_s"].source
    floors = cal.meta["fit"]["kernel_floor_us"]
    assert floors["gemv graph"] == pytest.approx(2.5, rel=0.05) and floors["add eager"] == pytest.approx(2.6, rel=0.05)
    assert cal.meta["fit"]["kernel_floor_over_interval"]["add"] == pytest.approx(1.6e-6 / H100["graph"], rel=0.05)
    plain = fit_run(write_gpu_run(tmp_path / "plain", np.random.default_rng(5)))
    assert "t_attn_fixed_s" not in plain.params or plain.params["t_attn_fixed_s"].tier != "measured"


def test_fit_of_two_runs_takes_each_probe_from_the_run_that_measured_it(tmp_path, capsys):
    """A GPU session split over two machines of one kind (stream and l2 on one, the rest on the
    other) fits to the same calibration as one run holding every probe; a probe in two runs, or
    runs of two devices, is one line and exit 2."""
    from gpubench.cli import main

    memory = write_gpu_run(tmp_path / "a", np.random.default_rng(2), probes=("stream", "l2"))
    compute = write_gpu_run(tmp_path / "b", np.random.default_rng(2), probes=("launch", "peak", "gemm"))
    whole = fit_run(write_gpu_run(tmp_path / "c", np.random.default_rng(2)))
    split = fit_run([compute, memory])
    for name in ("eta_max", "x_half", "f_clk", "eta_active", "eta_duty", "t_launch_s", "t_graph_node_s"):
        assert split.params[name].tier == "measured", name
        assert split.params[name].value == pytest.approx(whole.params[name].value, rel=0.03), name
    assert split.meta["run_dirs"] == [str(compute), str(memory)]
    assert str(memory) in split.params["eta_max"].source and str(compute) in split.params["eta_max"].source
    assert "run_dirs" not in whole.meta
    cpu = write_cpu_run(tmp_path / "d", np.random.default_rng(3))
    other = tmp_path / "e"
    import shutil

    shutil.copytree(compute, other)  # the same probes in another run directory
    for runs, msg in (([compute, compute], "given twice"), ([compute, other], "probe 'gemm' has rows in both"),
                      ([compute, cpu], "must be of one device")):
        assert main(["fit", *map(str, runs), "-o", str(tmp_path / "x.json")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and msg in err and "Traceback" not in err, err
    assert not (tmp_path / "x.json").exists()


def test_calibrated_model_reproduces_measured_gemm(tmp_path):
    """The identity: eta_c * P with the fitted factors gives back a compute-bound GEMM's throughput."""
    cal = fit_run(write_gpu_run(tmp_path, np.random.default_rng(3)))
    path = tmp_path / "cal.json"
    cal.save(path)
    m = StepModel.for_names(sku="h100", model="llama-3.1-8b", calibration=path)
    p = m.predict([(8192, 0)])
    qkv = p.ops["qkv_proj"]
    spec = m.hardware.peak("bf16")
    cl = eff.eta_cluster(8192, 6144, 4096, 132, eff.tile_shape("hopper"))
    truth = 32 * 2.0 * 8192 * 6144 * 4096 / (spec * H100["f_clk"] * cl * H100["active"] * H100["duty"])
    assert qkv.t_c_s == pytest.approx(truth, rel=0.03)
    assert m.predict_time([(8192, 0)]) > StepModel.for_names(sku="h100", model="llama-3.1-8b").predict_time([(8192, 0)]) * 0.5


def test_fit_without_telemetry_or_probes_falls_back_by_tier(tmp_path):
    run = write_gpu_run(tmp_path, np.random.default_rng(4), with_clock=False, probes=("gemm",))
    cal = fit_run(run)
    assert cal.params["f_clk"].tier == "published" and cal.params["f_clk"].value == pytest.approx(1 - 0.302)
    assert cal.params["eta_max"].tier == "published" and cal.params["eta_max"].value == 0.90
    assert cal.params["eta_active"].tier == "spec" and cal.params["eta_active"].value == 1.0
    assert cal.params["t_launch_s"].tier == "assumed"  # no published launch figure for the H100
    assert cal.params["eta_duty"].tier == "measured"
    d = defaults(HardwareSpec.from_sku("l40s"), "bf16")
    assert d.params["t_launch_s"].tier == "published" and d.params["f_clk"].value == pytest.approx(1 - 0.427)


def test_fit_cpu_run(tmp_path):
    run = write_cpu_run(tmp_path, np.random.default_rng(5))
    cal = fit_run(run)
    assert cal.backend == "cpu" and cal.dtype == "fp32"
    # B is the measured plateau (what the largest triad delivers), so eta_max comes out ~1
    plateau = CPU["bw"] * eff.eta_mem(48.0, CPU["eta_max"], CPU["x_half"])  # triad of 16 LLC: x = 48
    assert cal.hardware["mem_bytes_per_s"].value == pytest.approx(plateau, rel=0.001)
    assert cal.hardware["mem_bytes_per_s"].tier == "measured"
    assert cal.params["eta_max"].value == pytest.approx(1.0, rel=0.02)
    assert cal.params["x_half"].value == pytest.approx(CPU["x_half"], rel=0.15)
    assert cal.params["t_dispatch_s"].value == pytest.approx(CPU["dispatch"])
    assert cal.params["eta_active"].value == pytest.approx(CPU["active"], rel=0.01)
    assert cal.params["eta_duty"].value == pytest.approx(CPU["duty"], rel=0.03)
    assert cal.params["f_clk"].tier == "spec"  # the synthetic CPU run has no clock telemetry
    assert cal.meta["fit"]["warnings"] == []
    m = StepModel.for_names(sku="cpu", model="smollm2-135m", calibration=cal)
    assert m.hardware.mem_bytes_per_s == pytest.approx(plateau, rel=0.001) and m.hardware.mem_bw_tier == "measured"
    assert hardware_from_run(run).mem_bytes_per_s == m.hardware.mem_bytes_per_s
    one = StepModel(HardwareSpec.from_sku("cpu").with_cores(1), "smollm2-135m", calibration=cal)
    assert one.hardware.num_sms == 1 and one.hardware.mem_bytes_per_s == m.hardware.mem_bytes_per_s
    # without torch_dispatch rows the per-call extension cost is the dispatch estimate
    cal2 = fit_run(write_cpu_run(tmp_path / "b", np.random.default_rng(6), dispatch_kind=None))
    assert cal2.params["t_dispatch_s"].value == pytest.approx(0.3e-6)


def test_fit_cpu_run_measured_clock(tmp_path):
    """A turbo CPU: the peak probe's clock sits 15 % above the spec clock; f_clk says so and the
    other factors come out as if the clock were known."""
    cal = fit_run(write_cpu_run(tmp_path, np.random.default_rng(9), clock_ratio=1.15))
    assert cal.params["f_clk"].value == pytest.approx(1.15) and cal.params["f_clk"].tier == "measured"
    assert cal.params["eta_active"].value == pytest.approx(CPU["active"], rel=0.01)
    assert cal.params["eta_duty"].value == pytest.approx(CPU["duty"], rel=0.03)


def test_busy_host_run_is_flagged_not_hidden(tmp_path):
    """A CPU run taken on a busy host: every small cold transfer costs ~20 ms (descheduled threads).
    The fit keeps the measured values and says what looks wrong."""
    k = dict(CPU)
    CPU["x_half"] = 3.0
    try:
        cal = fit_run(write_cpu_run(tmp_path, np.random.default_rng(10)))
    finally:
        CPU.update(k)
    assert cal.params["x_half"].value == pytest.approx(3.0, rel=0.1) and cal.params["x_half"].tier == "measured"
    assert any("charges every op" in w for w in cal.meta["fit"]["warnings"])


def test_roundtrip_and_errors(tmp_path):
    cal = fit_run(write_cpu_run(tmp_path, np.random.default_rng(7)))
    path = tmp_path / "c.json"
    cal.save(path)
    back = Calibration.load(path)
    assert back.to_dict() == json.loads(path.read_text())
    assert back.params == cal.params and back.hardware == cal.hardware
    bad = tmp_path / "bad.json"
    bad.write_text('{"sku": "cpu",\n "params": {"eta_max": {"valu": 1}}}')
    with pytest.raises(ConfigError, match="eta_max: expected a number or an object with 'value'"):
        Calibration.load(bad)
    bad.write_text('{"sku": "cpu", "params": {"eta_maxx": 0.9}}')
    with pytest.raises(ConfigError, match="unknown params entry 'eta_maxx' \\(did you mean: eta_max"):
        Calibration.load(bad)
    with pytest.raises(ConfigError, match="no such calibration file"):
        Calibration.load(tmp_path / "missing.json")
    with pytest.raises(ResultsFormatError):
        fit_run(tmp_path)


def _gpubench(*args):
    return subprocess.run([sys.executable, "-m", "gpubench", *args], capture_output=True, text=True, timeout=120)


def test_cli_fit_then_predict(tmp_path, capsys):
    run = write_gpu_run(tmp_path, np.random.default_rng(8))
    out = tmp_path / "cal.json"
    r = _gpubench("fit", str(run), "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert "eta_duty" in r.stdout and "measured" in r.stdout
    saved = json.loads(out.read_text())
    assert saved["params"]["eta_max"]["value"] == pytest.approx(H100["eta_max"], rel=0.03)
    assert saved["meta"]["command"][:2] == ["gpubench", "fit"]
    r = _gpubench("predict", "--sku", "h100", "--model", "llama-3.1-8b", "--batch", "32", "--context", "2048",
                  "--calibration", str(out), "--engine", "torch", "--json")
    assert r.returncode == 0, r.stderr
    pred = json.loads(r.stdout)
    m = StepModel.for_names(sku="h100", model="llama-3.1-8b", calibration=out)
    assert pred["total_s"] == pytest.approx(m.predict([(1, 2048)] * 32).total_s)
    assert pred["tiers"]["eta_duty"] == "measured"
    from gpubench.cli import main  # in-process from here on: subprocesses are slow on a shared host

    assert main(["predict", "--calibration", str(out), "--model", "llama-3.1-8b", "--batch", "32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["request"]["sku"] == "h100-sxm"  # the SKU comes from the calibration
    assert main(["predict", "--sku", "h100", "--phase", "mixed", "--batch", "8", "--breakdown"]) == 0
    text = capsys.readouterr().out
    assert "gate_up" in text and "host residual" in text
    assert main(["predict", "--sku", "a100", "--batch-json", "[[512, 1024], [1, 2048]]", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["request"]["batch"] == [[512, 1024], [1, 2048]]
    # the default engine is vLLM's: CUDA graphs and asynchronous scheduling
    vllm = StepModel.for_names(sku="a100", cuda_graphs=True)
    assert got["total_s"] == pytest.approx(vllm.predict_time([(512, 1024), (1, 2048)], async_scheduling=True))


def test_cli_errors_are_one_line(tmp_path, capsys):
    """Through the real entry point in-process (the subprocess path is covered above)."""
    from gpubench.cli import main

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 1000}))
    assert main(["predict", "--sku", "cpu", "--model", str(cfg), "--batch", "2", "--context", "16"]) == 0
    assert "fp32" in capsys.readouterr().out
    for args, msg in ((("predict", "--sku", "h1000"), "unknown SKU"), (("predict", "--model", "lama-3.1-8b"), "did you mean"),
                      (("predict", "--batch", "0"), "--batch must be >= 1"), (("fit", str(tmp_path)), "manifest.json"),
                      (("predict", "--calibration", str(tmp_path / "none.json")), "no such calibration file"),
                      (("predict", "--batch-json", "[[1, 2], [3]]"), "integer pairs"),
                      (("predict", "--batch-json", "[[0, 2]]"), "num_new_tokens >= 1")):
        assert main(list(args)) == 2, args
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and msg in err and "Traceback" not in err, err


# eta_duty by GEMM rows M (time per M monotone: 1/0.6 < 2/0.08 < 4/0.12 < 8/0.2 < 64/0.7)
DUTY_BY_M = {1: 0.6, 2: 0.08, 4: 0.12, 8: 0.2, 64: 0.7}
CURVE_SHAPES = ((1024, 1024), (2048, 512))  # (N, K); eta_cluster = 1 on 1, 2 or 8 cores for M <= 64


def write_cpu_gemm_curve_run(root, rng, duty_by_m=DUTY_BY_M):
    """A CPU run with only gemm rows, whose throughput is P * eta_cluster * duty(M) (f_clk = eta_active = 1)."""
    w = RunWriter.create(root, sku="cpu", host="synthetic", probes=["gemm"], argv=["synthetic"],
                         device={"backend": "cpu", "name": "synthetic CPU",
                                 "properties": {"num_cpus": 2, "llc_bytes": CPU["llc"]}})
    spec = HardwareSpec.from_sku("cpu").peak("fp32")
    for m, duty in duty_by_m.items():
        for n, kk in CURVE_SHAPES:
            flops, nbytes = 2.0 * m * n * kk, 4.0 * (m * kk + kk * n + m * n)
            cl = eff.eta_cluster(m, n, kk, 2, eff.tile_shape("cpu"))
            t = flops / (spec * cl * duty)
            w.append("gemm", {**_row("gemm", f"gemm_fp32_{m}_{n}_{kk}", t, rng), "dtype": "fp32", "m": m, "n": n,
                              "k": kk, "flops": flops, "bytes": nbytes, "tflops_median": flops / t / 1e12,
                              "tflops_best": flops / t / 1e12, "library": "numpy-blas:openblas"})
    return w.run_dir


def test_fit_duty_curve_reproduces_gemm_throughput_per_m(tmp_path):
    cal = fit_run(write_cpu_gemm_curve_run(tmp_path, np.random.default_rng(11)))
    assert cal.params["f_clk"].value == 1.0 and cal.params["eta_active"].value == 1.0
    c = cal.curve("eta_duty_by_m", "fp32")
    assert c is not None and c.tier == "measured" and "gemm rows" in c.source
    assert list(c.x) == [1.0, 2.0, 4.0, 8.0, 64.0]
    assert list(c.value) == pytest.approx(list(DUTY_BY_M.values()), rel=1e-9)
    assert list(c.raw) == pytest.approx(list(c.value), rel=1e-12)  # already monotone in time
    assert list(c.num_rows) == [2] * 5 and c.fit_error == pytest.approx(0.0, abs=1e-9)
    assert cal.meta["fit"]["gemm_curve_identity_mape"] == pytest.approx(0.0, abs=1e-9)
    # the identity: eta_c(M) * P reproduces every row's measured throughput
    from gpubench import results
    g = results.load(cal.meta["run_dir"]).frames["gemm"]
    hw = HardwareSpec.from_sku("cpu").replace(num_sms=2)
    at = eff.eta_duty_at(g.m, np.log2(c.x), np.log(c.value))
    eta_c = eff.eta_compute(1.0, eff.eta_cluster(g.m, g.n, g.k, 2, eff.tile_shape("cpu")), 1.0, 1.0) * at
    assert np.asarray(eta_c * hw.peak("fp32") / 1e12) == pytest.approx(g.tflops_median.to_numpy(), rel=1e-9)
    # the scalar eta_duty is still written (attention ops and older readers use it)
    assert cal.params["eta_duty"].tier == "measured"


def test_duty_curve_time_envelope_and_shape_pooling(tmp_path):
    # M = 4 -> 8 more than doubles the throughput: the M = 4 node is raised to 0.2 * 4 / 8 = 0.1
    run = write_cpu_gemm_curve_run(tmp_path, np.random.default_rng(12), duty_by_m={1: 0.5, 4: 0.05, 8: 0.2})
    c = fit_run(run).curve("eta_duty_by_m", "fp32")
    assert list(c.raw) == pytest.approx([0.5, 0.05, 0.2], rel=1e-9)
    assert list(c.value) == pytest.approx([0.5, 0.1, 0.2], rel=1e-9)
    assert "raised 1 of them" in c.source
    # the per-M node is the median over the (N, K) shapes measured at that M
    from predictor.calibrate_compute import fit_duty_curve
    out = fit_duty_curve([2, 2, 2, 16], [0.1, 0.3, 0.2, 0.9])
    assert out["x"] == [2.0, 16.0] and out["raw"] == pytest.approx([0.2, 0.9])
    assert out["num_rows"] == [3, 1] and out["error"][1] is None and out["error"][0] > 0
    with pytest.raises(ValueError):
        fit_duty_curve([1, 2], [0.0, float("nan")])


def test_duty_curve_roundtrip_old_files_and_errors(tmp_path):
    cal = fit_run(write_cpu_gemm_curve_run(tmp_path, np.random.default_rng(13)))
    path = tmp_path / "c.json"
    cal.save(path)
    back = Calibration.load(path)
    assert back.curve("eta_duty_by_m", "fp32") == cal.curve("eta_duty_by_m", "fp32")
    assert back.curve("eta_duty_by_m", "bf16") is None
    assert back.tiers()["eta_duty_by_m"] == "measured"
    # an older file (no "curves") loads and has no curve
    d = json.loads(path.read_text())
    del d["curves"]
    assert Calibration.from_dict(d).curves == {}
    bad = json.loads(path.read_text())
    bad["curves"]["eta_duty_by_n"] = bad["curves"].pop("eta_duty_by_m")
    with pytest.raises(ConfigError, match="unknown curves entry 'eta_duty_by_n'.*eta_duty_by_m"):
        Calibration.from_dict(bad)
    bad = json.loads(path.read_text())
    bad["curves"]["eta_duty_by_m"]["fp32"]["x"] = [1, 4, 2, 8, 64]
    with pytest.raises(ConfigError, match="strictly increasing"):
        Calibration.from_dict(bad)
    bad["curves"]["eta_duty_by_m"]["fp32"]["x"] = [1, 2, 4, 8]
    with pytest.raises(ConfigError, match="equal length"):
        Calibration.from_dict(bad)


def test_fit_says_what_a_quick_run_left_out(tmp_path, capsys):
    """`run --quick` skips vllm_ops (too slow for a quick minute); fit repeats what that leaves out."""
    from gpubench.cli import main

    run = write_cpu_run(tmp_path / "r", np.random.default_rng(5))
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["config"] = {**manifest.get("config", {}), "quick": True,
                          "quick_left_out": {"vllm_ops": "vLLM's own kernels and engine steps"}}
    (run / "manifest.json").write_text(json.dumps(manifest))
    assert main(["fit", str(run), "-o", str(tmp_path / "c.json")]) == 0
    err = capsys.readouterr().err
    assert "a --quick run left out vllm_ops (vLLM's own kernels and engine steps)" in err
    assert json.loads((tmp_path / "c.json").read_text())["meta"]["fit"]["quick_left_out"] == {
        "vllm_ops": "vLLM's own kernels and engine steps"}
