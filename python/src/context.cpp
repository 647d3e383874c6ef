// Context: a llama_context (KV cache, compute buffers, threads) on a Model, and llama_decode.
#include "objects.h"

#include <ggml-cpu.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/vector.h>

#include <Python.h>

#include <cstring>

#include <algorithm>
#include <csignal>
#include <mutex>
#include <thread>

namespace lb {

// --- Ctrl-C inside a decode. While any decode runs, a SIGINT handler sets g_interrupted and then
// chains to the previous handler (Python's, which schedules KeyboardInterrupt). ggml's CPU backend
// polls the abort callback between graph nodes, so llama_decode returns 2 (aborted) promptly.
static std::atomic<bool> g_interrupted{false};
static std::mutex g_sig_mutex;
static int g_sig_depth = 0;
static struct sigaction g_old_sigint;

static void on_sigint(int sig, siginfo_t * info, void * uctx) {
    g_interrupted.store(true);
    if (g_old_sigint.sa_flags & SA_SIGINFO) {
        if (g_old_sigint.sa_sigaction) g_old_sigint.sa_sigaction(sig, info, uctx);
    } else if (g_old_sigint.sa_handler != SIG_DFL && g_old_sigint.sa_handler != SIG_IGN) {
        g_old_sigint.sa_handler(sig);
    }
}

struct SigintScope {
    SigintScope() {
        std::lock_guard<std::mutex> lock(g_sig_mutex);
        if (g_sig_depth++ == 0) {
            g_interrupted.store(false);
            struct sigaction sa;
            std::memset(&sa, 0, sizeof sa);
            sa.sa_sigaction = on_sigint;
            sa.sa_flags = SA_SIGINFO;
            sigemptyset(&sa.sa_mask);
            sigaction(SIGINT, &sa, &g_old_sigint);
        }
    }
    ~SigintScope() {
        std::lock_guard<std::mutex> lock(g_sig_mutex);
        if (--g_sig_depth == 0) sigaction(SIGINT, &g_old_sigint, nullptr);
    }
};

static bool abort_callback(void *) { return g_interrupted.load(std::memory_order_relaxed); }

void Context::close() {
    if (busy.load()) throw LlamaError("the context is in use by another thread: cannot close it now");
    release();
}

void Context::release() {
    if (ctx) {
        llama_free(ctx);
        ctx = nullptr;
    }
    if (threadpool) {
        ggml_threadpool_free(threadpool);
        threadpool = nullptr;
    }
    if (owner) {
        owner->contexts.erase(this);
        owner = nullptr;
    }
}

static void context_init(Context * self, Model & model, uint32_t n_ctx, uint32_t n_batch, uint32_t n_ubatch, int n_threads,
                         int n_threads_batch) {
    new (self) Context();
    llama_model * m = model.get();
    if (model.vocab_only) raise_value("the model was loaded with vocab_only=True: it has no weights to run a context on");
    const int hw = (int) std::max(1u, std::thread::hardware_concurrency());
    if (n_threads == 0) n_threads = hw;
    if (n_threads_batch == 0) n_threads_batch = n_threads;
    if (n_threads < 0 || n_threads > 512) raise_value("n_threads must be in [1, 512], or 0 for all cores; got " + std::to_string(n_threads));
    if (n_threads_batch < 0 || n_threads_batch > 512) raise_value("n_threads_batch must be in [1, 512], or 0; got " + std::to_string(n_threads_batch));
    if (n_ctx == 0) n_ctx = (uint32_t) llama_model_n_ctx_train(m);
    if (n_ctx < 8) raise_value("n_ctx must be >= 8 tokens (or 0 for the model's n_ctx_train); got " + std::to_string(n_ctx));
    if (n_batch < 1) raise_value("n_batch must be >= 1; got " + std::to_string(n_batch));
    if (n_ubatch < 1) raise_value("n_ubatch must be >= 1; got " + std::to_string(n_ubatch));
    n_batch = std::min(n_batch, n_ctx);
    n_ubatch = std::min(n_ubatch, n_batch);
    llama_context_params p = llama_context_default_params();
    p.n_ctx = n_ctx;
    p.n_batch = n_batch;
    p.n_ubatch = n_ubatch;
    p.n_threads = n_threads;
    p.n_threads_batch = n_threads_batch;
    p.no_perf = false;
    llama_context * c;
    {
        nb::gil_scoped_release release;
        clear_recent_errors();
        c = llama_init_from_model(m, p);
    }
    if (!c) throw LlamaError("llama_init_from_model failed (n_ctx=" + std::to_string(n_ctx) + ")\n" + take_recent_errors());
    llama_set_abort_callback(c, abort_callback, nullptr);
    // A persistent CPU threadpool for this context (default params: poll 50), as llama-bench and
    // llama.cpp's common attach; without one ggml makes a disposable pool on every graph compute.
    ggml_threadpool_params tpp = ggml_threadpool_params_default(std::max(n_threads, n_threads_batch));
    self->threadpool = ggml_threadpool_new(&tpp);
    if (self->threadpool) llama_attach_threadpool(c, self->threadpool, nullptr);
    self->ctx = c;
    self->owner = &model;
    model.contexts.insert(self);
}

// Evaluate tokens at the end of sequence 0, in chunks of n_batch; logits of the last token only.
// The GIL is released during each llama_decode; Ctrl-C is honoured between chunks.
static void decode(Context & self, const std::vector<int64_t> & tokens) {
    llama_context * c = self.get();
    if (tokens.empty()) raise_value("tokens must not be empty");
    std::vector<llama_token> t(tokens.size());
    for (size_t i = 0; i < tokens.size(); ++i) {
        self.owner->check_token(tokens[i]);
        t[i] = (llama_token) tokens[i];
    }
    const uint32_t n_ctx = llama_n_ctx(c);
    if ((uint64_t) self.n_past + t.size() > n_ctx) {
        raise_value("the context is full: n_past (" + std::to_string(self.n_past) + ") + " + std::to_string(t.size()) +
                    " new tokens > n_ctx (" + std::to_string(n_ctx) + ")");
    }
    BusyGuard guard(self);
    SigintScope sigint;
    const size_t n_batch = llama_n_batch(c);
    self.has_logits = false;
    for (size_t i = 0; i < t.size(); i += n_batch) {
        const int32_t n = (int32_t) std::min(n_batch, t.size() - i);
        int32_t rc;
        {
            nb::gil_scoped_release release;
            clear_recent_errors();
            llama_batch b = llama_batch_get_one(t.data() + i, n);  // logits for the last token only
            rc = llama_decode(c, b);
            // llama_decode may return before an accelerator finishes (CUDA, Metal): decode() means
            // "done", so a caller's timing and the Ctrl-C check below see the finished computation
            if (rc == 0) llama_synchronize(c);
        }
        if (rc != 0 && rc != 2) {
            const std::string why = rc == 1 ? "no KV cache slot for the batch (n_ctx too small)"
                                            : rc == -1 ? "invalid batch" : "fatal error " + std::to_string(rc);
            throw LlamaError("llama_decode failed: " + why + "\n" + take_recent_errors());
        }
        if (rc == 2) {
            // The aborted ubatches may remain in the KV cache: drop what this call added.
            llama_memory_seq_rm(llama_get_memory(c), 0, (llama_pos) self.n_past, -1);
            if (PyErr_CheckSignals() != 0) throw nb::python_error();
            raise_keyboard_interrupt();
        }
        self.n_past += (uint32_t) n;
        if (PyErr_CheckSignals() != 0) throw nb::python_error();  // Ctrl-C between chunks
    }
    self.has_logits = true;
}

static void clear(Context & self) {
    llama_context * c = self.get();
    BusyGuard guard(self);
    llama_memory_clear(llama_get_memory(c), true);
    self.n_past = 0;
    self.has_logits = false;
}

static nb::ndarray<nb::numpy, float, nb::ndim<1>> logits(Context & self) {
    llama_context * c = self.get();
    if (!self.has_logits) raise_value("no logits: call decode() first");
    const float * l = llama_get_logits_ith(c, -1);
    if (!l) throw LlamaError("llama_get_logits_ith returned no logits\n" + take_recent_errors());
    const size_t n = (size_t) self.owner->n_vocab();
    float * copy = new float[n];
    std::copy(l, l + n, copy);
    nb::capsule owner(copy, [](void * p) noexcept { delete[] (float *) p; });
    return nb::ndarray<nb::numpy, float, nb::ndim<1>>(copy, {n}, owner);
}

static nb::dict perf(Context & self) {
    llama_perf_context_data d = llama_perf_context(self.get());
    nb::dict out;
    out["t_load_ms"] = d.t_load_ms;
    out["t_p_eval_ms"] = d.t_p_eval_ms;
    out["t_eval_ms"] = d.t_eval_ms;
    out["n_p_eval"] = d.n_p_eval;
    out["n_eval"] = d.n_eval;
    out["n_reused"] = d.n_reused;
    return out;
}

void register_context(nb::module_ & m) {
    nb::class_<Context>(m, "Context", "A llama_context on a Model (see llamabind.Context).")
        .def("__init__", &context_init, nb::arg("model"), nb::arg("n_ctx") = 4096, nb::arg("n_batch") = 2048,
             nb::arg("n_ubatch") = 512, nb::arg("n_threads") = 0, nb::arg("n_threads_batch") = 0, nb::keep_alive<1, 2>(),
             "Wraps llama_init_from_model. n_threads=0: all cores.")
        .def("close", &Context::close)
        .def_prop_ro("closed", [](const Context & s) { return s.ctx == nullptr; })
        .def_prop_ro("n_ctx", [](const Context & s) { return llama_n_ctx(s.get()); })
        .def_prop_ro("n_batch", [](const Context & s) { return llama_n_batch(s.get()); })
        .def_prop_ro("n_ubatch", [](const Context & s) { return llama_n_ubatch(s.get()); })
        .def_prop_ro("n_threads", [](const Context & s) { return llama_n_threads(s.get()); })
        .def_prop_ro("n_threads_batch", [](const Context & s) { return llama_n_threads_batch(s.get()); })
        .def_prop_ro("n_past", [](const Context & s) { return s.n_past; }, "Tokens held in the KV cache (sequence 0).")
        .def("decode", &decode, nb::arg("tokens"),
             "Evaluate token ids after the KV cache's n_past, in n_batch chunks (wraps llama_decode).")
        .def("clear", &clear, "Empty the KV cache (wraps llama_memory_clear).")
        .def("logits", &logits, "Logits of the last decoded token: float32 array (n_vocab,).")
        .def("perf", &perf, "llama_perf_context timings (ms) and token counts.")
        .def("perf_reset", [](Context & s) { llama_perf_context_reset(s.get()); });
}

}  // namespace lb
