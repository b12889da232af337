// The native vector type and its FMA, chosen at compile time from the ISA the extension is built
// for (-march=native unless GPUBENCH_NATIVE=0). GCC vector extensions for loads/adds; explicit FMA
// intrinsics, because -std=c++17 (not gnu++17) turns off FP contraction so `a*b+c` would not fuse.
#pragma once
#include <cmath>
#include <cstddef>
#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif

namespace gpubench {

#if defined(__AVX512F__)
constexpr int kVecBytes = 64;
constexpr const char* kIsa = "avx512f";
#elif defined(__AVX__)
constexpr int kVecBytes = 32;
#if defined(__FMA__)
constexpr const char* kIsa = "avx2+fma";
#else
constexpr const char* kIsa = "avx (no fma: mul+add)";
#endif
#else
constexpr int kVecBytes = 16;
constexpr const char* kIsa = "generic 128-bit (std::fma per lane)";
#endif

typedef double vdouble __attribute__((vector_size(kVecBytes)));
typedef float vfloat __attribute__((vector_size(kVecBytes)));
constexpr int kLanes64 = kVecBytes / 8;
constexpr int kLanes32 = kVecBytes / 4;

inline vdouble fmadd(vdouble a, vdouble b, vdouble c) {
#if defined(__AVX512F__)
    return (vdouble)_mm512_fmadd_pd((__m512d)a, (__m512d)b, (__m512d)c);
#elif defined(__AVX__) && defined(__FMA__)
    return (vdouble)_mm256_fmadd_pd((__m256d)a, (__m256d)b, (__m256d)c);
#else
    vdouble r;
    for (int i = 0; i < kLanes64; i++) r[i] = std::fma(a[i], b[i], c[i]);
    return r;
#endif
}

inline vfloat fmadd(vfloat a, vfloat b, vfloat c) {
#if defined(__AVX512F__)
    return (vfloat)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__AVX__) && defined(__FMA__)
    return (vfloat)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    vfloat r;
    for (int i = 0; i < kLanes32; i++) r[i] = std::fma(a[i], b[i], c[i]);
    return r;
#endif
}

}  // namespace gpubench
