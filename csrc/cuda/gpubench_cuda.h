// Plain C++ interface between the nvcc-compiled kernels and the pybind11 bindings.
#pragma once
#include <map>
#include <stdexcept>
#include <string>

namespace gpubench {

struct NoDevice : std::runtime_error { using std::runtime_error::runtime_error; };
struct CudaError : std::runtime_error { using std::runtime_error::runtime_error; };

int device_count();
std::map<std::string, double> device_properties(int device);
bool selfcheck_fill(int device, long long n);

}  // namespace gpubench
