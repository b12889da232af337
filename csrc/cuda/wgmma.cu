// peak probe, Hopper path: wgmma (warpgroup MMA, sm_90a), bf16 and fp8 e4m3 with fp32 accumulate.
//
// mma.sync cannot reach Hopper's tensor-core peak; wgmma can. One warpgroup (128 threads) issues
// wgmma.mma_async m64n128k16 (bf16) or m64n128k32 (e4m3): A (all 1.0) from registers, B (every element
// 2^-8 in bf16, 2^-6 in e4m3) from shared memory through a matrix descriptor, D = 64 fp32 accumulators
// per thread. On Hopper fp8 reaches its tensor-core peak only through wgmma (mma.sync e4m3 is emulated).
// Because every element of B is the same value, the result does not depend on how the descriptor's
// layout maps B onto shared memory (no swizzle; the strides only have to stay inside the buffer),
// so the check stays exact: each iteration applies +B then -B (imm-scale-b = -1), and every
// accumulator must come back to its start value; a short +B,+B run must land on start + 2 x iters x K x B.
// Each group of 16 wgmmas is fenced, committed and waited for (wait_group 0): with a group left in
// flight across the loop's back edge ptxas serializes every wgmma (warning C7515). Three warpgroups
// resident per SM (158 registers a thread) overlap one another's drains.
//
// Compiled only for sm_90a (GPUBENCH_CUDA_ARCHS="90a"); any other build reports it unsupported.
#include <cstdint>
#include "common.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GPUBENCH_WGMMA 1
#endif

namespace gpubench {
namespace {

constexpr int kThreads = 128;          // one warpgroup per block
constexpr int kPairsPerGroup = 8;      // +B,-B pairs per commit group

#ifdef GPUBENCH_WGMMA
constexpr int kSmemHalfs = 8192;               // 16 KiB of B (a 16x128 bf16 or 32x128 e4m3 tile needs 4 KiB)

// The 64 fp32 accumulators of one thread as asm operands 0-63; A's register is operand 64, B's
// descriptor 65 and the scale-d predicate's source 66.
#define GPUBENCH_WGMMA_D "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,"     \
    "%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51," \
    "%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"
#define GPUBENCH_WGMMA_OUT(d)                                                                                        \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),      \
    "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),           \
    "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),          \
    "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),          \
    "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),          \
    "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),          \
    "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),          \
    "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
// One wgmma with A from registers (the same 32-bit value in all four), B through its descriptor,
// scale-d = 1 (accumulate), imm-scale-a = 1 and SCALE_B: imm-scale-b (+1: add, -1: subtract), then
// imm-trans-b for the 16-bit types (fp8 takes none).
#define GPUBENCH_WGMMA_ASM(SHAPE_TYPES, SCALE_B)                                                                    \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                     \
                 "wgmma.mma_async.sync.aligned." SHAPE_TYPES " " GPUBENCH_WGMMA_D ", {%64, %64, %64, %64}, %65, p, 1, " \
                 SCALE_B ";\n}\n"                                                                                  \
                 : GPUBENCH_WGMMA_OUT(d) : "r"(a), "l"(desc_b), "r"(1))

// bf16: m64n128k16, A = 1.0 (two per register), every B element 2^-8: each wgmma adds 16 x 2^-8 = 1/16.
struct Bf16 {
    static constexpr unsigned kA = 0x3F803F80u;
    static constexpr unsigned short kB = 0x3B80;
    static constexpr int kK = 16;
    static __device__ __forceinline__ void pos(float (&d)[64], unsigned a, uint64_t desc_b) {
        GPUBENCH_WGMMA_ASM("m64n128k16.f32.bf16.bf16", "1, 0");
    }
    static __device__ __forceinline__ void neg(float (&d)[64], unsigned a, uint64_t desc_b) {
        GPUBENCH_WGMMA_ASM("m64n128k16.f32.bf16.bf16", "-1, 0");
    }
};
// fp8 e4m3: m64n128k32, A = 1.0 (0x38, four per register), every B element 2^-6 (0x08, the smallest
// normal): each wgmma adds 32 x 2^-6 = 1/2. fp8 operands take no transpose flags.
struct E4m3 {
    static constexpr unsigned kA = 0x38383838u;
    static constexpr unsigned short kB = 0x0808;
    static constexpr int kK = 32;
    static __device__ __forceinline__ void pos(float (&d)[64], unsigned a, uint64_t desc_b) {
        GPUBENCH_WGMMA_ASM("m64n128k32.f32.e4m3.e4m3", "1");
    }
    static __device__ __forceinline__ void neg(float (&d)[64], unsigned a, uint64_t desc_b) {
        GPUBENCH_WGMMA_ASM("m64n128k32.f32.e4m3.e4m3", "-1");
    }
};
#else
struct Bf16 { static constexpr int kK = 16; };
struct E4m3 { static constexpr int kK = 32; };
#endif

// negate != 0: timed form (+B,-B). Otherwise the validation form (+B,+B).
template <typename T>
__global__ void __launch_bounds__(kThreads) wgmma_loop_k(long long iters, int negate, float start, float expect,
                                                         unsigned long long* bad, int* unsupported) {
#ifdef GPUBENCH_WGMMA
    __shared__ __align__(1024) unsigned short b_tile[kSmemHalfs];
    for (int i = threadIdx.x; i < kSmemHalfs; i += blockDim.x) b_tile[i] = T::kB;
    __syncthreads();
    // Generic-proxy writes must be visible to the async proxy that wgmma reads shared memory with.
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(b_tile));
    // Matrix descriptor: start address >> 4 (bits 0-13), leading byte offset >> 4 (16-29),
    // stride byte offset >> 4 (32-45), no swizzle (62-63 = 0).
    const uint64_t desc = static_cast<uint64_t>((addr >> 4) & 0x3FFF) | (static_cast<uint64_t>(128 >> 4) << 16) |
                          (static_cast<uint64_t>(256 >> 4) << 32);
    float d[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) d[i] = start;
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    // Two loops rather than a branch inside one: the accumulators must not be touched between wgmmas.
    if (negate) {
        for (long long it = 0; it < iters; ++it) {
            asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
            for (int j = 0; j < kPairsPerGroup; ++j) {
                T::pos(d, T::kA, desc);
                T::neg(d, T::kA, desc);
            }
            asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        }
    } else {
        for (long long it = 0; it < iters; ++it) {
            asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
            for (int j = 0; j < 2 * kPairsPerGroup; ++j) T::pos(d, T::kA, desc);
            asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        }
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    unsigned long long local_bad = 0;
#pragma unroll
    for (int i = 0; i < 64; ++i) local_bad += d[i] != expect;
    if (local_bad) atomicAdd(bad, local_bad);
#else
    if (threadIdx.x == 0 && blockIdx.x == 0) *unsupported = 1;
#endif
}

template <typename T>
ProbeResult wgmma_run(int device, int num_reps, int num_warmup, double target_s) {
    ProbeResult r;
    DeviceContext ctx(device);
    r.info["supported"] = 0.0;
    if (ctx.cc() != 90) {
        r.check = strfmt("skipped: wgmma needs compute capability 9.0 (this device is %d.%d)", ctx.cc() / 10, ctx.cc() % 10);
        return r;
    }
    cudaStream_t s = ctx.stream();
    DeviceBuffer flags(ctx, sizeof(unsigned long long) + sizeof(int), "wgmma flags");
    unsigned long long* bad = flags.as<unsigned long long>();
    int* unsupported = reinterpret_cast<int*>(bad + 1);
    const int grid = resident_grid(ctx, reinterpret_cast<const void*>(wgmma_loop_k<T>), kThreads);
    const float start = 1.0f;
    auto launch = [&](long long iters, int negate, float expect) {
        wgmma_loop_k<T><<<grid, kThreads, 0, s>>>(iters, negate, start, expect, bad, unsupported);
        CUDA_CHECK(cudaGetLastError());
    };
    auto read_flags = [&](unsigned long long& nbad, int& unsup) {
        CUDA_CHECK(cudaMemcpyAsync(&nbad, bad, sizeof(nbad), cudaMemcpyDeviceToHost, s));
        CUDA_CHECK(cudaMemcpyAsync(&unsup, unsupported, sizeof(unsup), cudaMemcpyDeviceToHost, s));
        ctx.sync();
    };
    // 1. Validation: +B,+B; each wgmma adds K x 1 x B to every accumulator (1/16 in bf16, 1/2 in e4m3).
    const long long check_iters = 16;
    const float per_wgmma = T::kK == 16 ? 1.0f / 16.0f : 0.5f;
    const float expect_check = start + 2.0f * kPairsPerGroup * check_iters * per_wgmma;
    CUDA_CHECK(cudaMemsetAsync(flags.as<void>(), 0, flags.bytes(), s));
    launch(check_iters, 0, expect_check);
    unsigned long long nbad_check = 0;
    int unsup = 0;
    read_flags(nbad_check, unsup);
    if (unsup) {
        r.check = "skipped: this build has no sm_90a code (build with GPUBENCH_CUDA_ARCHS=\"90a\")";
        return r;
    }
    r.info["supported"] = 1.0;
    // 2. Size a repetition to about target_s.
    EventPair ev;
    const long long iters = size_iters_for(ctx, ev, 64, target_s, [&](long long n) { launch(n, 1, start); });
    // 3. Timed repetitions.
    CUDA_CHECK(cudaMemsetAsync(flags.as<void>(), 0, flags.bytes(), s));
    for (int rep = 0; rep < num_warmup + num_reps; ++rep) {
        ev.start(s);
        launch(iters, 1, start);
        ev.stop(s);
        ctx.sync();
        if (rep >= num_warmup) r.times_s.push_back(ev.seconds());
    }
    unsigned long long nbad_timed = 0;
    read_flags(nbad_timed, unsup);
    r.info["flops"] = static_cast<double>(grid) * 2.0 * kPairsPerGroup * static_cast<double>(iters) * 2.0 * 64 * 128 * T::kK;
    r.info["iters"] = static_cast<double>(iters);
    r.info["grid"] = grid;
    r.info["block"] = kThreads;
    r.valid = nbad_check == 0 && nbad_timed == 0;
    r.check = strfmt("exact accumulators: validation run (+B,+B x %lld) %llu off; timed runs (+B,-B) %llu off",
                     check_iters * kPairsPerGroup, nbad_check, nbad_timed);
    return r;
}

}  // namespace

ProbeResult peak_wgmma_run(int device, const std::string& dtype, int num_reps, int num_warmup, double target_s) {
    if (num_reps < 1 || num_warmup < 0 || !(target_s > 0))
        throw std::invalid_argument("peak_wgmma: num_reps must be >= 1, num_warmup >= 0, target_s > 0");
    if (dtype == "bf16") return wgmma_run<Bf16>(device, num_reps, num_warmup, target_s);
    if (dtype == "fp8") return wgmma_run<E4m3>(device, num_reps, num_warmup, target_s);
    throw std::invalid_argument("peak_wgmma: dtype must be bf16 or fp8 (got '" + dtype + "')");
}

}  // namespace gpubench
