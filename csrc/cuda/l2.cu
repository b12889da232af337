// l2 probe: read bandwidth against working-set size, with loads that bypass L1 (ld.global.cg).
//
//   cold: [flush: read >= 2x L2 of another, clean buffer] [event] one pass over the set [event]   per rep
//   warm: untimed pass, then [event] `passes` passes over the same set [event]             per rep
//
// The reads of one repetition are a flat index space of passes x n2 double2 elements spread over
// the whole resident grid (element = index mod n2), so small sets still keep every SM busy. Every
// element holds 1.0; the block-reduced sum must equal 2 x passes x n2 exactly (checked per rep).
#include <memory>
#include "common.cuh"

namespace gpubench {
namespace {

constexpr int kBlock = 256;

__device__ __forceinline__ double2 load_cg(const double2* p) {
    double2 v;
    // volatile: the loads of one pass must not be merged with, or hoisted out of, another pass.
    asm volatile("ld.global.cg.v2.f64 {%0, %1}, [%2];" : "=d"(v.x), "=d"(v.y) : "l"(p));
    return v;
}

__global__ void fill_k(double2* __restrict__ p, long long n2, double value) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n2; i += (long long)gridDim.x * blockDim.x)
        p[i] = make_double2(value, value);
}

// Launch bounds: without them ptxas budgets registers for 1,024-thread blocks, reuses the first
// loads' registers and keeps only two loads in flight (SASS: LDG, DADD, LDG, DADD, LDG, LDG), a
// suspect for the warm-L2 plateau reading under published figures (not yet measured on a GPU). With
// them (42-64 registers, 4 or more blocks of 256 a SM, no spills) all four loads issue before any sum
// reads one; scripts/check_sass.py checks it on every arch.
__global__ void __launch_bounds__(kBlock, 4) read_k(const double2* __restrict__ p, long long n2, long long total,
                                                    double* sum) {
    const long long T = (long long)gridDim.x * blockDim.x;
    const long long step = T % n2;
    long long g = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    long long idx = g % n2;
    double acc0 = 0.0, acc1 = 0.0, acc2 = 0.0, acc3 = 0.0;
    // Four independent loads in flight per thread before their sums are needed (see the launch bounds).
    for (; g + 3 * T < total; g += 4 * T) {
        long long i0 = idx;
        long long i1 = i0 + step; if (i1 >= n2) i1 -= n2;
        long long i2 = i1 + step; if (i2 >= n2) i2 -= n2;
        long long i3 = i2 + step; if (i3 >= n2) i3 -= n2;
        idx = i3 + step; if (idx >= n2) idx -= n2;
        double2 v0 = load_cg(p + i0), v1 = load_cg(p + i1), v2 = load_cg(p + i2), v3 = load_cg(p + i3);
        acc0 += v0.x + v0.y; acc1 += v1.x + v1.y; acc2 += v2.x + v2.y; acc3 += v3.x + v3.y;
    }
    for (; g < total; g += T) {
        double2 v = load_cg(p + idx);
        acc0 += v.x + v.y;
        idx += step; if (idx >= n2) idx -= n2;
    }
    double acc = (acc0 + acc1) + (acc2 + acc3);
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
    __shared__ double warp_sums[kBlock / 32];
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        double b = 0.0;
        for (int w = 0; w < kBlock / 32; ++w) b += warp_sums[w];
        atomicAdd(sum, b);
    }
}

// The cold flush is a read of a buffer of >= 2x L2 (read_k over it), not a write: a written flush
// leaves L2 full of dirty lines, and their write-back to DRAM would fall inside the timed read that
// evicts them. The flush buffer is written once at setup and read once before the first repetition,
// so every flush leaves L2 holding clean lines only.

}  // namespace

ProbeResult l2_run(int device, long long working_set_bytes, const std::string& mode, long long passes,
                   int num_reps, int num_warmup) {
    if (working_set_bytes < 16 || working_set_bytes % 16 != 0)
        throw std::invalid_argument("l2: working_set_bytes must be a positive multiple of 16 (got " +
                                    std::to_string(working_set_bytes) + ")");
    if (mode != "cold" && mode != "warm") throw std::invalid_argument("l2: mode must be 'cold' or 'warm' (got '" + mode + "')");
    if (mode == "cold") passes = 1;
    if (passes < 1) throw std::invalid_argument("l2: passes must be >= 1");
    if (num_reps < 1 || num_warmup < 0) throw std::invalid_argument("l2: num_reps must be >= 1, num_warmup >= 0");
    DeviceContext ctx(device);
    const long long n2 = working_set_bytes / 16;
    const size_t flush_bytes = round_up(static_cast<unsigned long long>(2 * ctx.l2_bytes() + (1 << 20)), 16);
    ctx.ensure_free(working_set_bytes + (mode == "cold" ? flush_bytes : 0) + 64,
                    "l2 " + mode + " (working set " + std::to_string(working_set_bytes) + " bytes" +
                        (mode == "cold" ? " + flush buffer " + std::to_string(flush_bytes) + " bytes" : std::string()) + ")");
    DeviceBuffer set(ctx, working_set_bytes, "l2 working set");
    DeviceBuffer sum(ctx, sizeof(double), "l2 sum");
    cudaStream_t s = ctx.stream();
    const int grid = resident_grid(ctx, reinterpret_cast<const void*>(read_k), kBlock);
    fill_k<<<grid, kBlock, 0, s>>>(set.as<double2>(), n2, 1.0);
    CUDA_CHECK(cudaGetLastError());

    DeviceBuffer* flush = nullptr;
    std::unique_ptr<DeviceBuffer> flush_owner;
    std::unique_ptr<DeviceBuffer> flush_sum;
    if (mode == "cold") {
        flush_owner.reset(new DeviceBuffer(ctx, flush_bytes, "l2 flush buffer"));
        flush = flush_owner.get();
        flush_sum.reset(new DeviceBuffer(ctx, sizeof(double), "l2 flush sum"));
        fill_k<<<grid, kBlock, 0, s>>>(flush->as<double2>(), flush_bytes / 16, 1.0);
        read_k<<<grid, kBlock, 0, s>>>(flush->as<double2>(), flush_bytes / 16, flush_bytes / 16, flush_sum->as<double>());
        CUDA_CHECK(cudaGetLastError());
    }
    const long long total = passes * n2;
    const double expected = 2.0 * static_cast<double>(total);
    ProbeResult r;
    EventPair ev;
    preload_kernels(read_k);
    SpinGate gate;
    long long num_bad = 0;
    double first_bad = 0.0;
    if (mode == "warm") {  // untimed pass: bring the set into L2 (as far as it fits)
        read_k<<<grid, kBlock, 0, s>>>(set.as<double2>(), n2, n2, sum.as<double>());
        CUDA_CHECK(cudaGetLastError());
    }
    for (int rep = 0; rep < num_warmup + num_reps; ++rep) {
        CUDA_CHECK(cudaMemsetAsync(sum.as<void>(), 0, sizeof(double), s));
        gate.hold(s);
        if (flush) read_k<<<grid, kBlock, 0, s>>>(flush->as<double2>(), flush_bytes / 16, flush_bytes / 16,
                                                  flush_sum->as<double>());
        ev.start(s);
        read_k<<<grid, kBlock, 0, s>>>(set.as<double2>(), n2, total, sum.as<double>());
        ev.stop(s);
        CUDA_CHECK(cudaGetLastError());
        gate.release();
        double got = 0.0;
        CUDA_CHECK(cudaMemcpyAsync(&got, sum.as<double>(), sizeof(got), cudaMemcpyDeviceToHost, s));
        ctx.sync();
        gate.check();
        if (got != expected && num_bad++ == 0) first_bad = got;
        if (rep >= num_warmup) r.times_s.push_back(ev.seconds());
    }
    r.valid = num_bad == 0;
    r.check = strfmt("sum of %lld double2 of 1.0 per rep must be %g: ", total, expected) +
              (num_bad == 0 ? strfmt("all %d reps exact", num_warmup + num_reps)
                            : strfmt("%lld reps off (first got %g)", num_bad, first_bad));
    r.info["working_set_bytes"] = static_cast<double>(working_set_bytes);
    r.info["passes"] = static_cast<double>(passes);
    r.info["bytes"] = static_cast<double>(passes) * static_cast<double>(working_set_bytes);
    r.info["flush_bytes"] = flush ? static_cast<double>(flush_bytes) : 0.0;
    r.info["l2_bytes"] = static_cast<double>(ctx.l2_bytes());
    r.info["grid"] = grid;
    r.info["block"] = kBlock;
    return r;
}

}  // namespace gpubench
