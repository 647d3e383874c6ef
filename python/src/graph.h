// The graph engine behind llamabind.ops, shared by graph.cpp (building: nodes, backward, ggml_gallocr)
// and graph_run.cpp (running: binding inputs and outputs, device buffers, DLPack).
#pragma once

#include "common.h"

#include <ggml-alloc.h>
#include <ggml-backend.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace lb {

// One backend instance per device for the whole process; compute on it is serialized.
struct SharedBackend {
    ggml_backend_t backend = nullptr;
    ggml_backend_dev_t dev = nullptr;
    ggml_backend_set_n_threads_t set_n_threads =
        nullptr;        // the CPU backend's (by proc address: it may be a loaded module)
    bool host = false;  // the device computes on host memory (the CPU backend): numpy arrays are used in place
    ggml_backend_buffer_t tag = nullptr;  // a small buffer of the device's type, named by tensors on foreign memory
    int max_threads = 1;                  // CPU: the threadpool's size (n_threads is clamped to it)
    std::mutex mutex;
    // buffers of dropped DeviceBuffers, kept for the next of the same size (an op chain allocates
    // one per result: cudaMalloc/cudaFree per op would synchronize the device; fresh host pages fault)
    std::mutex pool_mutex;
    std::multimap<size_t, ggml_backend_buffer_t> pool;
    size_t pool_bytes = 0;
    ggml_backend_buffer_t take(size_t size);
    void give(ggml_backend_buffer_t buf, size_t size);
    void drain();
};

SharedBackend & shared_backend(const std::string & name);

// Memory of one array on a backend device: owned (ggml_backend_buft_alloc_buffer) or another
// library's, imported by DLPack (kept alive by `keep`). llamabind.ops.DeviceArray holds one.
struct DeviceBuffer {
    SharedBackend * be = nullptr;
    ggml_backend_buffer_t buf = nullptr;  // owned; null for imported memory
    void * data = nullptr;
    size_t size = 0;
    nb::object keep;  // the DLPack producer's array (imported memory)

    ~DeviceBuffer() {
        if (buf) be->give(buf, size);
    }
    ggml_backend_buffer_t buffer() const { return buf ? buf : be->tag; }
};

// A graph input or output whose memory is bound at each run instead of being allocated by
// ggml_gallocr ("external"): a numpy array in place (CPU backend), a DeviceBuffer, or `scratch`
// when the caller's memory cannot be used (another device, misaligned). Views ggml made of the
// tensor follow the binding.
struct Slot {
    ggml_tensor * t = nullptr;
    std::vector<ggml_tensor *> views;
    bool external = false;
    ggml_backend_buffer_t scratch = nullptr;  // owned, allocated at the first run that needs it
};

struct Graph {
    SharedBackend * be = nullptr;
    ggml_context * ctx = nullptr;
    std::vector<ggml_tensor *> nodes;
    ggml_cgraph * gf = nullptr;  // forward
    ggml_cgraph * gb = nullptr;  // forward + backward (when a loss was given)
    ggml_gallocr_t galloc = nullptr;
    std::map<const ggml_tensor *, ggml_tensor *> grad_out;  // param -> its (contiguous) gradient
    bool built = false;
    int n_threads = 1;
    // set by bind_slots (graph_run.cpp) at build: what run() takes and returns, in order
    std::vector<Slot> ins, outs;
    std::vector<ggml_tensor *> params;
    std::mutex run_mutex;
    size_t bytes_copied = 0;  // by the last run: host <-> tensor copies (0: every array used in place)

    ~Graph() {
        for (auto * v : { &ins, &outs }) {
            for (auto & s : *v) {
                if (s.scratch) ggml_backend_buffer_free(s.scratch);
            }
        }
        if (galloc) ggml_gallocr_free(galloc);
        if (ctx) ggml_free(ctx);
    }

    ggml_tensor * node(int64_t id) const {
        if (id < 0 || id >= (int64_t) nodes.size()) raise_value("no node " + std::to_string(id) + " in this graph");
        return nodes[(size_t) id];
    }
    void check_building() const {
        if (built) raise_value("the graph is already built: create a new graph to add nodes");
    }
    int add(ggml_tensor * t) {
        nodes.push_back(t);
        return (int) nodes.size() - 1;
    }
};

// graph_run.cpp: before ggml_gallocr allocates the graph, choose the external inputs/outputs
// (forward graphs only) and give them a placeholder address so that gallocr leaves them alone.
void bind_slots(Graph & g, const std::vector<int64_t> & inputs, const std::vector<int64_t> & outputs,
                const std::vector<int64_t> & params, bool external);
void register_graph_run(nb::module_ & m, nb::class_<Graph> & cls);

}  // namespace lb
