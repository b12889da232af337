// Shared pieces of the probes: device context, RAII device buffers with a free-memory check,
// timing events and the spin-kernel gate. Small classes, one job each.
#pragma once
#include <algorithm>
#include <cuda_runtime.h>
#include <string>
#include <vector>
#include "check.cuh"

namespace gpubench {

// Device, a non-blocking stream and the properties the probes size themselves from (read at run time).
class DeviceContext {
public:
    explicit DeviceContext(int device);
    ~DeviceContext();
    DeviceContext(const DeviceContext&) = delete;
    DeviceContext& operator=(const DeviceContext&) = delete;

    int device() const { return device_; }
    cudaStream_t stream() const { return stream_; }
    int sm_count() const { return sm_count_; }
    long long l2_bytes() const { return l2_bytes_; }
    int cc() const { return cc_major_ * 10 + cc_minor_; }
    // Free device memory now, in bytes.
    size_t free_bytes() const;
    // Throw DeviceMemory naming `what`, the bytes needed and the bytes free, when they do not fit
    // (a 5 % margin stays free for the context and the allocator).
    void ensure_free(size_t needed_bytes, const std::string& what) const;
    void sync() const { CUDA_CHECK(cudaStreamSynchronize(stream_)); }

private:
    int device_;
    cudaStream_t stream_ = nullptr;
    int sm_count_ = 0, cc_major_ = 0, cc_minor_ = 0;
    long long l2_bytes_ = 0;
};

// cudaMalloc'ed bytes, freed on scope exit (never throws from the destructor).
class DeviceBuffer {
public:
    DeviceBuffer(const DeviceContext& ctx, size_t bytes, const std::string& what);
    ~DeviceBuffer() { if (ptr_) cudaFree(ptr_); }
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;
    template <class T> T* as() const { return static_cast<T*>(ptr_); }
    size_t bytes() const { return bytes_; }

private:
    void* ptr_ = nullptr;
    size_t bytes_ = 0;
};

// A pair of timing events; seconds() reads cudaEventElapsedTime after the stream finished.
class EventPair {
public:
    EventPair();
    ~EventPair() { cudaEventDestroy(start_); cudaEventDestroy(stop_); }
    EventPair(const EventPair&) = delete;
    EventPair& operator=(const EventPair&) = delete;
    void start(cudaStream_t s) { CUDA_CHECK(cudaEventRecord(start_, s)); }
    void stop(cudaStream_t s) { CUDA_CHECK(cudaEventRecord(stop_, s)); }
    double seconds() const;

private:
    cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

// Iterations of a loop kernel so that one timed launch lasts about target_s (Triton's do_bench
// turns a time budget into a count the same way): time a short launch, scale, at most 4 rounds.
// launch(iters) must enqueue one launch on ctx's stream.
template <class Launch>
long long size_iters_for(const DeviceContext& ctx, EventPair& ev, long long iters, double target_s, Launch launch) {
    for (int round = 0; round < 4; ++round) {
        ev.start(ctx.stream());
        launch(iters);
        ev.stop(ctx.stream());
        ctx.sync();
        const double t = ev.seconds();
        if (t >= 0.25 * target_s) break;
        iters = static_cast<long long>(iters * std::min(64.0, target_s / std::max(t, 1e-7)));
    }
    return iters;
}

// The spin-kernel gate (nvbandwidth's latch): hold() enqueues a kernel that spins on a host-mapped
// flag, so everything enqueued after it waits; release() sets the flag. Work queued between the two
// runs back to back on the device, with the host's enqueue cost excluded from event intervals.
// NOTE: the stream's launch queue is finite (about a thousand entries); enqueuing more than that
// behind a held gate blocks the host, so the spin kernel gives up after timeout_s and check() throws.
// So does a kernel whose module is not loaded yet (lazy loading): the constructor preloads the spin
// kernel, and each probe preloads its own kernels (preload_kernels) before the first hold().
class SpinGate {
public:
    explicit SpinGate(double timeout_s = 10.0);
    ~SpinGate();
    SpinGate(const SpinGate&) = delete;
    SpinGate& operator=(const SpinGate&) = delete;
    void hold(cudaStream_t s);
    void release();
    // Call after the stream synchronized: throws CudaError if the gate timed out.
    void check() const;

private:
    volatile int* flag_host_ = nullptr;
    int* flag_dev_ = nullptr;
    int* timed_out_host_ = nullptr;
    int* timed_out_dev_ = nullptr;
    unsigned long long timeout_ns_;
};

// Load a kernel's module now. Since CUDA 12.2 modules load lazily at a kernel's first launch, and
// that load waits for the device to go idle: a first launch enqueued behind a held SpinGate would
// block the host until the gate times out (every row of the probe lost). nvbandwidth preloads the
// same way. Call for every kernel a probe launches, before its first gate.
void preload_kernel(const void* kernel);
template <class... K>
void preload_kernels(K... kernels) { (preload_kernel(reinterpret_cast<const void*>(kernels)), ...); }

// Grid for a grid-stride kernel: enough resident blocks to fill every SM once.
int resident_grid(const DeviceContext& ctx, const void* kernel, int block_threads);

// Median helper is in Python; here only the per-rep seconds are produced.
inline unsigned long long round_up(unsigned long long x, unsigned long long m) { return (x + m - 1) / m * m; }

}  // namespace gpubench
