// gpubench._cpu: compiled CPU probes. Every probe is a blocking call that returns per-repetition
// times in seconds measured with std::chrono::steady_clock around the timed region only. Every
// probe releases the GIL while it runs, so the telemetry sampler thread keeps sampling.
#include <omp.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "probes.h"
#include "simd.h"

namespace py = pybind11;
using namespace gpubench;

namespace {

py::dict stream_dict(const StreamResult& r) {
    py::dict d;
    d["copy"] = r.copy_s;
    d["scale"] = r.scale_s;
    d["add"] = r.add_s;
    d["triad"] = r.triad_s;
    d["valid"] = r.valid;
    d["reason"] = r.reason;
    d["rel_err"] = py::make_tuple(r.rel_err_a, r.rel_err_b, r.rel_err_c);
    d["num_bad_elements"] = r.num_bad_elements;
    d["threads"] = r.threads;
    return d;
}

py::dict cache_dict(const CacheSweepResult& r) {
    py::dict d;
    d["times_s"] = r.times_s;
    d["valid"] = r.valid;
    d["checksum"] = r.checksum;
    d["expected"] = r.expected;
    d["threads"] = r.threads;
    return d;
}

py::dict peak_dict(const PeakResult& r) {
    py::dict d;
    d["times_s"] = r.times_s;
    d["valid"] = r.valid;
    d["checksum"] = r.checksum;
    d["expected"] = r.expected;
    d["threads"] = r.threads;
    d["lanes"] = r.lanes;
    d["accumulators"] = r.accumulators;
    d["flops_per_rep"] = r.flops_per_rep;
    d["thread_best_s"] = r.thread_best_s;
    d["isa"] = r.isa;
    return d;
}

}  // namespace

PYBIND11_MODULE(_cpu, m) {
    m.doc() = "gpubench CPU backend: compiled probes timed with steady_clock";
    m.attr("__version__") = GPUBENCH_VERSION;
    m.attr("vector_bytes") = kVecBytes;
    m.attr("isa") = kIsa;
    m.def("max_threads", []() { return omp_get_max_threads(); }, "OpenMP threads a parallel region uses.");

    m.def(
        "stream",
        [](size_t n_elements, int num_reps, int corrupt) {
            StreamResult r;
            {
                py::gil_scoped_release nogil;
                r = stream_run(n_elements, num_reps, corrupt);
            }
            return stream_dict(r);
        },
        py::arg("n_elements"), py::arg("num_reps") = 10, py::arg("corrupt") = 0,
        "STREAM copy/scale/add/triad on three fp64 arrays of n_elements; dict of per-rep seconds per kernel,\n"
        "valid (stream.c golden check), reason. corrupt=1|2|3 (debug) damages a/b/c before validation.");

    m.def(
        "cache_read_warm",
        [](size_t working_set_bytes, int passes, int num_reps) {
            CacheSweepResult r;
            {
                py::gil_scoped_release nogil;
                r = cache_read_warm(working_set_bytes, passes, num_reps);
            }
            return cache_dict(r);
        },
        py::arg("working_set_bytes"), py::arg("passes"), py::arg("num_reps") = 10,
        "Warm read sweep point: per-rep seconds of `passes` passes over a buffer kept in cache; checksum checked.");

    m.def(
        "cache_read_cold",
        [](size_t working_set_bytes, size_t flush_bytes, int num_reps) {
            CacheSweepResult r;
            {
                py::gil_scoped_release nogil;
                r = cache_read_cold(working_set_bytes, flush_bytes, num_reps);
            }
            return cache_dict(r);
        },
        py::arg("working_set_bytes"), py::arg("flush_bytes"), py::arg("num_reps") = 10,
        "Cold read sweep point: a flush buffer of flush_bytes is written before each timed single pass.");

    m.def(
        "peak_fma",
        [](const std::string& dtype, int64_t iters, int num_reps) {
            PeakResult r;
            if (dtype != "fp64" && dtype != "fp32") throw py::value_error("dtype must be fp64 or fp32, got " + dtype);
            {
                py::gil_scoped_release nogil;
                r = dtype == "fp64" ? peak_fma_fp64(iters, num_reps) : peak_fma_fp32(iters, num_reps);
            }
            return peak_dict(r);
        },
        py::arg("dtype"), py::arg("iters"), py::arg("num_reps") = 10,
        "FMA-chain throughput on all threads: per-rep seconds, flops_per_rep, checksum vs closed form.");

    m.def(
        "dependent_add_seconds",
        [](int64_t iters, int num_reps) {
            py::gil_scoped_release nogil;
            return dependent_add_seconds(iters, num_reps);
        },
        py::arg("iters"), py::arg("num_reps") = 10,
        "Per-rep seconds of 32*iters dependent integer adds on one thread (1 cycle each): the core clock.\n"
        "A negative time marks a rep whose chain result was wrong.");

    m.def(
        "omp_fork_join",
        [](int count, int num_reps) {
            py::gil_scoped_release nogil;
            return omp_fork_join(count, num_reps);
        },
        py::arg("count"), py::arg("num_reps") = 10, "Per-rep seconds of `count` empty OpenMP parallel regions.");

    m.def("noop", []() {}, "Does nothing: times the Python -> extension call.");
    m.def("debug_segfault", []() { debug_segfault(); }, "Raises SIGSEGV (fault-isolation tests only).");
    m.def("debug_abort", []() { debug_abort(); }, "Calls abort() (fault-isolation tests only).");
}
