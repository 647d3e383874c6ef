// llamabind._core: the nanobind extension. One file per area; this one wires them together.
#include "common.h"

#include <llama.h>
#include <log.h>

NB_MODULE(_core, m) {
    m.doc() = "llamabind's compiled core over the pinned llama.cpp/ggml (use the llamabind package API).";
    lb::install_log_callback();  // before anything logs
    llama_backend_init();
    // llama.cpp common (chat templates, sampler, grammar) has its own logger that writes straight
    // to stderr; keep it silent (llama.cpp's and ggml's own logs go to Python logging)
    common_log_set_verbosity_thold(-1);
    lb::register_errors(m);
    lb::register_logging(m);
    lb::register_backends(m);
    lb::register_model(m);
    lb::register_context(m);
    lb::register_sampling(m);
    lb::register_chat(m);
    lb::register_testing(m);
    lb::register_graph(m);
    lb::register_ops(m);
    lb::register_rpc(m);
}
