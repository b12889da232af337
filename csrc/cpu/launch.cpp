// Launch costs on the CPU: an OpenMP parallel region is the CPU's "kernel launch" (fork the team,
// run an empty body, join at the implicit barrier). Plus debug hooks that crash the process on
// purpose, used by the fault-isolation tests.
#include <omp.h>

#include <csignal>
#include <cstdlib>

#include "probes.h"

namespace gpubench {

std::vector<double> omp_fork_join(int count, int num_reps) {
    std::vector<double> times;
    volatile int sink = 0;
    for (int k = 0; k < num_reps; k++) {
        auto t0 = Clock::now();
        for (int i = 0; i < count; i++) {
#pragma omp parallel
            {
                // An empty body the compiler cannot drop; GOMP still forks and joins the team.
                asm volatile("" ::: "memory");
            }
        }
        times.push_back(seconds_since(t0));
        sink = sink + 1;
    }
    return times;
}

void debug_segfault() { std::raise(SIGSEGV); }

void debug_abort() { std::abort(); }

}  // namespace gpubench
