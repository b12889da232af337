// Cache sweep: read bandwidth vs working set, all threads, each reading its own contiguous slice.
//   warm: repeated passes over the same buffer inside one parallel region (one untimed warm-up
//         pass first), so the slice stays in whatever cache level holds it;
//   cold: before every timed pass each thread writes its slice of a flush buffer (>= 2x LLC, the
//         caller's choice) so the working set has been evicted; then one timed pass.
// Both time the team window (first thread start after a barrier .. last thread end, TeamWindow),
// so OpenMP fork/join and thread wake-up are not counted as memory time.
// The read kernel keeps 8 independent vector accumulators (so it is bandwidth-bound, not add-latency
// bound) and returns the sum, which is checked exactly: the data are small integers, whose sums
// are exact in fp64, so any skipped or repeated element shows.
#include <omp.h>

#include <algorithm>

#include "probes.h"
#include "simd.h"

namespace gpubench {

namespace {

constexpr size_t kBlock = 64;  // elements per slice unit: 512 B, a multiple of 8 vectors

void fill_pattern(double* x, size_t n) {
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) x[i] = (double)(i % 7 + 1);
}

double pattern_sum(size_t n) {
    size_t full = n / 7;
    double s = (double)full * 28.0;
    for (size_t i = full * 7; i < n; i++) s += (double)(i % 7 + 1);
    return s;
}

// [begin, end) of thread t's slice, in whole kBlock units.
void slice(size_t n, int t, int nt, size_t* begin, size_t* end) {
    size_t nblocks = n / kBlock;
    size_t per = (nblocks + nt - 1) / nt;
    *begin = std::min(nblocks, per * t) * kBlock;
    *end = std::min(nblocks, per * (t + 1)) * kBlock;
}

double read_slice(const double* x, size_t begin, size_t end, int passes) {
    constexpr int W = kLanes64;
    vdouble acc[8] = {};
    for (int p = 0; p < passes; p++) {
        for (size_t i = begin; i < end; i += 8 * W) {
            const vdouble* v = reinterpret_cast<const vdouble*>(x + i);
            acc[0] += v[0];
            acc[1] += v[1];
            acc[2] += v[2];
            acc[3] += v[3];
            acc[4] += v[4];
            acc[5] += v[5];
            acc[6] += v[6];
            acc[7] += v[7];
        }
    }
    vdouble t = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    double s = 0;
    for (int l = 0; l < W; l++) s += t[l];
    return s;
}

}  // namespace

CacheSweepResult cache_read_warm(size_t working_set_bytes, int passes, int num_reps) {
    CacheSweepResult r;
    size_t n = std::max(kBlock, working_set_bytes / sizeof(double) / kBlock * kBlock);
    AlignedBuffer X(n);
    fill_pattern(X.data, n);
    const double* x = X.data;
    r.threads = omp_get_max_threads();
    r.expected = pattern_sum(n) * passes;
    r.valid = true;
    double s = 0;
#pragma omp parallel reduction(+ : s)
    {
        size_t b, e;
        slice(n, omp_get_thread_num(), omp_get_num_threads(), &b, &e);
        s += read_slice(x, b, e, 1);  // warm-up pass, untimed
    }
    for (int k = 0; k < num_reps; k++) {
        s = 0;
        TeamWindow w(r.threads);
#pragma omp parallel reduction(+ : s)
        {
            int t = omp_get_thread_num();
            size_t b, e;
            slice(n, t, omp_get_num_threads(), &b, &e);
#pragma omp barrier
            w.start[t] = Clock::now();
            s += read_slice(x, b, e, passes);
            w.end[t] = Clock::now();
        }
        r.times_s.push_back(w.seconds());
        r.checksum = s;
        if (s != r.expected) r.valid = false;
    }
    return r;
}

CacheSweepResult cache_read_cold(size_t working_set_bytes, size_t flush_bytes, int num_reps) {
    CacheSweepResult r;
    size_t n = std::max(kBlock, working_set_bytes / sizeof(double) / kBlock * kBlock);
    size_t nf = std::max(kBlock, flush_bytes / sizeof(double) / kBlock * kBlock);
    AlignedBuffer X(n), F(nf);
    fill_pattern(X.data, n);
    fill_pattern(F.data, nf);
    const double* x = X.data;
    double* f = F.data;
    r.threads = omp_get_max_threads();
    r.expected = pattern_sum(n);
    r.valid = true;
    for (int k = 0; k < num_reps; k++) {
        double s = 0;
        TeamWindow w(r.threads);
#pragma omp parallel reduction(+ : s)
        {
            int t = omp_get_thread_num(), nt = omp_get_num_threads();
            size_t fb, fe, b, e;
            slice(nf, t, nt, &fb, &fe);
            for (size_t i = fb; i < fe; i++) f[i] += 1.0;  // evict: dirty every line of the flush buffer
            slice(n, t, nt, &b, &e);
#pragma omp barrier
            w.start[t] = Clock::now();
            s += read_slice(x, b, e, 1);
            w.end[t] = Clock::now();
        }
        r.times_s.push_back(w.seconds());
        r.checksum = s;
        if (s != r.expected) r.valid = false;
    }
    return r;
}

}  // namespace gpubench
