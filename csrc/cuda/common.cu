// DeviceContext, DeviceBuffer, EventPair, SpinGate (see common.cuh).
#include "common.cuh"

namespace gpubench {

DeviceContext::DeviceContext(int device) : device_(device) {
    int n = device_count();  // throws NoDevice with a clear message when there is none
    if (device < 0 || device >= n) {
        throw NoDevice(strfmt("CUDA device %d does not exist (this machine has %d)", device, n));
    }
    CUDA_CHECK(cudaSetDevice(device));
    CUDA_CHECK(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device));
    CUDA_CHECK(cudaDeviceGetAttribute(&cc_major_, cudaDevAttrComputeCapabilityMajor, device));
    CUDA_CHECK(cudaDeviceGetAttribute(&cc_minor_, cudaDevAttrComputeCapabilityMinor, device));
    int l2 = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
    l2_bytes_ = l2;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
}

DeviceContext::~DeviceContext() {
    if (stream_) {
        cudaStreamSynchronize(stream_);
        cudaStreamDestroy(stream_);
    }
}

size_t DeviceContext::free_bytes() const {
    size_t free_b = 0, total_b = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    return free_b;
}

void DeviceContext::ensure_free(size_t needed_bytes, const std::string& what) const {
    size_t free_b = free_bytes();
    if (static_cast<double>(needed_bytes) > 0.95 * static_cast<double>(free_b)) {
        throw DeviceMemory(strfmt("%s needs %zu bytes (%g MiB) of device memory but only %zu bytes (%g MiB) are free "
                                  "on device %d; use a smaller size or free the GPU", what.c_str(),
                                  static_cast<size_t>(needed_bytes), needed_bytes / 1048576.0,
                                  static_cast<size_t>(free_b), free_b / 1048576.0, device_));
    }
}

DeviceBuffer::DeviceBuffer(const DeviceContext& ctx, size_t bytes, const std::string& what) : bytes_(bytes) {
    ctx.ensure_free(bytes, what);
    CUDA_CHECK(cudaMalloc(&ptr_, bytes));
}

EventPair::EventPair() {
    CUDA_CHECK(cudaEventCreate(&start_));
    cudaError_t err = cudaEventCreate(&stop_);
    if (err != cudaSuccess) cudaEventDestroy(start_);
    CUDA_CHECK(err);
}

double EventPair::seconds() const {
    float ms = 0.0f;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
    return static_cast<double>(ms) * 1e-3;
}

__device__ __forceinline__ unsigned long long global_timer_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__global__ void spin_kernel(volatile int* flag, int* timed_out, unsigned long long timeout_ns) {
    unsigned long long t0 = global_timer_ns();
    while (*flag == 0) {
        if (global_timer_ns() - t0 > timeout_ns) {
            *timed_out = 1;
            break;
        }
        __nanosleep(100);
    }
}

void preload_kernel(const void* kernel) {
    cudaFuncAttributes attr;
    CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));  // loads the kernel's module (lazy loading)
}

SpinGate::SpinGate(double timeout_s) : timeout_ns_(static_cast<unsigned long long>(timeout_s * 1e9)) {
    preload_kernel(reinterpret_cast<const void*>(spin_kernel));
    void* p = nullptr;
    CUDA_CHECK(cudaHostAlloc(&p, 2 * sizeof(int), cudaHostAllocMapped));
    int* host = static_cast<int*>(p);
    host[0] = host[1] = 0;
    flag_host_ = host;
    timed_out_host_ = host + 1;
    void* dev = nullptr;
    CUDA_CHECK(cudaHostGetDevicePointer(&dev, p, 0));
    flag_dev_ = static_cast<int*>(dev);
    timed_out_dev_ = flag_dev_ + 1;
}

SpinGate::~SpinGate() {
    if (flag_host_) {
        *flag_host_ = 1;  // never leave a spinning kernel behind
        cudaFreeHost(const_cast<int*>(flag_host_));
    }
}

void SpinGate::hold(cudaStream_t s) {
    *flag_host_ = 0;
    *timed_out_host_ = 0;
    spin_kernel<<<1, 1, 0, s>>>(flag_dev_, timed_out_dev_, timeout_ns_);
    CUDA_CHECK(cudaGetLastError());
}

void SpinGate::release() {
    __atomic_store_n(const_cast<int*>(flag_host_), 1, __ATOMIC_SEQ_CST);
}

void SpinGate::check() const {
    if (*static_cast<volatile int*>(timed_out_host_)) {
        throw CudaError(strfmt(
            "spin gate timed out after %g s: the host could not enqueue the measured work behind it. Either the "
            "launch queue filled up (use fewer launches per repetition) or a kernel enqueued behind the gate was "
            "launched for the first time and its module load waited for the device to go idle "
            "(lazy loading: preload it with preload_kernels, or set CUDA_MODULE_LOADING=EAGER)", timeout_ns_ / 1e9));
    }
}

int resident_grid(const DeviceContext& ctx, const void* kernel, int block_threads) {
    int per_sm = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, block_threads, 0));
    if (per_sm < 1) per_sm = 1;
    return per_sm * ctx.sm_count();
}

}  // namespace gpubench
