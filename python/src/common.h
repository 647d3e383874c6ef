// Shared declarations of the llamabind._core extension (one .cpp per area).
#pragma once

#include <ggml-backend.h>
#include <ggml.h>
#include <nanobind/nanobind.h>

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace nb = nanobind;

namespace lb {

// ---- errors.cpp: Python exceptions with messages that name the argument and the expected value
struct LlamaError : std::runtime_error {  // -> llamabind.LlamaError (a RuntimeError)
    using std::runtime_error::runtime_error;
};
[[noreturn]] void raise_file_not_found(const std::string & msg);
[[noreturn]] void raise_value(const std::string & msg);
[[noreturn]] void raise_type(const std::string & msg);
[[noreturn]] void raise_keyboard_interrupt();
void register_errors(nb::module_ & m);

// ---- logging.cpp: llama.cpp/ggml logs -> Python logging
void register_logging(nb::module_ & m);
void install_log_callback();
// The callback llama.cpp's logs go through (also given to libmtmd: mtmd.cpp)
void log_to_python(enum ggml_log_level level, const char * text, void * user_data);
// Deliver lines logged on threads unknown to Python (queued there; see logging.cpp). Takes the GIL.
void flush_logs();
// The last error/warning lines that llama.cpp logged on this thread (drained by the call).
std::string take_recent_errors();
void clear_recent_errors();

// DLPack's (device type, id) of a backend device's memory: (kDLCPU, 0) for host memory, (kDLCUDA, n) for CUDAn,
// (0, 0) for devices DLPack does not name (graph_run.cpp)
std::pair<int, int> dlpack_device(ggml_backend_dev_t dev);

// ---- backends.cpp: build info, devices
void register_backends(nb::module_ & m);

// ---- each area's bindings (module.cpp calls them in this order); the file is the area's name
void register_model(nb::module_ & m);
void register_lora(nb::module_ & m);
void register_train(nb::module_ & m);
void register_context(nb::module_ & m);
void register_sampling(nb::module_ & m);
void register_chat(nb::module_ & m);
void register_testing(nb::module_ & m);
void register_graph(nb::module_ & m);
void register_ops(nb::module_ & m);
void register_rpc(nb::module_ & m);
void register_server(nb::module_ & m);
void register_mtmd(nb::module_ & m);

}  // namespace lb
