// Plain C++ interface between the nvcc-compiled kernels and the pybind11 bindings.
//
// Every probe function is blocking: it returns after the device finished and every time was read.
// Device times come from CUDA events (cudaEventElapsedTime) around the timed region only; the
// launch probe's host-side kinds use std::chrono::steady_clock because host cost is what they measure.
#pragma once
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace gpubench {

struct NoDevice : std::runtime_error { using std::runtime_error::runtime_error; };
struct CudaError : std::runtime_error { using std::runtime_error::runtime_error; };
// Too little free device memory for a probe's buffers (the message names bytes needed and free).
struct DeviceMemory : std::runtime_error { using std::runtime_error::runtime_error; };

// One measurement: every timed repetition (warm-up excluded) plus what its check found.
struct ProbeResult {
    std::vector<double> times_s;          // per repetition, seconds
    bool valid = false;                   // the golden-value / checksum check passed
    std::string check;                    // what was checked and what it found (one line)
    std::map<std::string, double> info;   // sizes, launch geometry, bytes/flops per repetition, ...
};

int device_count();
std::map<std::string, double> device_properties(int device);
bool selfcheck_fill(int device, long long n);
// Formats fixed values through the one formatter every message uses (strfmt, in nvcc-compiled code):
// the caller compares the string with what it must be before any probe runs. No device needed.
std::string format_selftest();
// name, pci_bus_id, driver_cuda_version (the CUDA version the driver supports), cuda_runtime.
std::map<std::string, std::string> device_identity(int device);

// stream: copy, scale, add, triad over three fp64 arrays of n_elements (even), accessed as double2.
// Returns kernel name -> result; the arrays are checked against a golden replay after all repetitions.
std::map<std::string, ProbeResult> stream_run(int device, long long n_elements, int num_reps, int num_warmup);

// l2: read a working set of working_set_bytes (multiple of 16) with ld.global.cg (L1 bypassed).
// mode "cold": L2 flushed (a write of >= 2x L2) before each single timed pass; "warm": `passes`
// passes per repetition over the same buffer after an untimed warm pass. Sum checked per repetition.
ProbeResult l2_run(int device, long long working_set_bytes, const std::string& mode, long long passes,
                   int num_reps, int num_warmup);

// launch: kind in {host_enqueue, device_interval, launch_sync, graph_node}; `count` empty kernels per
// repetition; times_s are per repetition (divide by count for per-launch figures).
ProbeResult launch_run(int device, const std::string& kind, int count, int num_reps, int num_warmup);

// peak: register-resident loop of mma.sync (bf16, fp16, tf32, fp8) or fp32 FMA; iterations chosen so
// one repetition takes about target_s. Returns valid=false with info["supported"]=0 where the arch lacks it.
ProbeResult peak_run(int device, const std::string& dtype, int num_reps, int num_warmup, double target_s);
// peak on Hopper: wgmma m64n128k16 bf16 or m64n128k32 fp8 e4m3 (dtype "bf16" / "fp8", fp32 accumulate),
// operands A in registers, B in shared memory.
// Needs compute capability 9.0 and sm_90a code in the build; info["supported"]=0 (no times) otherwise.
ProbeResult peak_wgmma_run(int device, const std::string& dtype, int num_reps, int num_warmup, double target_s);
// (supported, reason) of a peak dtype on this device, from its compute capability.
std::pair<bool, std::string> peak_supported(int device, const std::string& dtype);

}  // namespace gpubench
