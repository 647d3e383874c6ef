// llamabind._core: the nanobind extension. One file per area; this one wires them together.
#include "common.h"

#include <ggml-backend.h>
#include <llama.h>
#include <log.h>

#ifdef LLAMABIND_BACKEND_DL
#ifdef _WIN32
#include <windows.h>
#else
#include <dlfcn.h>
#endif

#include <string>

// Portable builds: ggml's backends (each CPU variant, RPC, ...) are modules beside this extension;
// ggml_backend_load_all_from_path scores the CPU variants against this CPU and loads the best.
static void load_backends() {
    std::string path;
#ifdef _WIN32
    HMODULE h = nullptr;
    char buf[MAX_PATH];
    if (GetModuleHandleExA(GET_MODULE_HANDLE_EX_FLAG_FROM_ADDRESS | GET_MODULE_HANDLE_EX_FLAG_UNCHANGED_REFCOUNT,
                           (LPCSTR) &load_backends, &h) &&
        GetModuleFileNameA(h, buf, MAX_PATH)) {
        path = buf;
    }
#else
    Dl_info info{};
    if (dladdr((void *) &load_backends, &info) && info.dli_fname) path = info.dli_fname;
#endif
    const size_t slash = path.find_last_of("/\\");
    const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash);
    ggml_backend_load_all_from_path(dir.c_str());
}
#endif

NB_MODULE(_core, m) {
    m.doc() = "llamabind's compiled core over the pinned llama.cpp/ggml (use the llamabind package API).";
    lb::install_log_callback();  // before anything logs
#ifdef LLAMABIND_BACKEND_DL
    load_backends();
#endif
    llama_backend_init();
    // llama.cpp common (chat templates, sampler, grammar) has its own logger that writes straight
    // to stderr; keep it silent (llama.cpp's and ggml's own logs go to Python logging)
    common_log_set_verbosity_thold(-1);
    lb::register_errors(m);
    lb::register_logging(m);
    lb::register_backends(m);
    lb::register_model(m);
    lb::register_lora(m);
    lb::register_train(m);
    lb::register_context(m);
    lb::register_sampling(m);
    lb::register_chat(m);
    lb::register_testing(m);
    lb::register_graph(m);
    lb::register_ops(m);
    lb::register_rpc(m);
    lb::register_server(m);
    lb::register_mtmd(m);
}
