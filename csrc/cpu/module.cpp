// gpubench._cpu: compiled CPU probes. Every probe is a blocking call that returns per-repetition
// times in seconds measured with std::chrono::steady_clock around the timed region only.
#include <pybind11/pybind11.h>
#include <omp.h>

namespace py = pybind11;

PYBIND11_MODULE(_cpu, m) {
    m.doc() = "gpubench CPU backend: compiled probes timed with steady_clock";
    m.attr("__version__") = GPUBENCH_VERSION;
    m.def("max_threads", []() { return omp_get_max_threads(); }, "OpenMP threads a parallel region uses.");
}
