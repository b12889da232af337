// CUDA_CHECK: throw (never exit) with the failing expression, the CUDA error name and file:line.
#pragma once
#include <cuda_runtime.h>
#include <sstream>
#include "gpubench_cuda.h"

#define CUDA_CHECK(expr)                                                                          \
    do {                                                                                          \
        cudaError_t err_ = (expr);                                                                \
        if (err_ != cudaSuccess) {                                                                \
            std::ostringstream os_;                                                               \
            os_ << #expr << " failed: " << cudaGetErrorName(err_) << " (" << cudaGetErrorString(err_) \
                << ") at " << __FILE__ << ":" << __LINE__;                                        \
            if (err_ == cudaErrorNoDevice || err_ == cudaErrorInsufficientDriver)                 \
                throw gpubench::NoDevice(os_.str());                                              \
            throw gpubench::CudaError(os_.str());                                                 \
        }                                                                                         \
    } while (0)
