// Build information and the ggml backend devices compiled into this build.
#include "common.h"

#include <ggml-backend.h>
#include <llama.h>

#include <nanobind/stl/string.h>

#include <sstream>

#if !defined(_WIN32)
#include <dlfcn.h>
#endif

#ifndef LLAMABIND_HAS_TOOLS
#define LLAMABIND_HAS_TOOLS 0
#endif

namespace lb {

static std::vector<std::string> split(const std::string & s, char sep) {
    std::vector<std::string> out;
    std::stringstream ss(s);
    std::string item;
    while (std::getline(ss, item, sep)) {
        if (!item.empty()) out.push_back(item);
    }
    return out;
}

static const char * dev_type_name(enum ggml_backend_dev_type t) {
    switch (t) {
        case GGML_BACKEND_DEVICE_TYPE_CPU: return "cpu";
        case GGML_BACKEND_DEVICE_TYPE_GPU: return "gpu";
        case GGML_BACKEND_DEVICE_TYPE_IGPU: return "igpu";
        case GGML_BACKEND_DEVICE_TYPE_ACCEL: return "accel";
        default: return "other";
    }
}

static nb::list devices() {
    nb::list out;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        size_t free = 0, total = 0;
        bool reachable = true;
        {
            nb::gil_scoped_release release;  // an RPC device asks its server
            try {
                ggml_backend_dev_memory(dev, &free, &total);
            } catch (const std::exception &) {  // an RPC server that went away (patch 0011)
                reachable = false;
            }
        }
        nb::dict d;
        d["name"] = ggml_backend_dev_name(dev);
        d["description"] = ggml_backend_dev_description(dev);
        d["type"] = dev_type_name(ggml_backend_dev_type(dev));
        d["backend"] = ggml_backend_reg_name(ggml_backend_dev_backend_reg(dev));
        d["memory_free"] = free;
        d["memory_total"] = total;
        if (!reachable) d["error"] = "unreachable";
        out.append(d);
    }
    return out;
}

static nb::dict build_info() {
    nb::dict info;
    info["version"] = LLAMABIND_VERSION;
    info["upstream_commit"] = LLAMABIND_UPSTREAM_COMMIT;
    info["upstream_release"] = LLAMABIND_UPSTREAM_RELEASE;
    nb::list patches;
    for (auto & p : split(LLAMABIND_PATCHES, ',')) patches.append(p);
    info["patches"] = patches;
    nb::dict flags;
    for (auto & kv : split(LLAMABIND_COMPILE_FLAGS, '|')) {
        auto eq = kv.find('=');
        flags[kv.substr(0, eq).c_str()] = eq == std::string::npos ? std::string() : kv.substr(eq + 1);
    }
    info["compile_flags"] = flags;
    nb::list backends;
    for (size_t i = 0; i < ggml_backend_reg_count(); ++i) {
        backends.append(ggml_backend_reg_name(ggml_backend_reg_get(i)));
    }
    info["backends"] = backends;
    info["devices"] = devices();
    info["system_info"] = llama_print_system_info();
    info["supports_gpu_offload"] = llama_supports_gpu_offload();
    info["supports_mmap"] = llama_supports_mmap();
    info["tools"] = (bool) LLAMABIND_HAS_TOOLS;
    return info;
}

// libgomp keeps one OpenMP thread team per thread that ran a parallel region (ggml-cpu's graph
// compute under GGML_OPENMP). A team left behind by a thread that stopped decoding keeps its
// threads counted: once the process has more OpenMP threads than cores, libgomp stops spinning
// for every team and a decode on another thread ran 7x slower on 2 cores. omp_pause_soft frees
// the calling thread's team (the next parallel region starts a new one). Found by name, so that
// builds without OpenMP (or with ggml-cpu in a loaded module) need no link to it.
static bool release_threads() {
#if defined(_WIN32)
    return false;
#else
    using pause_fn = int (*)(int);
    static pause_fn fn = (pause_fn) dlsym(RTLD_DEFAULT, "omp_pause_resource_all");
    if (!fn) return false;
    nb::gil_scoped_release release;
    return fn(1 /* omp_pause_soft */) == 0;
#endif
}

void register_backends(nb::module_ & m) {
    m.def("release_threads", &release_threads,
          "Free the calling thread's OpenMP thread team (omp_pause_resource_all(omp_pause_soft)), if\n"
          "this process runs libgomp/libomp; the next decode on this thread starts a new one. Returns\n"
          "whether a runtime did it. Call it on a thread that is done decoding, before others decode.");
    m.def("build_info", &build_info,
          "Build facts: upstream commit and release, applied patches, compile flags, compiled-in ggml\n"
          "backends and their devices, llama_print_system_info(), whether upstream tools were built.");
    m.def("devices", &devices,
          "ggml backend devices of this build: dicts with name, description, type, backend,\n"
          "memory_free and memory_total (bytes). Wraps ggml_backend_dev_get/ggml_backend_dev_memory.");
}

}  // namespace lb
