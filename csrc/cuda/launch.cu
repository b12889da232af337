// launch probe: the four costs of a kernel launch, reported apart (empty kernels, <<<1,1>>>).
//
//   host_enqueue     host clock around `count` launch calls, queued behind a held spin gate so the
//                    device never drains the queue meanwhile (cost of cudaLaunchKernel on the host)
//   device_interval  events around `count` back-to-back kernels queued behind the gate: device time
//                    per kernel with the host's enqueue excluded
//   launch_sync      host clock around `count` x (launch; cudaStreamSynchronize): the round trip
//   graph_node       events around one replay of a captured graph of `count` kernels, gated
//
// Each repetition's time covers all `count` launches; per-launch figures divide by count.
#include <chrono>
#include "common.cuh"

namespace gpubench {
namespace {

__global__ void empty_k() {}

// Launches queued behind a held gate: beyond the launch queue's depth (about a thousand entries)
// the host would block and the gate time out, so gated kinds are capped.
constexpr int kMaxGatedLaunches = 512;

double host_seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Captures `count` empty launches on the context's stream into an instantiated, uploaded graph.
cudaGraphExec_t capture_graph(const DeviceContext& ctx, int count) {
    cudaStream_t s = ctx.stream();
    cudaGraph_t graph = nullptr;
    CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < count; ++i) empty_k<<<1, 1, 0, s>>>();
    cudaError_t launch_err = cudaGetLastError();
    cudaError_t end_err = cudaStreamEndCapture(s, &graph);
    CUDA_CHECK(launch_err);
    CUDA_CHECK(end_err);
    cudaGraphExec_t exec = nullptr;
    cudaError_t inst_err = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    CUDA_CHECK(inst_err);
    CUDA_CHECK(cudaGraphUpload(exec, s));
    return exec;
}

}  // namespace

ProbeResult launch_run(int device, const std::string& kind, int count, int num_reps, int num_warmup) {
    const bool gated = kind == "host_enqueue" || kind == "device_interval";
    if (kind != "host_enqueue" && kind != "device_interval" && kind != "launch_sync" && kind != "graph_node")
        throw std::invalid_argument("launch: kind must be host_enqueue, device_interval, launch_sync or graph_node (got '" + kind + "')");
    if (count < 1 || (gated && count > kMaxGatedLaunches))
        throw std::invalid_argument("launch: count must be in 1.." + std::to_string(gated ? kMaxGatedLaunches : 1 << 30) +
                                    " for " + kind + " (got " + std::to_string(count) + ")");
    if (num_reps < 1 || num_warmup < 0) throw std::invalid_argument("launch: num_reps must be >= 1, num_warmup >= 0");
    DeviceContext ctx(device);
    cudaStream_t s = ctx.stream();
    preload_kernels(empty_k);
    SpinGate gate;
    EventPair ev;
    // Warm the module and the launch path before anything is captured or timed (with lazy module
    // loading the first launch loads the kernel; that must not happen inside a stream capture).
    empty_k<<<1, 1, 0, s>>>();
    CUDA_CHECK(cudaGetLastError());
    ctx.sync();
    cudaGraphExec_t graph = kind == "graph_node" ? capture_graph(ctx, count) : nullptr;
    ProbeResult r;
    try {
        for (int rep = 0; rep < num_warmup + num_reps; ++rep) {
            double t_s = 0.0;
            if (kind == "host_enqueue") {
                gate.hold(s);
                auto t0 = std::chrono::steady_clock::now();
                for (int i = 0; i < count; ++i) empty_k<<<1, 1, 0, s>>>();
                t_s = host_seconds_since(t0);
                CUDA_CHECK(cudaGetLastError());
                gate.release();
                ctx.sync();
                gate.check();
            } else if (kind == "device_interval") {
                gate.hold(s);
                ev.start(s);
                for (int i = 0; i < count; ++i) empty_k<<<1, 1, 0, s>>>();
                ev.stop(s);
                CUDA_CHECK(cudaGetLastError());
                gate.release();
                ctx.sync();
                gate.check();
                t_s = ev.seconds();
            } else if (kind == "launch_sync") {
                auto t0 = std::chrono::steady_clock::now();
                for (int i = 0; i < count; ++i) {
                    empty_k<<<1, 1, 0, s>>>();
                    CUDA_CHECK(cudaStreamSynchronize(s));
                }
                t_s = host_seconds_since(t0);
                CUDA_CHECK(cudaGetLastError());
            } else {  // graph_node
                gate.hold(s);
                ev.start(s);
                CUDA_CHECK(cudaGraphLaunch(graph, s));
                ev.stop(s);
                gate.release();
                ctx.sync();
                gate.check();
                t_s = ev.seconds();
            }
            if (rep >= num_warmup) r.times_s.push_back(t_s);
        }
    } catch (...) {
        gate.release();
        if (graph) cudaGraphExecDestroy(graph);
        throw;
    }
    if (graph) cudaGraphExecDestroy(graph);
    // Nothing to compare against a golden value: every launch returning cudaSuccess and every gate
    // releasing in time is the check.
    r.valid = true;
    r.check = "all launches returned cudaSuccess" + std::string(gated || kind == "graph_node" ? "; gate released in time" : "");
    r.info["count"] = count;
    r.info["gated"] = gated || kind == "graph_node" ? 1.0 : 0.0;
    r.info["timer_host"] = kind == "host_enqueue" || kind == "launch_sync" ? 1.0 : 0.0;
    return r;
}

}  // namespace gpubench
