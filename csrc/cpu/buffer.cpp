// 64-byte aligned allocation shared by the probes.
#include <cstdlib>
#include <new>

#include "probes.h"

namespace gpubench {

AlignedBuffer::AlignedBuffer(size_t n_elements) : n(n_elements) {
    size_t bytes = ((n_elements * sizeof(double) + 63) / 64) * 64;
    data = static_cast<double*>(std::aligned_alloc(64, bytes ? bytes : 64));
    if (!data) throw std::bad_alloc();
}

AlignedBuffer::~AlignedBuffer() { std::free(data); }

}  // namespace gpubench
