// Peak FMA throughput with data in registers, all threads, native vector width. Each repetition
// is timed as the team window (first thread start .. last thread end, see TeamWindow).
// Each thread runs kAcc independent FMA chains acc = acc * m + a (one vector register each). With
// FMA latency 4-5 cycles and 2 FMA pipes a core needs >= 8-10 chains in flight; 12 (16 with
// AVX-512's 32 registers) keeps both pipes busy while leaving registers for m and a.
// Nothing can be elided: every chain feeds the checksum, which is compared with the closed form
// x_n = L + m^n (x_0 - L), L = a / (1 - m).
#include <omp.h>

#include <algorithm>
#include <cmath>

#include "probes.h"
#include "simd.h"

namespace gpubench {

namespace {

#if defined(__AVX512F__)
constexpr int kAcc = 16;
#else
constexpr int kAcc = 12;
#endif

template <typename V, typename T, int LANES>
double chains(int64_t iters, T m, T a, T x0_base) {
    V acc[kAcc];
    V mv, av;
    for (int l = 0; l < LANES; l++) {
        mv[l] = m;
        av[l] = a;
    }
    for (int k = 0; k < kAcc; k++)
        for (int l = 0; l < LANES; l++) acc[k][l] = x0_base + (T)(k * LANES + l) * (T)0.001;
    for (int64_t it = 0; it < iters; it++) {
#pragma GCC unroll 16
        for (int k = 0; k < kAcc; k++) acc[k] = fmadd(acc[k], mv, av);
    }
    double s = 0;
    for (int k = 0; k < kAcc; k++)
        for (int l = 0; l < LANES; l++) s += (double)acc[k][l];
    return s;
}

template <typename V, typename T, int LANES>
PeakResult peak(int64_t iters, int num_reps, double rel_tol) {
    PeakResult r;
    // m = 1 - 2^-10 and a = 2^-10 are exact in fp32 and fp64; the fixed point is L = 1.
    const T m = (T)(1.0 - std::ldexp(1.0, -10)), a = (T)std::ldexp(1.0, -10);
    r.threads = omp_get_max_threads();
    r.lanes = LANES;
    r.accumulators = kAcc;
    r.isa = kIsa;
    r.flops_per_rep = 2.0 * (double)iters * kAcc * LANES * r.threads;
    r.valid = true;
    const double md = (double)m, L = (double)a / (1.0 - md), decay = std::pow(md, (double)iters);
    for (int k = 0; k < num_reps; k++) {
        double s = 0, expected = 0;
        TeamWindow w(r.threads);
#pragma omp parallel reduction(+ : s)
        {
            int t = omp_get_thread_num();
#pragma omp barrier
            w.start[t] = Clock::now();
            s += chains<V, T, LANES>(iters, m, a, (T)(2.0 + 0.5 * t));
            w.end[t] = Clock::now();
        }
        r.times_s.push_back(w.seconds());
        if (r.thread_best_s.empty()) r.thread_best_s.assign(r.threads, 1e300);
        for (int t = 0; t < r.threads; t++)
            r.thread_best_s[t] = std::min(r.thread_best_s[t],
                                          std::chrono::duration<double>(w.end[t] - w.start[t]).count());
        for (int t = 0; t < r.threads; t++)
            for (int i = 0; i < kAcc * LANES; i++) {
                double x0 = (double)(T)((T)(2.0 + 0.5 * t) + (T)i * (T)0.001);
                expected += L + decay * (x0 - L);
            }
        r.checksum = s;
        r.expected = expected;
        if (!(std::fabs(s - expected) <= rel_tol * std::fabs(expected))) r.valid = false;
    }
    return r;
}

}  // namespace

PeakResult peak_fma_fp64(int64_t iters, int num_reps) {
    return peak<vdouble, double, kLanes64>(iters, num_reps, 1e-9);
}

PeakResult peak_fma_fp32(int64_t iters, int num_reps) {
    // fp32 chains settle within ~ulp(1)/(2(1-m)) = 2^-24 * 2^9 of L: 1e-3 is comfortably loose.
    return peak<vfloat, float, kLanes32>(iters, num_reps, 1e-3);
}

}  // namespace gpubench

namespace gpubench {

// Effective core clock: a chain of dependent integer adds retires one add per cycle on every
// x86-64 core (1-cycle latency), so adds / second = cycles / second. Single thread, the loop
// counter runs beside the chain. Used to state the clock behind the FMA peak when the OS only
// reports a nominal figure (VMs without cpufreq). The addend is a register, not an immediate:
// Intel cores since Golden Cove fold chains of add-immediate at rename and retire several per
// cycle (measured here on a Xeon, model 207: `add $1` read 7,000 MHz, `add reg` 2,470 MHz, the
// same as a 3-cycle imul chain).
std::vector<double> dependent_add_seconds(int64_t iters, int num_reps) {
    std::vector<double> times;
    for (int k = 0; k < num_reps; k++) {
        uint64_t x = (uint64_t)k;
        uint64_t one = 1;
        asm volatile("" : "+r"(one));  // the compiler may not know the addend is 1
        auto t0 = Clock::now();
        for (int64_t i = 0; i < iters; i++) {
#if defined(__x86_64__)
            asm volatile(
                "add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\t"
                "add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\t"
                "add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\t"
                "add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\t"
                "add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\t"
                "add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\t"
                "add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\t"
                "add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\t"
                : "+r"(x)
                : "r"(one));
#else
            for (int j = 0; j < 32; j++) asm volatile("" : "+r"(x) : : );
            x += 32;
#endif
        }
        times.push_back(seconds_since(t0));
        if (x != (uint64_t)k + 32 * (uint64_t)iters) times.back() = -1.0;  // chain broken: invalid
    }
    return times;
}

}  // namespace gpubench
