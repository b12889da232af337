"""CUDA backend without a GPU: the real no-device path, and rows + manifest of a CUDA run assembled
from recorded kernel outputs (the extension and NVML are stand-ins; everything else is real)."""
from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

from common import errors
from gpubench import results
from gpubench.backends.base import ProbeConfig
from gpubench.telemetry import Sampler
from gpubench.telemetry_nvml import clock_droop

_spec = importlib.util.spec_from_file_location("test_cuda_fakes", pathlib.Path(__file__).with_name("test_cuda_fakes.py"))
fakes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fakes)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _has_real_gpu() -> bool:
    try:
        from gpubench import _cuda

        return _cuda.device_count() > 0
    except Exception:  # noqa: BLE001
        return False


no_gpu = pytest.mark.skipif(_has_real_gpu(), reason="this machine has a GPU: the no-device path cannot be shown")


# ------------------------------------------------------------------ the formatter every message uses

def test_the_built_extension_formats_numbers_right_and_a_broken_one_stops_before_any_probe():
    """The real extension's nvcc-compiled formatter on fixed values (no device needed); a module
    that formats them wrongly is refused in one line when the backend loads it."""
    from gpubench import _cuda
    from gpubench.backends.cuda.extension import FORMAT_SELFTEST_EXPECTED, check_formatting

    assert _cuda.format_selftest() == FORMAT_SELFTEST_EXPECTED
    check_formatting(_cuda)

    class Broken:  # what the first H200 machine's build printed: integers as nothing
        @staticmethod
        def format_selftest():
            return FORMAT_SELFTEST_EXPECTED.replace("-42", "")

    with pytest.raises(RuntimeError, match="formats numbers wrongly") as err:
        check_formatting(Broken)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------ the real no-device path

@no_gpu
def test_import_works_and_first_call_raises_no_device_error():
    from gpubench.backends import cuda  # importing needs no GPU

    with pytest.raises(errors.NoDeviceError) as ei:
        cuda.CudaBackend(0)
    msg = str(ei.value)
    assert "cuda:0" in msg and "no usable CUDA device" in msg
    assert "\n" not in msg


@no_gpu
def test_extension_functions_raise_the_extension_no_device_error():
    from gpubench import _cuda

    for call in (lambda: _cuda.stream(0, 1024), lambda: _cuda.l2(0, 65536, "warm", 4),
                 lambda: _cuda.launch(0, "device_interval", 16), lambda: _cuda.peak(0, "bf16")):
        with pytest.raises(_cuda.NoDeviceError, match="no usable CUDA device"):
            call()


@no_gpu
def test_get_backend_cuda_raises_and_auto_falls_back():
    from gpubench.backends import get_backend

    with pytest.raises(errors.NoDeviceError):
        get_backend("cuda:0")
    try:
        backend, line = get_backend("auto")
    except ImportError:
        pytest.skip("the CPU backend is not importable yet")
    assert backend.name == "cpu" and "no usable GPU" in line


@no_gpu
def test_cli_run_on_cuda_exits_2_with_one_line(tmp_path):
    from gpubench.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    if "run" not in sub.choices:
        pytest.skip("`gpubench run` is not registered yet")
    p = subprocess.run([sys.executable, "-m", "gpubench", "run", "--device", "cuda:0", "--quick", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 2, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "no usable CUDA device" in lines[0] and "Traceback" not in p.stderr
    assert not any(tmp_path.iterdir())  # nothing written for a run that could not start


# ------------------------------------------------------------------ errors and properties (stand-in)

def test_device_memory_error_is_mapped_to_a_user_error():
    from gpubench.backends.cuda import CudaBackend

    b = CudaBackend(0, ext=fakes.FakeCudaExt(free_bytes=2**20), nvml=fakes.fake_pynvml())
    spec = next(s for s in b.probes()["stream"].plan(ProbeConfig(device={"properties": {"l2_bytes": 2**22}})))
    with pytest.raises(errors.DeviceMemoryError, match=r"cuda:0: stream needs \d+ bytes .* only 1048576"):
        b.probes()["stream"].measure(spec)


def test_missing_device_index_is_a_clear_error():
    from gpubench.backends.cuda import CudaBackend

    with pytest.raises(errors.NoDeviceError, match=r"cuda:3 does not exist \(this machine has 1 CUDA device"):
        CudaBackend(3, ext=fakes.FakeCudaExt())


def test_device_info_is_read_from_the_device_and_the_sku_detected():
    from gpubench.backends.cuda import CudaBackend

    b = CudaBackend(0, ext=fakes.FakeCudaExt(), nvml=fakes.fake_pynvml())
    info = b.device_info()
    assert info["backend"] == "cuda" and info["name"] == "NVIDIA H100 80GB HBM3" and info["index"] == 0
    assert info["driver"] == "580.65.06" and info["cuda_runtime"] == "13.0"
    props = info["properties"]
    assert props["sm_count"] == 132 and isinstance(props["sm_count"], int)
    assert props["l2_bytes"] == fakes.FakeCudaExt.L2_BYTES
    assert b.default_sku() == "h100-sxm" and info["sku_detected"] == "h100-sxm"
    unknown = CudaBackend(0, ext=fakes.FakeCudaExt(name="NVIDIA Imaginary X9"), nvml=fakes.fake_pynvml())
    assert unknown.sku is None and unknown.default_sku() == "cuda-nvidia-imaginary-x9"
    # Without NVML the manifest still says which CUDA version the driver supports.
    no_nvml = CudaBackend(0, ext=fakes.FakeCudaExt(), nvml=fakes.fake_pynvml(fail_init="no driver"))
    assert "CUDA 13.0" in no_nvml.device_info()["driver"]


# ------------------------------------------------------------------ plans

def _cfg(backend, quick=True, **options):
    return ProbeConfig(quick=quick, num_reps=10, device=backend.device_info(), options=options)


def test_plans_follow_the_device_l2_and_free_memory():
    from gpubench.backends.cuda import CudaBackend

    ext = fakes.FakeCudaExt()
    b = CudaBackend(0, ext=ext, nvml=fakes.fake_pynvml())
    l2 = ext.L2_BYTES
    stream = b.probes()["stream"].plan(_cfg(b, quick=False))
    sizes = [s.params["n_elements"] * 8 for s in stream]
    assert sizes[0] == pytest.approx(l2 / 8, rel=0.01) and sizes[-1] >= 4 * l2 * 0.99
    assert all(len(s.row_keys) == 4 for s in stream)
    l2specs = b.probes()["l2"].plan(_cfg(b, quick=False))
    ws = sorted({s.params["bytes"] for s in l2specs})
    assert ws[0] == 64 * 1024 and ws[-1] == 8 * l2
    assert all(1.2 < hi / lo < 1.3 for lo, hi in zip(ws[:-2], ws[1:-1]))
    assert {s.params["mode"] for s in l2specs} == {"cold", "warm"}
    assert all(s.params["passes"] == 1 for s in l2specs if s.params["mode"] == "cold")
    # Little free memory bounds the largest stream array and says so.
    small = CudaBackend(0, ext=fakes.FakeCudaExt(free_bytes=300 * 2**20), nvml=fakes.fake_pynvml())
    probe = small.probes()["stream"]
    top = probe.plan(_cfg(small))[-1].params["n_elements"] * 8
    assert 3 * top <= 150 * 2**20 and probe.notes(_cfg(small))


def test_peak_plan_leaves_out_fp8_before_sm89_with_a_note():
    from gpubench.backends.cuda import CudaBackend

    a100 = CudaBackend(0, ext=fakes.FakeCudaExt(name="NVIDIA A100-SXM4-80GB", cc=(8, 0)), nvml=fakes.fake_pynvml())
    probe = a100.probes()["peak"]
    assert [s.params["dtype"] for s in probe.plan(_cfg(a100))] == ["bf16", "fp16", "tf32", "fp32"]
    assert any("fp8" in n and "8.9" in n for n in probe.notes(_cfg(a100)))
    h100 = CudaBackend(0, ext=fakes.FakeCudaExt(), nvml=fakes.fake_pynvml())
    keys = [s.key for s in h100.probes()["peak"].plan(_cfg(h100))]
    # fp8 mma.sync is emulated on Hopper (fp16 HMMA + FADD): left out, with the reason
    # wgmma only on 9.0, and last; fp8 through wgmma e4m3, its only native path there
    assert "peak_mma_fp8" not in keys and keys[-2:] == ["peak_wgmma_bf16", "peak_wgmma_fp8"]
    assert any("fp8" in n and "emulated" in n and "wgmma e4m3 instead" in n
               for n in h100.probes()["peak"].notes(_cfg(h100)))
    assert "peak_wgmma_bf16" not in [s.key for s in probe.plan(_cfg(a100))]
    for name, cc, native in (("NVIDIA L40S", (8, 9), True), ("NVIDIA GeForce RTX 5090", (12, 0), True),
                             ("NVIDIA B200", (10, 0), False)):
        b = CudaBackend(0, ext=fakes.FakeCudaExt(name=name, cc=cc), nvml=fakes.fake_pynvml())
        assert ("peak_mma_fp8" in [s.key for s in b.probes()["peak"].plan(_cfg(b))]) == native, name


def test_probes_run_in_the_order_that_keeps_headline_figures_when_cut_short():
    from gpubench.backends.cuda import CudaBackend

    b = CudaBackend(0, ext=fakes.FakeCudaExt(), nvml=fakes.fake_pynvml())
    assert list(b.probes()) == ["stream", "peak", "launch", "gemm", "kernels", "l2"]  # the long l2 sweep last


def test_peak_dtype_missing_from_the_build_is_skipped_not_failed(capsys):
    """An sm_89 device running a build without sm_89 code: the extension reports fp8 unsupported."""
    probe_worker = pytest.importorskip("gpubench.probe_worker")
    from gpubench.backends.cuda import CudaBackend

    class OldBuild(fakes.FakeCudaExt):
        def peak(self, device, dtype, num_reps=10, num_warmup=2, target_s=0.02):
            if dtype == "fp8":
                return {"times_s": [], "valid": False, "supported": 0.0,
                        "check": "skipped: fp8 mma is not in this build's code for this device"}
            return super().peak(device, dtype, num_reps, num_warmup, target_s)

    b = CudaBackend(0, ext=OldBuild(name="NVIDIA L40S", cc=(8, 9)), nvml=fakes.fake_pynvml())
    probe = b.probes()["peak"]
    spec = next(s for s in probe.plan(_cfg(b)) if s.params["dtype"] == "fp8")
    fields = probe.measure(spec)
    assert fields == [] and probe_worker.build_rows(probe, "cuda", spec, fields, {}) == []
    assert "peak fp8 mma.sync: skipped: fp8 mma is not in this build" in capsys.readouterr().err


def test_gemm_plan_without_any_library_keeps_every_shape_and_the_droop_rows():
    from gpubench.backends.cuda import CudaBackend, GemmProbe, gemm_library

    lib, reason = gemm_library()
    if lib is not None:
        pytest.skip("torch has CUDA, or CuPy sees a device, here")
    b = CudaBackend(0, ext=fakes.FakeCudaExt(), nvml=fakes.fake_pynvml())
    ok, why = GemmProbe(b).supported(b)
    assert not ok and why.startswith("no CUDA torch") and "cuBLAS" in why
    specs = GemmProbe(b).plan(_cfg(b))
    droop = [s for s in specs if s.params["dtype"] == "bf16" and s.params["m"] == 16384]
    assert len(droop) == 5 and all(s.params["budget_s"] >= 1.0 for s in droop)
    assert len({s.key for s in specs}) == len(specs)


# ------------------------------------------------------------------ which GEMM library a run takes

def _gemm_rows(probe, backend, specs):
    """Rows as the runner writes them (derived TFLOP/s included) for the given specs."""
    probe_worker = pytest.importorskip("gpubench.probe_worker")
    return [row for spec in specs for row in probe_worker.build_rows(probe, backend.name, spec, probe.measure(spec), {})]


def test_gemm_takes_torch_when_torch_has_cuda(monkeypatch):
    from gpubench.backends.cuda import CudaBackend, GemmProbe, gemm_library
    from gpubench.backends.cuda.probes import gemm

    monkeypatch.setitem(sys.modules, "torch", fakes.fake_torch(cuda_available=True, version="2.13.0+cu128"))
    # A CuPy that would also work: torch must still win, and CuPy must not be used for any row.
    cupy = fakes.fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    assert gemm_library() == ("torch-cublas", "")
    calls = []

    def recorded_torch_gemm(index, dtype, m, n, k, **timing):
        calls.append((dtype, m, n, k, timing["l2_bytes"]))
        return {"times_s": [1e-3] * 10, "valid": True, "check": "ok", "max_abs_err": 0.0, "tol": 1.0,
                "num_weight_copies": 2, "bytes": 2 * (m * k + k * n + m * n), "library": gemm.TORCH_LIBRARY,
                "library_version": "torch 2.13.0+cu128", "timing": "event pair per call"}

    monkeypatch.setattr(gemm, "torch_gemm", recorded_torch_gemm)
    b = CudaBackend(0, ext=fakes.FakeCudaExt(), nvml=fakes.fake_pynvml())
    probe = GemmProbe(b)
    assert probe.supported(b) == (True, "") and probe.notes(_cfg(b)) == []
    specs = probe.plan(_cfg(b, **{"gemm.shape_scale": 1 / 64, "gemm.max_m": 16, "gemm.budget_s": 0.0}))
    assert {s.params["dtype"] for s in specs} == {"bf16", "fp16", "tf32"}
    rows = _gemm_rows(probe, b, specs[:2])
    assert [r["library"] for r in rows] == ["torch-cublas"] * 2 and rows[0]["library_version"] == "torch 2.13.0+cu128"
    assert len(calls) == 2 and calls[0][-1] == fakes.FakeCudaExt.L2_BYTES
    assert "matmul" not in cupy.log


def test_gemm_takes_cupy_when_torch_has_no_cuda_and_counts_and_checks_the_same(monkeypatch):
    from gpubench.backends.cuda import CudaBackend, GemmProbe, gemm_library

    monkeypatch.setitem(sys.modules, "torch", fakes.fake_torch(cuda_available=False))
    cupy = fakes.fake_cupy(tflops=400.0)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setenv("CUPY_TF32", "1")
    assert gemm_library() == ("cupy-cublas", "")
    b = CudaBackend(0, ext=fakes.FakeCudaExt(), nvml=fakes.fake_pynvml())
    probe = GemmProbe(b)
    assert probe.supported(b) == (True, "")
    # 1 ms budget: 200 calls of ~5 us, i.e. 7 graph replays of 32 calls (the first 2 are warm-up).
    cfg = _cfg(b, **{"gemm.shape_scale": 1 / 64, "gemm.max_m": 16, "gemm.budget_s": 0.001})
    specs = probe.plan(cfg)
    # CuPy has no bfloat16: those rows (and the droop rows) are left out, and the manifest says so.
    assert {s.params["dtype"] for s in specs} == {"fp16", "tf32"}
    assert any("bf16 left out" in n and "bfloat16" in n for n in probe.notes(cfg))
    specs = [s for s in specs if s.params["shape"] in ("gate_up", "square")]
    rows = _gemm_rows(probe, b, specs)
    assert rows and len(rows) == len(specs)
    for row, spec in zip(rows, specs):
        p = spec.params
        elem = 2 if p["dtype"] == "fp16" else 4
        assert row["library"] == "cupy-cublas" and row["library_version"] == "cupy 13.6.0"
        assert row["flops"] == 2 * p["m"] * p["n"] * p["k"]
        assert row["bytes"] == (p["m"] * p["k"] + p["k"] * p["n"] + p["m"] * p["n"]) * elem
        assert row["valid"], row["check"]
        assert row["max_abs_err"] <= row["tol"] and "rows of C vs a float64 product" in row["check"]
        # B rotates among copies covering 2x L2 (at most 8), as on the torch path.
        assert row["num_weight_copies"] == min(8, -(-2 * fakes.FakeCudaExt.L2_BYTES // (p["k"] * p["n"] * elem)))
        # 5 us per call: under the 50 us threshold, so timed inside one captured graph of 32 calls.
        assert row["timing"] == "one CUDA-graph replay of 32 calls"
        assert len(row["times_s"]) == 5 and row["times_s"][0] == pytest.approx(5e-6 + row["flops"] / 400e12)
        assert row["tflops_best"] == pytest.approx(row["flops"] / row["t_min_s"] / 1e12)
    assert any(entry.startswith("graph launch 32") for entry in cupy.log)


def test_cupy_gemm_over_50_us_is_timed_call_by_call_behind_the_spin(monkeypatch):
    from gpubench.backends.cuda import cupy_gemm

    cupy = fakes.fake_cupy(call_s=100e-6)
    r = cupy_gemm(cupy, 0, "fp16", 16, 64, 128, num_reps=10, budget_s=0.002, l2_bytes=2**20, clock_khz=1.5e6)
    assert r["timing"] == "event pair per call" and r["valid"]
    assert len(r["times_s"]) == 20  # the budget (2 ms / ~0.1 ms) beats the 10 repetitions
    assert all(t == pytest.approx(100e-6 + 2 * 16 * 64 * 128 / 400e12) for t in r["times_s"])
    assert any(entry.startswith("spin ") for entry in cupy.log)


def test_cupy_gemm_with_a_wrong_product_is_invalid():
    from gpubench.backends.cuda import cupy_gemm

    r = cupy_gemm(fakes.fake_cupy(wrong_product=True), 0, "fp16", 16, 64, 128, num_reps=10, budget_s=0.0,
                  l2_bytes=0, clock_khz=1.5e6)
    assert not r["valid"] and "> tol" in r["check"] and r["num_weight_copies"] == 1


def test_cupy_path_leaves_out_tf32_when_cupy_was_imported_without_it(monkeypatch):
    from gpubench.backends.cuda import CudaBackend, GemmProbe

    monkeypatch.setitem(sys.modules, "torch", fakes.fake_torch(cuda_available=False))
    monkeypatch.setitem(sys.modules, "cupy", fakes.fake_cupy())
    monkeypatch.delenv("CUPY_TF32", raising=False)
    b = CudaBackend(0, ext=fakes.FakeCudaExt(), nvml=fakes.fake_pynvml())
    probe = GemmProbe(b)
    assert {s.params["dtype"] for s in probe.plan(_cfg(b))} == {"fp16"}
    assert any("tf32 left out" in n and "CUPY_TF32" in n for n in probe.notes(_cfg(b)))


@pytest.mark.parametrize("cupy_state,reason", [
    ("missing", "no usable CuPy (not importable"), ("no device", "cupy 13.6.0 sees no CUDA device")])
def test_gemm_without_cuda_torch_or_usable_cupy_is_skipped_with_one_reason(monkeypatch, cupy_state, reason):
    from gpubench.backends.cuda import CudaBackend, GemmProbe

    monkeypatch.setitem(sys.modules, "torch", fakes.fake_torch(cuda_available=False))
    # None in sys.modules makes `import cupy` raise ImportError, as when it is not installed.
    monkeypatch.setitem(sys.modules, "cupy", None if cupy_state == "missing" else fakes.fake_cupy(available=False))
    b = CudaBackend(0, ext=fakes.FakeCudaExt(), nvml=fakes.fake_pynvml())
    ok, why = GemmProbe(b).supported(b)
    assert not ok and "\n" not in why
    assert why.startswith("no CUDA torch (torch 2.13.0+cpu is a CPU-only build)") and reason in why
    assert why.endswith("cuBLAS is not linked in gpubench._cuda")


# ------------------------------------------------------------------ rows + manifest of a CUDA run

def test_cuda_run_rows_and_manifest_from_recorded_outputs(tmp_path):
    probe_worker = pytest.importorskip("gpubench.probe_worker")
    from gpubench.backends.cuda import CudaBackend, LaunchProbe

    ext, nv = fakes.FakeCudaExt(), fakes.fake_pynvml()
    b = CudaBackend(0, ext=ext, nvml=nv)
    probes = ["stream", "l2", "launch", "peak"]
    w = results.RunWriter.create(tmp_path, sku=b.default_sku(), host="testhost", device=b.device_info(), probes=probes,
                                 argv=["gpubench", "run", "--device", "cuda:0", "--quick"],
                                 extra={"telemetry": b.telemetry_source().describe()})
    cfg = _cfg(b)
    for name in probes:
        probe = b.probes()[name]
        specs = probe.plan(cfg)
        source = b.telemetry_source()
        for spec in specs:
            with Sampler(source, hz=0) as s:
                fields = probe.measure(spec)
            for row in probe_worker.build_rows(probe, b.name, spec, fields, s.aggregate()):
                w.append(name, row)
        source.close()
        w.set_probe_status(name, "done")

    run = results.load(w.run_dir)
    assert run.backend == "cuda" and run.sku == "h100-sxm"
    assert run.manifest["device"]["properties"]["l2_bytes"] == ext.L2_BYTES
    assert "POWER_INSTANT" in run.manifest["telemetry"]["power_source"]

    st = run["stream"]
    assert set(st["kernel"]) == {"copy", "scale", "add", "triad"}
    assert (st["timer"] == "cuda_events").all() and st["valid"].all()
    triad = st[st.kernel == "triad"].sort_values("n_elements").iloc[-1]
    assert triad["bytes"] == 3 * triad["n_elements"] * 8
    assert triad["gbps_best"] == pytest.approx(ext.DRAM_BYTES_PER_S / 1e9, rel=1e-6)  # min time of the fake
    assert triad["spec_gbps"] == 3350
    assert triad["times_s"][0] > triad["t_median_s"]  # the first rep is kept raw, dropped from the stats
    assert triad["clock_mhz_mean"] is not None and triad["throttle_bits"] is not None

    l2 = run["l2"]
    assert set(l2["mode"]) == {"cold", "warm"}
    warm = l2[l2["mode"] == "warm"].iloc[0]
    assert warm["bytes"] == warm["passes"] * warm["working_set_bytes"] and warm["passes"] > 1

    la = run["launch"]
    assert set(la["timer"]) == {"host_clock", "cuda_events"}
    row = la[(la.kind == "graph_node") & (la["count"] == 4096)].iloc[0]
    assert row["per_launch_s_median"] == pytest.approx(0.6e-6, rel=0.02)
    assert row["per_launch_us_median"] == pytest.approx(row["per_launch_s_median"] * 1e6)

    pk = run["peak"]
    bf16 = pk[pk.dtype == "bf16"].iloc[0]
    assert bf16["unit"] == "tensor_core" and bf16["tflops_median"] == pytest.approx(660.0, rel=0.02)
    assert bf16["spec_tflops"] == pytest.approx(989.4, rel=1e-3)
    assert bf16["pct_of_spec"] == pytest.approx(100 * bf16["tflops_best"] / bf16["spec_tflops"])
    assert bf16["spec_formula"] == "132 SM x 4 TC x 512 FMA/clk x 2 x 1830 MHz"
    assert pk[pk.dtype == "fp32"].iloc[0]["unit"] == "cuda_core"
    wg = pk[pk["instruction"] == "wgmma"].set_index("dtype")
    assert wg.loc["bf16", "key"] == "peak_wgmma_bf16" and wg.loc["bf16", "tflops_median"] == pytest.approx(900 / 1.01)
    assert wg.loc["fp8", "key"] == "peak_wgmma_fp8" and wg.loc["fp8", "tflops_median"] == pytest.approx(1700 / 1.01)

    # Every row carries the common fields of docs/results-schema.md.
    for frame in run.frames.values():
        for col in ("key", "probe", "backend", "times_s", "n_reps", "t_min_s", "t_median_s", "cv", "valid", "timer",
                    "clock_mhz_mean", "clock_max_ref_mhz", "low_clock_frac", "power_w_mean", "telemetry_samples"):
            assert col in frame.columns, col
        assert frame["key"].is_unique
    json.loads((w.run_dir / "manifest.json").read_text())

    # The device-check table (scripts/device_check.sh), with gemm rows shaped like the gemm probe's.
    from gpubench.backends.cuda import check_table, format_table

    for i, (n, k) in enumerate([(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (8192, 8192)]):
        w.append("gemm", {"key": f"gemm_{i}", "probe": "gemm", "dtype": "bf16", "m": 16384, "n": n, "k": k,
                          "valid": True, "tflops_median": 600.0 + i, "spec_tflops": 989.4, "clock_mhz_mean": 1400.0 + 10 * i,
                          "clock_max_ref_mhz": 1980.0, "throttle_bits": 0x4 if i else 0x0})
    table = {a: (b, c, d) for a, b, c, d in check_table(results.load(w.run_dir))}
    top_mib = ext.L2_BYTES * 4 / 2**20
    assert table[f"stream triad {top_mib:.0f} MiB"][:2] == ("3000 GB/s", " 89.6 %")  # 3000 of 3350
    assert table["peak bf16 mma.sync"][1] == f"{100 * 660 / 1.01 / 989.4:5.1f} %"  # median rep is 1.01x
    assert "of spec x f_clk" in table["peak bf16 mma.sync"][2]
    assert table["launch graph_node (x4096)"][0] == "0.61 us" and "p20-p80" in table["launch graph_node (x4096)"][2]
    assert table["gemm bf16 best 16384x8192x8192"][0] == "604.0 TF/s"
    assert table["clock droop (bf16 GEMM, M=16384)"][0] == f"{100 * (1 - 1420 / 1980):.1f} %"
    assert table["clock-event reasons during gemm"][2] == "sw_power_cap"
    assert "figure" in format_table(check_table(results.load(w.run_dir))).splitlines()[0]

    # `gpubench show`'s summary reads the bandwidth and launch rows of a CUDA run, and its droop.
    from gpubench import report

    tel = report.summarize_run(results.load(w.run_dir)).telemetry
    assert tel["droop"] == pytest.approx(1 - 1420 / 1980) and "over 5 GEMM rows" in tel["droop_detail"]

    for probe in ("peak", "gemm"):  # the CPU-specific peak and gemm headlines are not part of this check
        (w.run_dir / f"{probe}.jsonl").unlink()
    heads = report.summarize_run(results.load(w.run_dir)).headlines
    triad_head = next(h for h in heads if h.probe == "stream" and h.label.startswith("triad"))
    assert triad_head.value == pytest.approx(ext.DRAM_BYTES_PER_S / 1e9, rel=1e-6)
    assert {h.label.split(" ")[0] for h in heads if h.probe == "launch"} == set(LaunchProbe.COUNTS)


def test_failed_golden_check_makes_all_four_stream_rows_invalid():
    from gpubench.backends.cuda import CudaBackend

    b = CudaBackend(0, ext=fakes.FakeCudaExt(corrupt=True), nvml=fakes.fake_pynvml())
    probe = b.probes()["stream"]
    rows = probe.measure(probe.plan(_cfg(b))[0])
    assert len(rows) == 4 and not any(r["valid"] for r in rows)
    assert all("17 of N off" in r["invalid_reason"] for r in rows)


def test_droop_from_gemm_rows_with_nvml_clocks():
    """clock_droop over rows shaped like the gemm probe's (the gemm itself needs a CUDA torch)."""
    rows = [{"probe": "gemm", "dtype": "bf16", "m": 16384, "n": n, "k": k, "valid": True,
             "clock_mhz_mean": c, "clock_max_ref_mhz": 1980.0}
            for (n, k), c in zip([(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (8192, 8192)],
                                 (1400.0, 1450.0, 1380.0, 1420.0, 1400.0))]
    d = clock_droop(rows)
    assert d.num_rows == 5 and d.droop == pytest.approx(1 - 1410.0 / 1980.0)


# ------------------------------------------------------------------ on a GPU

@pytest.mark.gpu
def test_gpu_selfchecks():
    """Real kernels on a real device: every probe's own check passes on small sizes."""
    if not _has_real_gpu():
        pytest.skip("no CUDA device")
    from gpubench import _cuda
    from gpubench.backends.cuda import fp8_mma_native

    assert _cuda.selfcheck_fill(0)
    props = _cuda.device_properties(0)
    s = _cuda.stream(0, 1 << 22, 5, 1)
    assert all(s[k]["valid"] and len(s[k]["times_s"]) == 5 for k in ("copy", "scale", "add", "triad")), s
    assert min(s["triad"]["times_s"]) > 0
    for mode, passes in (("cold", 1), ("warm", 8)):
        r = _cuda.l2(0, 1 << 20, mode, passes, 5, 1)
        assert r["valid"], r["check"]
    for kind in ("host_enqueue", "device_interval", "launch_sync", "graph_node"):
        r = _cuda.launch(0, kind, 16, 5, 1)
        assert r["valid"] and min(r["times_s"]) > 0, (kind, r)
    cc = int(props["cc_major"]) * 10 + int(props["cc_minor"])
    for dtype in ("bf16", "fp16", "tf32", "fp8", "fp32"):
        r = _cuda.peak(0, dtype, 3, 1, 0.005)
        if dtype == "fp8" and not fp8_mma_native(cc):
            assert r["supported"] == 0, r  # absent before 8.9, emulated on 9.0 and 10.x
            continue
        assert r["valid"], (dtype, r["check"])
    for dtype in ("bf16", "fp8"):
        w = _cuda.peak_wgmma(0, 3, 1, 0.005, dtype=dtype)
        if cc == 90 and w["supported"]:
            assert w["valid"], (dtype, w["check"])
    with pytest.raises(_cuda.DeviceMemoryError, match="bytes"):
        _cuda.stream(0, int(props["total_mem_bytes"]), 2, 0)


# ------------------------------------------------------------------ GEMM validation (real torch, CPU)

@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_gemm_check_accepts_a_real_low_precision_product_and_rejects_wrong_ones(dtype):
    """The tolerance passes what a real fp32-accumulating low-precision GEMM produces, and fails a
    transposed operand or a single corrupted entry (torch on the CPU stands in for cuBLAS)."""
    torch = pytest.importorskip("torch")
    from gpubench.backends.cuda import check_gemm, gemm_tolerance

    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    g = torch.Generator().manual_seed(0)
    m, n, k = 128, 192, 4096
    a = (torch.rand(m, k, generator=g) * 2 - 1).to(tdt)
    b = (torch.rand(k, n, generator=g) * 2 - 1).to(tdt)
    c = (a.float() @ b.float()).to(tdt)  # fp32 accumulate, rounded to the output dtype
    good = check_gemm(a, b, c, dtype)
    assert good["valid"], good["check"]
    assert 0 < good["max_abs_err"] < good["tol"] == gemm_tolerance(dtype, k)
    b2 = (torch.rand(n, k, generator=g) * 2 - 1).to(tdt).t()  # a different weight: a wrong GEMM
    wrong = check_gemm(a, b, (a.float() @ b2.float()).to(tdt), dtype)
    assert not wrong["valid"] and "> tol" in wrong["check"]
    bad = c.clone()
    bad[0, 5] += 4 * good["tol"]  # row 0 is always among the checked rows
    assert not check_gemm(a, b, bad, dtype)["valid"]
    nan = c.clone()
    nan[m - 1, 0] = float("nan")
    assert not check_gemm(a, b, nan, dtype)["valid"]


@pytest.mark.gpu
def test_gpu_torch_gemm_is_validated():
    """cuBLAS through a CUDA torch: small shapes, every dtype, checked against float64."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA torch")
    from gpubench.backends.cuda import torch_gemm

    for dtype in ("bf16", "fp16", "tf32"):
        r = torch_gemm(0, dtype, 256, 512, 1024, num_reps=5, budget_s=0.01, l2_bytes=50 * 2**20, clock_khz=1.5e6)
        assert r["valid"], r["check"]
        assert len(r["times_s"]) >= 5 and min(r["times_s"]) > 0
        assert r["num_weight_copies"] >= 1 and r["layout"] == "TN"


def test_the_gemm_check_reads_an_engines_product_through_the_weights_transposed_view():
    """The probe stores weights as nn.Linear does ([N, K]) and multiplies by their transposed views,
    the call F.linear makes; the float64 check takes the same view (torch on the CPU stands in)."""
    torch = pytest.importorskip("torch")
    from gpubench.backends.cuda import check_gemm

    g = torch.Generator().manual_seed(0)
    a = (torch.rand(64, 512, generator=g) * 2 - 1).to(torch.bfloat16)
    w = (torch.rand(96, 512, generator=g) * 2 - 1).to(torch.bfloat16)
    c = torch.nn.functional.linear(a, w)
    assert check_gemm(a, w.t(), c, "bf16")["valid"]
    assert not check_gemm(a, w.flip(0).t(), c, "bf16")["valid"]  # another weight order: wrong


def test_quick_l2_sweep_reads_a_bounded_number_of_bytes():
    """--quick caps the L2 sweep (4x L2, 512 MiB per warm repetition): the full settings read
    ~780 GB on an H200, 100-150 s of a short device window."""
    from gpubench.backends.cuda import NUM_WARMUP, CudaBackend

    b = CudaBackend(0, ext=fakes.FakeCudaExt(), nvml=fakes.fake_pynvml())
    probe = b.probes()["l2"]

    def total_bytes(quick):
        return sum(s.params["bytes"] * s.params["passes"] * (s.params["num_reps"] + NUM_WARMUP)
                   for s in probe.plan(_cfg(b, quick=quick)))

    assert total_bytes(True) <= 100e9 < total_bytes(False)
    assert max(s.params["bytes"] for s in probe.plan(_cfg(b, quick=True))) <= 4 * fakes.FakeCudaExt.L2_BYTES


def test_short_gemms_are_timed_inside_one_cuda_graph_replay():
    """Calls under 50 us are timed as replays of one captured graph of 32 calls (torch's CUDA API
    stood in for: there is no GPU here); a failed capture falls back to an event pair per call."""
    from gpubench.backends.cuda.probes import gemm

    log = []

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self, stream):
            log.append("record")
            self.t = len([x for x in log if x == "replay"])

        def elapsed_time(self, other):  # ms: 0.32 ms per replay -> 10 us per call
            return (other.t - self.t) * 0.32

    class Graph:
        def replay(self):
            log.append("replay")

    class Ctx:
        def __init__(self, *a):
            pass

        def __enter__(self):
            log.append("capture")

        def __exit__(self, *a):
            return False

    class Stream:
        def wait_stream(self, other):
            pass

        def synchronize(self):
            pass

    fake_cuda = type("cuda", (), {"CUDAGraph": Graph, "Event": Event, "Stream": Stream, "stream": Ctx, "graph": Ctx})

    class FakeTorch:
        cuda = fake_cuda

        @staticmethod
        def matmul(a, b, out):
            log.append(f"matmul {b}")

    times = gemm._graph_timed_matmuls(FakeTorch, "a", ["b0", "b1"], "c", 100, Stream())
    assert len(times) == 4 and all(t == pytest.approx(10e-6) for t in times)  # ceil(100 / 32) replays
    captured = log[log.index("capture", log.index("capture") + 1) + 1:log.index("record")]
    assert captured == [f"matmul b{i % 2}" for i in range(gemm.GRAPH_CALLS)]  # weight copies cycle
    assert log.count("replay") == 4


def test_clocks_and_power_come_from_samples_taken_while_a_kernel_ran():
    from gpubench.telemetry import aggregate

    samples = [{"clock_mhz": 1980.0, "power_w": 80.0, "throttle_bits": 0, "gpu_idle": True},
               {"clock_mhz": 1750.0, "power_w": 650.0, "throttle_bits": 4, "gpu_idle": False},
               {"clock_mhz": 1710.0, "power_w": 690.0, "throttle_bits": 0, "gpu_idle": False}]
    out = aggregate(samples, 1980.0)
    assert out["clock_mhz_mean"] == pytest.approx(1730.0) and out["power_w_mean"] == pytest.approx(670.0)
    assert out["telemetry_busy_samples"] == 2 and out["telemetry_samples"] == 3 and out["throttle_bits"] == 4
    # a source that cannot tell (no gpu_idle key, e.g. the CPU): every sample counts
    assert aggregate([{"clock_mhz": 1000.0}, {"clock_mhz": 2000.0}], None)["clock_mhz_mean"] == 1500.0


# ------------------------------------------------------------------ kernels probe (tiny kernels, graph-timed attention)
def test_kernels_probe_plans_floors_then_the_attention_grid_and_skips_without_a_cuda_torch(monkeypatch):
    from gpubench.backends.cuda import CudaBackend
    from gpubench.backends.cuda.probes import kernels

    b = CudaBackend(0, ext=fakes.FakeCudaExt(), nvml=fakes.fake_pynvml())
    probe = b.probes()["kernels"]
    keys = [s.key for s in probe.plan(_cfg(b))]
    floors = [k for k in keys if "_floor_" in k]
    assert floors == [f"kernels_floor_{op}_{mode}" for op in ("add", "gemv", "reduce") for mode in ("eager", "graph")]
    attn = [s for s in probe.plan(_cfg(b)) if s.params["kind"] == "attn_decode"]
    assert {(s.params["batch"], s.params["context"]) for s in attn} == {
        (bb, L) for bb in kernels.QUICK_ATTN_BATCHES for L in kernels.QUICK_ATTN_CONTEXTS}  # _cfg is --quick
    assert min(s.params["context"] for s in attn) == 16  # the rows the attention floor is fitted from
    assert probe.derive({"count": 256}, {"t_median_s": 256e-6, "t_min_s": 200e-6}) == pytest.approx(
        {"per_kernel_s_median": 1e-6, "per_kernel_s_min": 200e-6 / 256, "per_kernel_us_median": 1.0})
    monkeypatch.setattr(kernels, "cuda_torch_reason", lambda: "torch 2.13.0+cpu sees no CUDA device")
    assert probe.supported(b) == (False, "torch 2.13.0+cpu sees no CUDA device")


@pytest.mark.gpu
def test_gpu_kernel_floors_and_graph_timed_attention_are_validated():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA torch")
    from gpubench.backends.cuda.probes.kernels import FLOOR_OPS, attention_times, floor_times

    for op in FLOOR_OPS:
        for mode in ("eager", "graph"):
            r = floor_times(0, op, mode, 16, 3, 1.5e6)
            assert r["valid"], (op, mode, r["check"])
            assert len(r["times_s"]) == 3 and min(r["times_s"]) > 0
    r = attention_times(0, 2, 64, 3, 50 * 2**20)
    assert r["valid"], r["check"]
    assert r["calls"] >= r["copies"] >= 1 and min(r["times_s"]) > 0
