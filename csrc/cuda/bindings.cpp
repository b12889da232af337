// gpubench._cuda bindings. Kernels live in *.cu (compiled by nvcc); this file only sees plain C++.
#include <pybind11/pybind11.h>
#include "gpubench_cuda.h"

namespace py = pybind11;

PYBIND11_MODULE(_cuda, m) {
    m.doc() = "gpubench CUDA backend: compiled probes timed with CUDA events";
    m.attr("__version__") = GPUBENCH_VERSION;
    // The Python layer (gpubench.backends.cuda) maps these onto gpubench.errors.NoDeviceError.
    py::register_exception<gpubench::NoDevice>(m, "NoDeviceError", PyExc_RuntimeError);
    py::register_exception<gpubench::CudaError>(m, "CudaError", PyExc_RuntimeError);
    m.def("device_count", &gpubench::device_count, "Number of CUDA devices; raises NoDeviceError when none can be used.");
    m.def("device_properties", &gpubench::device_properties, py::arg("device") = 0,
          "Properties read from the device at run time (SM count, L2 bytes, clocks, memory).");
    m.def("selfcheck_fill", &gpubench::selfcheck_fill, py::arg("device") = 0, py::arg("n") = 1 << 20,
          "Fill a device buffer with a pattern by a trivial kernel and verify it on the host; returns True.");
}
