// peak probe: compute ceilings with every operand in registers.
//
//   bf16, fp16  mma.sync m16n8k16, fp32 accumulate   4096 FLOP per warp-instruction
//   tf32        mma.sync m16n8k8,  fp32 accumulate   2048
//   fp8 (e4m3)  mma.sync m16n8k32, fp32 accumulate   8192  (sm_89+; "skipped" below)
//   fp32        fma.rn.f32 on CUDA cores             2 per thread-instruction
//
// kChains independent accumulators per thread keep the pipes full. Each iteration applies B then -B
// to every accumulator, so a timed run of any length must return every accumulator to its start
// value exactly (nonzero operands, exact in fp32 even with reduced-precision accumulation); a short
// validation run applies +B twice instead and must land on start + 2 x iters x K x a x b exactly.
// NOTE: on Hopper, mma.sync reaches well under the wgmma peak (wgmma needs sm_90a and operands in
// shared memory); docs/cuda.md says so. fp8 mma.sync is not measured on Hopper at all: there it is
// emulated (see peak_supported). scripts/check_sass.py counts the tensor-core instructions of every
// loop in the compiled code, so an emulated or eliminated loop fails CI.
#include <cstring>
#include "common.cuh"

namespace gpubench {
namespace {

constexpr int kChains = 8;
constexpr int kBlock = 256;

enum Dtype { BF16 = 0, FP16 = 1, TF32 = 2, FP8 = 3, FP32 = 4 };

struct DtypeInfo {
    const char* name;
    int k;             // mma K (elements summed per output per instruction); 1 for fp32 FMA
    double flops;      // per instruction per warp (mma) or per thread (fma)
    unsigned a_bits;   // register image of a = 1.0 (packed)
    unsigned b_bits;   // register image of b (packed)
    unsigned neg_b;    // xor mask that negates every element of b
    double a, b;       // element values
    int min_cc;
};

// a = 1, b = 2^-8 (2^-6 for fp8, whose smallest normal is 2^-6): products and partial sums are exact.
const DtypeInfo kInfo[5] = {
    {"bf16", 16, 2.0 * 16 * 8 * 16, 0x3F803F80u, 0x3B803B80u, 0x80008000u, 1.0, 1.0 / 256, 80},
    {"fp16", 16, 2.0 * 16 * 8 * 16, 0x3C003C00u, 0x1C001C00u, 0x80008000u, 1.0, 1.0 / 256, 80},
    {"tf32", 8, 2.0 * 16 * 8 * 8, 0x3F800000u, 0x3B800000u, 0x80000000u, 1.0, 1.0 / 256, 80},
    {"fp8", 32, 2.0 * 16 * 8 * 32, 0x38383838u, 0x08080808u, 0x80808080u, 1.0, 1.0 / 64, 89},
    {"fp32", 1, 2.0, 0x3F800000u, 0x3B800000u, 0x80000000u, 1.0, 1.0 / 256, 0},
};

// fp8 mma.sync compiles to tensor-core QMMA on Ada (8.9) and consumer Blackwell (12.x) only.
bool fp8_mma_native(int cc) { return cc == 89 || cc / 10 == 12; }

// A zero the compiler cannot prove uniform across the warp: threadIdx times (x - x) for a runtime
// x (IEEE forbids folding x - x: it is NaN for x = inf or NaN). Added to the accumulators' start
// values, it keeps them per-thread: with uniform operands and accumulators ptxas moves an FMA loop
// to the uniform datapath (UFFMA on sm_120: one lane's work per warp). `and laneid, 0` does not do:
// ptxas folds it.
__device__ __forceinline__ float thread_zero(float x) { return static_cast<float>(threadIdx.x) * (x - x); }

int dtype_index(const std::string& dtype) {
    for (int i = 0; i < 5; ++i)
        if (dtype == kInfo[i].name) return i;
    throw std::invalid_argument("peak: dtype must be bf16, fp16, tf32, fp8 or fp32 (got '" + dtype + "')");
}

template <int DT>
__device__ __forceinline__ void mma(float (&d)[4], unsigned a, unsigned b) {
    if constexpr (DT == BF16) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%4,%4,%4}, {%5,%5}, {%0,%1,%2,%3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a), "r"(b));
    } else if constexpr (DT == FP16) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%4,%4,%4}, {%5,%5}, {%0,%1,%2,%3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a), "r"(b));
    } else if constexpr (DT == TF32) {
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%4,%4,%4}, {%5,%5}, {%0,%1,%2,%3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a), "r"(b));
    } else if constexpr (DT == FP8) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
        asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%4,%4,%4}, {%5,%5}, {%0,%1,%2,%3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a), "r"(b));
#endif
    }
}

// Tensor-core loop. Returns, per thread, the number of accumulator values that are not `expect`.
template <int DT>
__global__ void __launch_bounds__(kBlock) mma_loop_k(unsigned a, unsigned b0, unsigned b1, long long iters,
                                                   float start, float expect, unsigned long long* bad, int* unsupported) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
    if (DT == FP8) {  // this arch has no fp8 mma: say so instead of timing nothing
        if (threadIdx.x == 0 && blockIdx.x == 0) *unsupported = 1;
        return;
    }
#endif
    float acc[kChains][4];
    const float zero = thread_zero(start);
#pragma unroll
    for (int c = 0; c < kChains; ++c)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[c][j] = start + c + zero;
    for (long long it = 0; it < iters; ++it) {
        // Opaque operands: the compiler must not treat a and b as loop-invariant, or it may compute
        // a product once and hoist it out of the chains (ptxas does exactly that when it emulates
        // an mma, e.g. fp8 mma.sync on Hopper), leaving the timed loop with adds only.
        asm volatile("" : "+r"(a), "+r"(b0), "+r"(b1));
#pragma unroll
        for (int c = 0; c < kChains; ++c) mma<DT>(acc[c], a, b0);
#pragma unroll
        for (int c = 0; c < kChains; ++c) mma<DT>(acc[c], a, b1);
    }
    unsigned long long local_bad = 0;
#pragma unroll
    for (int c = 0; c < kChains; ++c)
#pragma unroll
        for (int j = 0; j < 4; ++j) local_bad += acc[c][j] != expect + c;
    if (local_bad) atomicAdd(bad, local_bad);
}

// CUDA-core loop: fused multiply-adds with the same +b/-b scheme, kChains x 4 chains per thread.
__global__ void __launch_bounds__(kBlock) fma_loop_k(float a, float b0, float b1, long long iters, float start,
                                                   float expect, unsigned long long* bad) {
    float acc[kChains * 4];
    const float zero = thread_zero(a);
#pragma unroll
    for (int c = 0; c < kChains * 4; ++c) acc[c] = start + (c % kChains) + zero;
    for (long long it = 0; it < iters; ++it) {
        asm volatile("" : "+f"(a), "+f"(b0), "+f"(b1));  // opaque operands (see mma_loop_k)
#pragma unroll
        for (int c = 0; c < kChains * 4; ++c) asm volatile("fma.rn.f32 %0, %1, %2, %0;" : "+f"(acc[c]) : "f"(a), "f"(b0));
#pragma unroll
        for (int c = 0; c < kChains * 4; ++c) asm volatile("fma.rn.f32 %0, %1, %2, %0;" : "+f"(acc[c]) : "f"(a), "f"(b1));
    }
    unsigned long long local_bad = 0;
#pragma unroll
    for (int c = 0; c < kChains * 4; ++c) local_bad += acc[c] != expect + (c % kChains);
    if (local_bad) atomicAdd(bad, local_bad);
}

float bits_to_float(unsigned u) { float f; std::memcpy(&f, &u, sizeof f); return f; }

const void* kernel_of(int dt) {
    switch (dt) {
        case BF16: return reinterpret_cast<const void*>(mma_loop_k<BF16>);
        case FP16: return reinterpret_cast<const void*>(mma_loop_k<FP16>);
        case TF32: return reinterpret_cast<const void*>(mma_loop_k<TF32>);
        case FP8: return reinterpret_cast<const void*>(mma_loop_k<FP8>);
        default: return reinterpret_cast<const void*>(fma_loop_k);
    }
}

// One launch of the loop for dtype dt; negate=true is the timed +B/-B form.
void launch_loop(int dt, int grid, cudaStream_t s, long long iters, bool negate, float start, float expect,
                 unsigned long long* bad, int* unsupported) {
    const DtypeInfo& d = kInfo[dt];
    const unsigned b1 = negate ? d.b_bits ^ d.neg_b : d.b_bits;
    switch (dt) {
        case BF16: mma_loop_k<BF16><<<grid, kBlock, 0, s>>>(d.a_bits, d.b_bits, b1, iters, start, expect, bad, unsupported); break;
        case FP16: mma_loop_k<FP16><<<grid, kBlock, 0, s>>>(d.a_bits, d.b_bits, b1, iters, start, expect, bad, unsupported); break;
        case TF32: mma_loop_k<TF32><<<grid, kBlock, 0, s>>>(d.a_bits, d.b_bits, b1, iters, start, expect, bad, unsupported); break;
        case FP8: mma_loop_k<FP8><<<grid, kBlock, 0, s>>>(d.a_bits, d.b_bits, b1, iters, start, expect, bad, unsupported); break;
        default:
            fma_loop_k<<<grid, kBlock, 0, s>>>(bits_to_float(d.a_bits), bits_to_float(d.b_bits), bits_to_float(b1), iters,
                                               start, expect, bad);
    }
    CUDA_CHECK(cudaGetLastError());
}

}  // namespace

std::pair<bool, std::string> peak_supported(int device, const std::string& dtype) {
    const int dt = dtype_index(dtype);
    DeviceContext ctx(device);
    if (dt == FP8 && !fp8_mma_native(ctx.cc())) {
        // On sm_90a and sm_100, mma.sync e4m3 compiles to unpack + fp16 HMMA + FADD (the SASS check
        // shows 8-16 HMMA against hundreds of FADD): the row would read ~100 % of the fp8 spec while
        // the tensor cores do a fraction of the counted work. There fp8 runs through wgmma/tcgen05.
        return {false, strfmt("fp8 mma.sync is emulated on compute capability %d.%d (native QMMA only on 8.9 and "
                              "12.x; Hopper's fp8 path is wgmma e4m3)", ctx.cc() / 10, ctx.cc() % 10)};
    }
    if (ctx.cc() < kInfo[dt].min_cc) {
        return {false, strfmt("%s mma needs compute capability %d.%d+ (this device is %d.%d)", dtype.c_str(),
                              kInfo[dt].min_cc / 10, kInfo[dt].min_cc % 10, ctx.cc() / 10, ctx.cc() % 10)};
    }
    return {true, ""};
}

ProbeResult peak_run(int device, const std::string& dtype, int num_reps, int num_warmup, double target_s) {
    const int dt = dtype_index(dtype);
    if (num_reps < 1 || num_warmup < 0 || !(target_s > 0))
        throw std::invalid_argument("peak: num_reps must be >= 1, num_warmup >= 0, target_s > 0");
    ProbeResult r;
    auto sup = peak_supported(device, dtype);
    r.info["supported"] = sup.first ? 1.0 : 0.0;
    if (!sup.first) {
        r.check = "skipped: " + sup.second;
        return r;
    }
    DeviceContext ctx(device);
    cudaStream_t s = ctx.stream();
    DeviceBuffer flags(ctx, sizeof(unsigned long long) + sizeof(int), "peak flags");
    unsigned long long* bad = flags.as<unsigned long long>();
    int* unsupported = reinterpret_cast<int*>(bad + 1);
    const int grid = resident_grid(ctx, kernel_of(dt), kBlock);
    const DtypeInfo& d = kInfo[dt];
    const float start = 1.0f;
    auto read_flags = [&](unsigned long long& nbad, int& unsup) {
        CUDA_CHECK(cudaMemcpyAsync(&nbad, bad, sizeof(nbad), cudaMemcpyDeviceToHost, s));
        CUDA_CHECK(cudaMemcpyAsync(&unsup, unsupported, sizeof(unsup), cudaMemcpyDeviceToHost, s));
        ctx.sync();
    };
    // 1. Validation: +B twice per iteration for a short run must land on an exact value.
    const long long check_iters = 64;
    const float inc = static_cast<float>(d.k * d.a * d.b);  // per instruction, per accumulator
    const float expect_check = start + 2.0f * check_iters * inc;
    CUDA_CHECK(cudaMemsetAsync(flags.as<void>(), 0, flags.bytes(), s));
    launch_loop(dt, grid, s, check_iters, false, start, expect_check, bad, unsupported);
    unsigned long long nbad_check = 0;
    int unsup = 0;
    read_flags(nbad_check, unsup);
    if (unsup) {  // the binary has no code for this arch (e.g. fp8 in a build without sm_89+)
        r.info["supported"] = 0.0;
        r.check = "skipped: " + dtype + " mma is not in this build's code for this device";
        return r;
    }
    // 2. Size a repetition from a short timed run so it lasts about target_s.
    EventPair ev;
    const long long iters = size_iters_for(ctx, ev, 256, target_s, [&](long long n) {
        launch_loop(dt, grid, s, n, true, start, start, bad, unsupported);
    });
    // 3. Timed repetitions (+B/-B: every accumulator must come back to its start value).
    CUDA_CHECK(cudaMemsetAsync(flags.as<void>(), 0, flags.bytes(), s));
    for (int rep = 0; rep < num_warmup + num_reps; ++rep) {
        ev.start(s);
        launch_loop(dt, grid, s, iters, true, start, start, bad, unsupported);
        ev.stop(s);
        ctx.sync();
        if (rep >= num_warmup) r.times_s.push_back(ev.seconds());
    }
    unsigned long long nbad_timed = 0;
    read_flags(nbad_timed, unsup);
    const double threads = static_cast<double>(grid) * kBlock;
    const bool tensor = dt != FP32;
    const double instr_per_iter = 2.0 * kChains * (tensor ? 1 : 4);
    const double per_unit = tensor ? threads / 32.0 : threads;  // warps issue mma, threads issue fma
    r.info["flops"] = per_unit * instr_per_iter * static_cast<double>(iters) * d.flops;
    r.info["iters"] = static_cast<double>(iters);
    r.info["grid"] = grid;
    r.info["block"] = kBlock;
    r.info["chains"] = kChains;
    r.valid = nbad_check == 0 && nbad_timed == 0;
    r.check = strfmt("exact accumulators: validation run (+B,+B x %lld) %llu off; timed runs (+B,-B) %llu off",
                     check_iters, nbad_check, nbad_timed);
    return r;
}

}  // namespace gpubench
