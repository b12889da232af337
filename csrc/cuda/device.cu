// Device query and a trivial fill kernel used as the build's and the machine's first self-check.
#include <vector>
#include "check.cuh"

namespace gpubench {

int device_count() {
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess || n == 0) {
        throw NoDevice(strfmt("no usable CUDA device: cudaGetDeviceCount returned %s (no GPU, or no NVIDIA driver "
                              "on this machine)", err == cudaSuccess ? "0 devices" : cudaGetErrorName(err)));
    }
    return n;
}

static int attr(cudaDeviceAttr a, int device) {
    int v = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&v, a, device));
    return v;
}

std::map<std::string, double> device_properties(int device) {
    device_count();
    std::map<std::string, double> p;
    p["sm_count"] = attr(cudaDevAttrMultiProcessorCount, device);
    p["l2_bytes"] = attr(cudaDevAttrL2CacheSize, device);
    p["cc_major"] = attr(cudaDevAttrComputeCapabilityMajor, device);
    p["cc_minor"] = attr(cudaDevAttrComputeCapabilityMinor, device);
    p["clock_khz"] = attr(cudaDevAttrClockRate, device);
    p["mem_clock_khz"] = attr(cudaDevAttrMemoryClockRate, device);
    p["bus_width_bits"] = attr(cudaDevAttrGlobalMemoryBusWidth, device);
    p["max_threads_per_sm"] = attr(cudaDevAttrMaxThreadsPerMultiProcessor, device);
    p["shared_mem_per_sm_bytes"] = attr(cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
    size_t free_b = 0, total_b = 0;
    CUDA_CHECK(cudaSetDevice(device));
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    p["total_mem_bytes"] = static_cast<double>(total_b);
    p["free_mem_bytes"] = static_cast<double>(free_b);
    return p;
}

static std::string cuda_version(int v) {
    return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}

std::map<std::string, std::string> device_identity(int device) {
    device_count();
    cudaDeviceProp prop{};
    CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    char bus_id[64] = {0};
    CUDA_CHECK(cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), device));
    int driver = 0, runtime = 0;
    CUDA_CHECK(cudaDriverGetVersion(&driver));
    CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
    return {{"name", prop.name}, {"pci_bus_id", bus_id}, {"driver_cuda_version", cuda_version(driver)},
            {"cuda_runtime", cuda_version(runtime)}};
}

__global__ void fill_kernel(unsigned* out, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = static_cast<unsigned>(i * 2654435761ull);
}

std::string format_selftest() {
    return strfmt("int %d, long long %lld, unsigned long long %llu, size_t %zu, double %g, string %s", -42,
                  -9000000000LL, 18446744073709551615ULL, static_cast<size_t>(4096), 0.125, "ok");
}

bool selfcheck_fill(int device, long long n) {
    device_count();
    CUDA_CHECK(cudaSetDevice(device));
    unsigned* d = nullptr;
    CUDA_CHECK(cudaMalloc(&d, n * sizeof(unsigned)));
    fill_kernel<<<256, 256>>>(d, n);
    cudaError_t launch = cudaGetLastError();
    std::vector<unsigned> h(n);
    cudaError_t copy = cudaMemcpy(h.data(), d, n * sizeof(unsigned), cudaMemcpyDeviceToHost);
    cudaFree(d);
    CUDA_CHECK(launch);
    CUDA_CHECK(copy);
    for (long long i = 0; i < n; ++i)
        if (h[i] != static_cast<unsigned>(i * 2654435761ull))
            throw CudaError("selfcheck_fill: mismatch at index " + std::to_string(i));
    return true;
}

}  // namespace gpubench
