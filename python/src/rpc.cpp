// ggml's RPC backend: connect to servers (their devices join the registry), run a server.
#include "common.h"
#include "objects.h"
#include "rpc.h"

#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <ggml-backend.h>
#ifdef LLAMABIND_HAS_RPC
#include <ggml-rpc.h>  // the function types; called through the RPC registry's proc addresses, which
                       // works whether ggml-rpc is linked in or a loaded module (GGML_BACKEND_DL)
#endif

#include <cstring>
#include <mutex>
#include <set>

namespace lb {

bool is_rpc_device(ggml_backend_dev_t dev) {
    return std::strcmp(ggml_backend_reg_name(ggml_backend_dev_backend_reg(dev)), "RPC") == 0;
}

#ifdef LLAMABIND_HAS_RPC
template <typename F>
static F * rpc_fn(const char * name) {
    ggml_backend_reg_t reg = ggml_backend_reg_by_name("RPC");
    void * p = reg ? ggml_backend_reg_get_proc_address(reg, name) : nullptr;
    if (p == nullptr) throw LlamaError(std::string("the RPC backend is not loaded (") + name + ")");
    return (F *) p;
}

static std::mutex rpc_mutex;
static std::set<std::string> rpc_registered;  // endpoints whose devices are in ggml's registry

std::vector<ggml_backend_dev_t> rpc_connect(const std::string & endpoint) {
    ggml_backend_reg_t reg = nullptr;
    std::string error;
    {
        nb::gil_scoped_release release;  // connects and asks the server for its devices
        std::lock_guard<std::mutex> lock(rpc_mutex);
        try {  // patch 0011: a failed connection throws instead of aborting
            reg = rpc_fn<decltype(ggml_backend_rpc_add_server)>("ggml_backend_rpc_add_server")(endpoint.c_str());
            if (reg == nullptr)
                error = "RPC server " + endpoint + " reports no devices";
            else if (rpc_registered.insert(endpoint).second)
                ggml_backend_register(reg);
        } catch (const std::exception & e) {
            error = e.what();
        }
    }
    if (!error.empty()) {
        PyErr_SetString(PyExc_ConnectionError, error.c_str());
        throw nb::python_error();
    }
    std::vector<ggml_backend_dev_t> devs;
    for (size_t i = 0; i < ggml_backend_reg_dev_count(reg); ++i) devs.push_back(ggml_backend_reg_dev_get(reg, i));
    return devs;
}

static void rpc_serve(const std::string & endpoint, const std::string & cache_dir, size_t n_threads,
                      const std::vector<std::string> & device_names) {
    std::vector<ggml_backend_dev_t> devs;
    for (const auto & name : device_names) {
        ggml_backend_dev_t d = ggml_backend_dev_by_name(name.c_str());
        if (d == nullptr || is_rpc_device(d))
            raise_value("no local backend device named '" + name + "' (see llamabind.devices())");
        devs.push_back(d);
    }
    if (devs.empty()) raise_value("rpc serve: no devices");
    auto * start_server = rpc_fn<decltype(ggml_backend_rpc_start_server)>("ggml_backend_rpc_start_server");
    nb::gil_scoped_release release;  // serves until the process ends (or the socket cannot be opened)
    start_server(endpoint.c_str(), cache_dir.empty() ? nullptr : cache_dir.c_str(), n_threads, devs.size(),
                 devs.data());
}
#else
std::vector<ggml_backend_dev_t> rpc_connect(const std::string &) {
    throw LlamaError("this llamabind build has no RPC backend (build with CMAKE_ARGS=-DGGML_RPC=ON)");
}
#endif

std::vector<ggml_backend_dev_t> offload_devices(const std::vector<std::string> & rpc, bool & explicit_list) {
    std::vector<ggml_backend_dev_t> devices, rpc_devs;
    for (const auto & ep : rpc) {
        for (auto * d : rpc_connect(ep)) rpc_devs.push_back(d);
    }
    explicit_list = !rpc_devs.empty();
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t d = ggml_backend_dev_get(i);
        const auto t = ggml_backend_dev_type(d);
        if (is_rpc_device(d))
            explicit_list = true;
        else if (t == GGML_BACKEND_DEVICE_TYPE_GPU || t == GGML_BACKEND_DEVICE_TYPE_IGPU)
            devices.push_back(d);
    }
    devices.insert(devices.end(), rpc_devs.begin(), rpc_devs.end());
    return devices;
}

void register_rpc(nb::module_ & m) {
#ifdef LLAMABIND_HAS_RPC
    m.attr("HAS_RPC") = true;
    m.def(
        "rpc_connect",
        [](const std::string & endpoint) {
            std::vector<std::string> names;
            for (auto * d : rpc_connect(endpoint)) names.push_back(ggml_backend_dev_name(d));
            return names;
        },
        nb::arg("endpoint"), "ggml_backend_rpc_add_server + ggml_backend_register; the server's device names.");
    m.def("rpc_serve", &rpc_serve, nb::arg("endpoint"), nb::arg("cache_dir"), nb::arg("n_threads"), nb::arg("devices"),
          "ggml_backend_rpc_start_server: blocks while serving; returns if the socket cannot be opened.");
#else
    m.attr("HAS_RPC") = false;
#endif
}

}  // namespace lb
