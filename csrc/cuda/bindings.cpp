// gpubench._cuda bindings. Kernels live in *.cu (compiled by nvcc); this file only sees plain C++.
//
// Every probe function blocks until the device finished and returns a dict:
//   {"times_s": [per-repetition seconds, warm-up excluded], "valid": bool, "check": str, **info}
// (info: sizes, launch geometry, "bytes" or "flops" per repetition). The GIL is released while the
// device works, so the telemetry sampler thread keeps sampling.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include "gpubench_cuda.h"

namespace py = pybind11;

namespace {

py::dict to_dict(const gpubench::ProbeResult& r) {
    py::dict d;
    for (const auto& kv : r.info) d[py::str(kv.first)] = kv.second;
    d["times_s"] = r.times_s;
    d["valid"] = r.valid;
    d["check"] = r.check;
    return d;
}

}  // namespace

PYBIND11_MODULE(_cuda, m) {
    m.doc() = "gpubench CUDA backend: compiled probes timed with CUDA events";
    m.attr("__version__") = GPUBENCH_VERSION;
    // The Python layer (gpubench.backends.cuda) maps these onto gpubench.errors.
    py::register_exception<gpubench::NoDevice>(m, "NoDeviceError", PyExc_RuntimeError);
    py::register_exception<gpubench::CudaError>(m, "CudaError", PyExc_RuntimeError);
    py::register_exception<gpubench::DeviceMemory>(m, "DeviceMemoryError", PyExc_RuntimeError);
    m.def("device_count", &gpubench::device_count, "Number of CUDA devices; raises NoDeviceError when none can be used.");
    m.def("device_properties", &gpubench::device_properties, py::arg("device") = 0,
          "Properties read from the device at run time (SM count, L2 bytes, clocks, memory).");
    m.def("device_identity", &gpubench::device_identity, py::arg("device") = 0,
          "Strings read at run time: name, pci_bus_id, driver_cuda_version, cuda_runtime.");
    m.def("format_selftest", &gpubench::format_selftest,
          "The formatter every message uses, on fixed values (compare with FORMAT_SELFTEST_EXPECTED).");
    m.def("selfcheck_fill", &gpubench::selfcheck_fill, py::arg("device") = 0, py::arg("n") = 1 << 20,
          "Fill a device buffer with a pattern by a trivial kernel and verify it on the host; returns True.");

    m.def(
        "stream",
        [](int device, long long n_elements, int num_reps, int num_warmup) {
            std::map<std::string, gpubench::ProbeResult> res;
            {
                py::gil_scoped_release nogil;
                res = gpubench::stream_run(device, n_elements, num_reps, num_warmup);
            }
            py::dict out;
            for (const auto& kv : res) out[py::str(kv.first)] = to_dict(kv.second);
            return out;
        },
        py::arg("device"), py::arg("n_elements"), py::arg("num_reps") = 10, py::arg("num_warmup") = 2,
        "STREAM copy/scale/add/triad on three fp64 arrays of n_elements (even), double2 accesses, grid-stride,\n"
        "CUDA events behind a spin gate. Returns {kernel: {times_s, valid, check, bytes, n_elements, ...}};\n"
        "the arrays are checked on the device against a golden replay. bytes follow STREAM (2,2,3,3 arrays).");
    m.def(
        "l2",
        [](int device, long long working_set_bytes, const std::string& mode, long long passes, int num_reps,
           int num_warmup) {
            gpubench::ProbeResult r;
            {
                py::gil_scoped_release nogil;
                r = gpubench::l2_run(device, working_set_bytes, mode, passes, num_reps, num_warmup);
            }
            return to_dict(r);
        },
        py::arg("device"), py::arg("working_set_bytes"), py::arg("mode"), py::arg("passes") = 1,
        py::arg("num_reps") = 10, py::arg("num_warmup") = 2,
        "Read bandwidth over a working set with L1-bypassing loads. mode='cold': L2 flushed by writing >= 2x L2\n"
        "before each single timed pass; mode='warm': `passes` passes per repetition after an untimed warm pass.\n"
        "Returns {times_s, valid, check, bytes (read per repetition), passes, working_set_bytes, l2_bytes, ...}.");
    m.def(
        "launch",
        [](int device, const std::string& kind, int count, int num_reps, int num_warmup) {
            gpubench::ProbeResult r;
            {
                py::gil_scoped_release nogil;
                r = gpubench::launch_run(device, kind, count, num_reps, num_warmup);
            }
            return to_dict(r);
        },
        py::arg("device"), py::arg("kind"), py::arg("count"), py::arg("num_reps") = 10, py::arg("num_warmup") = 2,
        "Kernel launch cost, kind in host_enqueue (host clock, gated), device_interval (events, gated),\n"
        "launch_sync (host clock, launch + synchronize), graph_node (events around a graph of `count` kernels).\n"
        "times_s cover `count` launches per repetition. Gated kinds allow count <= 512.");
    m.def(
        "peak",
        [](int device, const std::string& dtype, int num_reps, int num_warmup, double target_s) {
            gpubench::ProbeResult r;
            {
                py::gil_scoped_release nogil;
                r = gpubench::peak_run(device, dtype, num_reps, num_warmup, target_s);
            }
            return to_dict(r);
        },
        py::arg("device"), py::arg("dtype"), py::arg("num_reps") = 10, py::arg("num_warmup") = 2,
        py::arg("target_s") = 0.02,
        "Compute ceiling with operands in registers: mma.sync loops for bf16/fp16 (m16n8k16), tf32 (m16n8k8),\n"
        "fp8 e4m3 (m16n8k32, sm_89+), or fp32 FMA on CUDA cores. Returns {times_s, valid, check, flops (per\n"
        "repetition), supported, iters, ...}; supported=0 (and no times) where the device lacks the dtype.");
    m.def(
        "peak_wgmma",
        [](int device, int num_reps, int num_warmup, double target_s, const std::string& dtype) {
            gpubench::ProbeResult r;
            {
                py::gil_scoped_release nogil;
                r = gpubench::peak_wgmma_run(device, dtype, num_reps, num_warmup, target_s);
            }
            return to_dict(r);
        },
        py::arg("device"), py::arg("num_reps") = 10, py::arg("num_warmup") = 2, py::arg("target_s") = 0.02,
        py::arg("dtype") = "bf16",
        "Hopper tensor-core ceiling: wgmma.mma_async m64n128k16 bf16 or m64n128k32 fp8 e4m3 (dtype 'bf16' or\n"
        "'fp8'; fp32 accumulate), A in registers, B in\n"
        "shared memory, accumulators checked exactly. Needs compute capability 9.0 and a build with sm_90a code\n"
        "(GPUBENCH_CUDA_ARCHS=\"90a\"); otherwise supported=0 and the reason in check.");
    m.def("peak_supported", &gpubench::peak_supported, py::arg("device"), py::arg("dtype"),
          "(supported, reason) of a peak dtype on this device, from its compute capability.");
}
