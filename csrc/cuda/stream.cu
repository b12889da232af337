// stream probe: BabelStream's copy/scale/add/triad on fp64 arrays accessed as double2 (16 bytes),
// grid-stride loops over a resident grid, device time by CUDA events behind the spin gate, arrays
// checked on the device against a golden replay of the same kernel sequence.
//
//   per repetition (one gated batch):  copy c=a | scale b=s*c | add c=a+b | triad a=b+s*c
//   STREAM bytes per kernel: 2, 2, 3, 3 arrays x n x 8 (write-allocate not counted)
#include <cmath>
#include <cstring>
#include "common.cuh"

namespace gpubench {
namespace {

constexpr double kStartA = 0.1, kStartB = 0.2, kStartC = 0.3;  // never zeros
constexpr double kScalar = 0.4;
constexpr int kBlock = 256;
constexpr const char* kKernels[4] = {"copy", "scale", "add", "triad"};
constexpr int kArraysMoved[4] = {2, 2, 3, 3};

__global__ void init_k(double2* __restrict__ a, double2* __restrict__ b, double2* __restrict__ c, long long n2) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n2; i += (long long)gridDim.x * blockDim.x) {
        a[i] = make_double2(kStartA, kStartA);
        b[i] = make_double2(kStartB, kStartB);
        c[i] = make_double2(kStartC, kStartC);
    }
}

__global__ void copy_k(const double2* __restrict__ a, double2* __restrict__ c, long long n2) {
#pragma unroll 4
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n2; i += (long long)gridDim.x * blockDim.x)
        c[i] = a[i];
}

__global__ void scale_k(double2* __restrict__ b, const double2* __restrict__ c, double s, long long n2) {
#pragma unroll 4
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n2; i += (long long)gridDim.x * blockDim.x) {
        double2 v = c[i];
        b[i] = make_double2(s * v.x, s * v.y);
    }
}

__global__ void add_k(const double2* __restrict__ a, const double2* __restrict__ b, double2* __restrict__ c, long long n2) {
#pragma unroll 4
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n2; i += (long long)gridDim.x * blockDim.x) {
        double2 x = a[i], y = b[i];
        c[i] = make_double2(x.x + y.x, x.y + y.y);
    }
}

__global__ void triad_k(double2* __restrict__ a, const double2* __restrict__ b, const double2* __restrict__ c,
                        double s, long long n2) {
#pragma unroll 4
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n2; i += (long long)gridDim.x * blockDim.x) {
        double2 y = b[i], z = c[i];
        a[i] = make_double2(y.x + s * z.x, y.y + s * z.y);
    }
}

// Counts elements whose relative error against `gold` exceeds tol; keeps the max relative error
// (as float bits: non-negative floats order like their bit patterns).
__global__ void check_k(const double* __restrict__ x, long long n, double gold, double tol,
                        unsigned long long* bad, unsigned* max_err_bits) {
    unsigned long long local_bad = 0;
    float local_max = 0.0f;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        double err = fabs(x[i] - gold) / fabs(gold);
        if (!(err <= tol)) ++local_bad;  // NaN counts as bad
        local_max = fmaxf(local_max, static_cast<float>(err));
    }
    if (local_bad) atomicAdd(bad, local_bad);
    atomicMax(max_err_bits, __float_as_uint(local_max));
}

struct Golden { double a, b, c; };

// Replays the kernel sequence on scalars: what every element must hold after `num_iters` repetitions.
Golden golden(int num_iters) {
    Golden g{kStartA, kStartB, kStartC};
    for (int i = 0; i < num_iters; ++i) {
        g.c = g.a;
        g.b = kScalar * g.c;
        g.c = g.a + g.b;
        g.a = g.b + kScalar * g.c;
    }
    return g;
}

}  // namespace

std::map<std::string, ProbeResult> stream_run(int device, long long n_elements, int num_reps, int num_warmup) {
    if (n_elements < 2 || n_elements % 2 != 0)
        throw std::invalid_argument("stream: n_elements must be even and >= 2 (got " + std::to_string(n_elements) + ")");
    if (num_reps < 1 || num_warmup < 0) throw std::invalid_argument("stream: num_reps must be >= 1, num_warmup >= 0");
    DeviceContext ctx(device);
    const long long n2 = n_elements / 2;
    const size_t array_bytes = static_cast<size_t>(n_elements) * sizeof(double);
    ctx.ensure_free(3 * array_bytes, "stream (3 arrays of " + std::to_string(array_bytes) + " bytes)");
    DeviceBuffer A(ctx, array_bytes, "stream array a"), B(ctx, array_bytes, "stream array b"),
        C(ctx, array_bytes, "stream array c");
    double2 *a = A.as<double2>(), *b = B.as<double2>(), *c = C.as<double2>();
    const int grid = resident_grid(ctx, reinterpret_cast<const void*>(triad_k), kBlock);
    cudaStream_t s = ctx.stream();
    init_k<<<grid, kBlock, 0, s>>>(a, b, c, n2);
    CUDA_CHECK(cudaGetLastError());

    preload_kernels(copy_k, scale_k, add_k, triad_k, check_k);
    SpinGate gate;
    EventPair ev[4];
    std::map<std::string, ProbeResult> out;
    for (int rep = 0; rep < num_warmup + num_reps; ++rep) {
        gate.hold(s);
        ev[0].start(s); copy_k<<<grid, kBlock, 0, s>>>(a, c, n2); ev[0].stop(s);
        ev[1].start(s); scale_k<<<grid, kBlock, 0, s>>>(b, c, kScalar, n2); ev[1].stop(s);
        ev[2].start(s); add_k<<<grid, kBlock, 0, s>>>(a, b, c, n2); ev[2].stop(s);
        ev[3].start(s); triad_k<<<grid, kBlock, 0, s>>>(a, b, c, kScalar, n2); ev[3].stop(s);
        CUDA_CHECK(cudaGetLastError());
        gate.release();
        ctx.sync();
        gate.check();
        if (rep >= num_warmup)
            for (int k = 0; k < 4; ++k) out[kKernels[k]].times_s.push_back(ev[k].seconds());
    }

    // Golden-value check of all three arrays on the device.
    const Golden g = golden(num_warmup + num_reps);
    DeviceBuffer scratch(ctx, sizeof(unsigned long long) + sizeof(unsigned), "stream check counters");
    unsigned long long* bad_dev = scratch.as<unsigned long long>();
    unsigned* err_dev = reinterpret_cast<unsigned*>(bad_dev + 1);
    const double tol = 1e-10;  // device FMA contraction differs from the host replay by ulps, growing per rep
    std::string msg;
    bool ok = true;
    const double golds[3] = {g.a, g.b, g.c};
    const double2* arrays[3] = {a, b, c};
    for (int k = 0; k < 3; ++k) {
        CUDA_CHECK(cudaMemsetAsync(scratch.as<void>(), 0, scratch.bytes(), s));
        check_k<<<grid, kBlock, 0, s>>>(reinterpret_cast<const double*>(arrays[k]), n_elements, golds[k], tol,
                                         bad_dev, err_dev);
        CUDA_CHECK(cudaGetLastError());
        unsigned long long bad = 0;
        unsigned err_bits = 0;
        CUDA_CHECK(cudaMemcpyAsync(&bad, bad_dev, sizeof(bad), cudaMemcpyDeviceToHost, s));
        CUDA_CHECK(cudaMemcpyAsync(&err_bits, err_dev, sizeof(err_bits), cudaMemcpyDeviceToHost, s));
        ctx.sync();
        float max_err;
        memcpy(&max_err, &err_bits, sizeof(max_err));
        msg += strfmt("%s%c: %llu of %lld off golden %g (max rel err %g)", k ? "; " : "", "abc"[k], bad, n_elements,
                      golds[k], static_cast<double>(max_err));
        ok = ok && bad == 0;
    }
    for (int k = 0; k < 4; ++k) {
        ProbeResult& r = out[kKernels[k]];
        r.valid = ok;
        r.check = "golden replay, rel tol 1e-10: " + msg;
        r.info["n_elements"] = static_cast<double>(n_elements);
        r.info["array_bytes"] = static_cast<double>(array_bytes);
        r.info["bytes"] = static_cast<double>(kArraysMoved[k]) * static_cast<double>(array_bytes);
        r.info["grid"] = grid;
        r.info["block"] = kBlock;
    }
    return out;
}

}  // namespace gpubench
