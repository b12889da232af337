// CUDA_CHECK: throw (never exit) with the failing expression, the CUDA error name and file:line.
#pragma once
#include <cuda_runtime.h>
#include <cstdarg>
#include <cstdio>
#include <string>
#include "gpubench_cuda.h"

namespace gpubench {

// printf-style formatting into a std::string: every message and check line of the extension is built
// with it, never with iostreams. On the first H200 machine iostream formatting printed integers as
// nothing ("validation run (+B,+B x ) off"), and the two probes that crashed (SIGSEGV at their first
// measurement) were the ones formatting a double through std::ostringstream on their success path.
inline std::string strfmt(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
inline std::string strfmt(const char* fmt, ...) {
    va_list args;
    va_start(args, fmt);
    va_list again;
    va_copy(again, args);
    const int n = std::vsnprintf(nullptr, 0, fmt, args);
    va_end(args);
    std::string out(n > 0 ? static_cast<size_t>(n) : 0, '\0');
    if (n > 0) std::vsnprintf(&out[0], static_cast<size_t>(n) + 1, fmt, again);
    va_end(again);
    return out;
}

}  // namespace gpubench

#define CUDA_CHECK(expr)                                                                          \
    do {                                                                                          \
        cudaError_t err_ = (expr);                                                                \
        if (err_ != cudaSuccess) {                                                                \
            const std::string msg_ = gpubench::strfmt("%s failed: %s (%s) at %s:%d", #expr,        \
                cudaGetErrorName(err_), cudaGetErrorString(err_), __FILE__, __LINE__);            \
            if (err_ == cudaErrorNoDevice || err_ == cudaErrorInsufficientDriver)                 \
                throw gpubench::NoDevice(msg_);                                                   \
            throw gpubench::CudaError(msg_);                                                      \
        }                                                                                         \
    } while (0)
