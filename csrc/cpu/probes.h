// Shared declarations of gpubench's compiled CPU probes. Every probe is blocking and returns
// per-repetition seconds measured with std::chrono::steady_clock around the timed region only.
#pragma once
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>
#include <omp.h>

namespace gpubench {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Team window of one parallel region: every thread stamps its own start (after a barrier, so
// the team is awake) and end; the window is first start .. last end. It excludes the fork/join
// and wake-up latency (the launch probe's subject, and on a shared machine a scheduler delay of
// milliseconds) but includes any descheduling while the threads work.
struct TeamWindow {
    std::vector<Clock::time_point> start, end;
    explicit TeamWindow(int num_threads) : start(num_threads), end(num_threads) {}
    double seconds() const {
        auto s = start[0], e = end[0];
        for (size_t i = 1; i < start.size(); i++) {
            if (start[i] < s) s = start[i];
            if (end[i] > e) e = end[i];
        }
        return std::chrono::duration<double>(e - s).count();
    }
};

// 64-byte aligned, uninitialized array of doubles (first touch is the caller's, in parallel).
struct AlignedBuffer {
    double* data = nullptr;
    size_t n = 0;
    explicit AlignedBuffer(size_t n_elements);
    ~AlignedBuffer();
    AlignedBuffer(const AlignedBuffer&) = delete;
    AlignedBuffer& operator=(const AlignedBuffer&) = delete;
};

// ---- stream.cpp
struct StreamResult {
    std::vector<double> copy_s, scale_s, add_s, triad_s;  // per repetition
    bool valid = false;
    std::string reason;  // why validation failed (empty when valid)
    double rel_err_a = 0, rel_err_b = 0, rel_err_c = 0;  // STREAM's avg |err| / |expected|
    size_t num_bad_elements = 0;
    int threads = 0;
};
// corrupt: debug hook. 0 none; 1/2/3 overwrites one element of a/b/c after the timed loop,
// before validation, so the test can check that validation catches it.
StreamResult stream_run(size_t n_elements, int num_reps, int corrupt);

// ---- cache.cpp
struct CacheSweepResult {
    std::vector<double> times_s;  // per repetition (warm: `passes` passes; cold: one pass)
    bool valid = false;
    double checksum = 0, expected = 0;
    int threads = 0;
};
CacheSweepResult cache_read_warm(size_t working_set_bytes, int passes, int num_reps);
CacheSweepResult cache_read_cold(size_t working_set_bytes, size_t flush_bytes, int num_reps);

// ---- peak.cpp
struct PeakResult {
    std::vector<double> times_s;
    bool valid = false;
    double checksum = 0, expected = 0;
    int threads = 0, lanes = 0, accumulators = 0;
    double flops_per_rep = 0;
    std::vector<double> thread_best_s;  // each thread's own fastest repetition (diagnostic)
    std::string isa;
};
PeakResult peak_fma_fp64(int64_t iters, int num_reps);
PeakResult peak_fma_fp32(int64_t iters, int num_reps);
// 32 dependent integer adds per iteration (1 cycle each): cycles = 32 * iters.
std::vector<double> dependent_add_seconds(int64_t iters, int num_reps);

// ---- launch.cpp
std::vector<double> omp_fork_join(int count, int num_reps);
void debug_segfault();
void debug_abort();

}  // namespace gpubench
