// Context: a llama_context (KV cache, compute buffers, threads) on a Model, and llama_decode.
#include "interrupt.h"
#include "objects.h"

#include <ggml-cpu.h>  // declarations only: the functions are reached by proc address
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <Python.h>

#include <cmath>
#include <cstring>

#include <algorithm>
#include <csignal>
#include <mutex>
#include <thread>

namespace lb {

// ggml-cpu's threadpool functions, by proc address of the CPU registry (a module under GGML_BACKEND_DL)
template <typename F>
static F * cpu_threadpool_fn(const char * name) {
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    return cpu ? (F *) ggml_backend_reg_get_proc_address(ggml_backend_dev_backend_reg(cpu), name) : nullptr;
}


void Context::close() {
    if (busy.load()) throw LlamaError("the context is in use by another thread: cannot close it now");
    check_no_views("close the context");
    release();
}

void Context::check_no_views(const char * what) const {
    if (views > 0) {
        throw LlamaError(std::string("cannot ") + what + ": " + std::to_string(views) +
                         " logits array(s) from eval(copy=False) still view llama.cpp's output buffer; "
                         "delete them (or use copy=True) first");
    }
}

void Context::release() {
    forget_backend_sampler(*this);
    if (ctx) {
        llama_free(ctx);
        ctx = nullptr;
    }
    if (threadpool) {
        if (auto * free_fn = cpu_threadpool_fn<decltype(ggml_threadpool_free)>("ggml_threadpool_free"))
            free_fn(threadpool);
        threadpool = nullptr;
    }
    if (owner) {
        owner->contexts.erase(this);
        owner = nullptr;
    }
    loras.clear();
    train.reset();
    profile.reset();  // cb_eval's user data: after llama_free
}

// The KV cache types llama.cpp's tools accept (common's kv_cache_types)
static bool kv_cache_type_ok(int t) {
    switch (t) {
        case GGML_TYPE_F32:
        case GGML_TYPE_F16:
        case GGML_TYPE_BF16:
        case GGML_TYPE_Q8_0:
        case GGML_TYPE_Q4_0:
        case GGML_TYPE_Q4_1:
        case GGML_TYPE_IQ4_NL:
        case GGML_TYPE_Q5_0:
        case GGML_TYPE_Q5_1: return true;
        default: return false;
    }
}

static void context_init(Context * self, Model & model, uint32_t n_ctx, uint32_t n_batch, uint32_t n_ubatch,
                         int n_threads, int n_threads_batch, uint32_t n_seq_max, bool embeddings, int pooling,
                         bool kv_unified, bool op_offload, bool training, int type_k, int type_v, int flash_attn,
                         bool training_profile, bool packed) {
    new (self) Context();
    llama_model * m = model.get();
    if (model.vocab_only)
        raise_value("the model was loaded with vocab_only=True: it has no weights to run a context on");
    const int hw = (int) std::max(1u, std::thread::hardware_concurrency());
    if (n_threads == 0) n_threads = hw;
    if (n_threads_batch == 0) n_threads_batch = n_threads;
    if (n_threads < 0 || n_threads > 512)
        raise_value("n_threads must be in [1, 512], or 0 for all cores; got " + std::to_string(n_threads));
    if (n_threads_batch < 0 || n_threads_batch > 512)
        raise_value("n_threads_batch must be in [1, 512], or 0; got " + std::to_string(n_threads_batch));
    if (n_ctx == 0) n_ctx = (uint32_t) llama_model_n_ctx_train(m);
    if (n_ctx < 8)
        raise_value("n_ctx must be >= 8 tokens (or 0 for the model's n_ctx_train); got " + std::to_string(n_ctx));
    if (n_batch < 1) raise_value("n_batch must be >= 1; got " + std::to_string(n_batch));
    if (n_ubatch < 1) raise_value("n_ubatch must be >= 1; got " + std::to_string(n_ubatch));
    if (n_seq_max < 1 || n_seq_max > (uint32_t) llama_max_parallel_sequences())
        raise_value("n_seq_max must be in [1, " + std::to_string(llama_max_parallel_sequences()) + "]; got " +
                    std::to_string(n_seq_max));
    if (pooling < LLAMA_POOLING_TYPE_UNSPECIFIED || pooling > LLAMA_POOLING_TYPE_RANK)
        raise_value("pooling must be a llama_pooling_type (-1..4); got " + std::to_string(pooling));
    if (!kv_cache_type_ok(type_k) || !kv_cache_type_ok(type_v))
        raise_value("type_k/type_v must be a KV cache type (f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1)");
    if (flash_attn < -1 || flash_attn > 1) raise_value("flash_attn must be -1 (auto), 0 (off) or 1 (on)");
    if (ggml_is_quantized((ggml_type) type_v) && flash_attn == 0)
        raise_value(std::string("a quantized V cache (") + ggml_type_name((ggml_type) type_v) +
                    ") needs flash attention: flash_attn='on' or 'auto'");
    n_batch = std::min(n_batch, n_ctx);
    n_ubatch = std::min(n_ubatch, n_batch);
    llama_context_params p = llama_context_default_params();
    p.n_ctx = n_ctx;
    p.n_batch = n_batch;
    p.n_ubatch = n_ubatch;
    p.n_threads = n_threads;
    p.n_threads_batch = n_threads_batch;
    p.n_seq_max = n_seq_max;
    p.kv_unified = kv_unified;
    p.op_offload = op_offload;
    p.embeddings = embeddings;
    p.pooling_type = (enum llama_pooling_type) pooling;
    p.type_k = (ggml_type) type_k;
    p.type_v = (ggml_type) type_v;
    p.flash_attn_type = flash_attn < 0 ? LLAMA_FLASH_ATTN_TYPE_AUTO :
                                         (flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED);
    p.no_perf = false;
    if (training_profile && !training) raise_value("training_profile needs training=True");
    if (packed && !training) raise_value("packed needs training=True");
    if (training) training_context_params(p, *self, training_profile, packed);  // train.cpp
    llama_context * c;
    {
        nb::gil_scoped_release release;
        clear_recent_errors();
        c = llama_init_from_model(m, p);
    }
    if (!c)
        throw LlamaError("llama_init_from_model failed (n_ctx=" + std::to_string(n_ctx) + ")\n" + take_recent_errors());
    llama_set_abort_callback(c, abort_callback, nullptr);
    // A persistent CPU threadpool for this context (default params: poll 50), as llama-bench and
    // llama.cpp's common attach; without one ggml makes a disposable pool on every graph compute.
    // (through the CPU registry's proc address: ggml-cpu may be a loaded module, as common does it)
    ggml_threadpool_params tpp = ggml_threadpool_params_default(std::max(n_threads, n_threads_batch));
    auto * new_fn = cpu_threadpool_fn<decltype(ggml_threadpool_new)>("ggml_threadpool_new");
    self->threadpool = new_fn ? new_fn(&tpp) : nullptr;
    if (self->threadpool) llama_attach_threadpool(c, self->threadpool, nullptr);
    self->ctx = c;
    self->owner = &model;
    self->encoder_only = llama_model_has_encoder(m) && !llama_model_has_decoder(m);
    model.contexts.insert(self);
}

void check_seq(llama_context * c, int64_t seq) {
    const int64_t n = llama_n_seq_max(c);
    if (seq < 0 || seq >= n)
        raise_value("seq_id must be in [0, n_seq_max) = [0, " + std::to_string(n) + "); got " + std::to_string(seq));
}

// One entry of a batch: tokens appended to sequence seq after what the KV cache holds.
struct Entry {
    llama_seq_id seq;
    const llama_token * tokens;  // a view: the caller owns the ids
    size_t n;
};

// Run one llama_decode (or llama_encode for encoder-only models) over entries whose total is
// <= n_batch. all_logits: every token gets an output row, else only each entry's last token.
// Returns the batch position of each entry's last token. Ctrl-C rolls the entries back.
static std::vector<int32_t> run_batch(Context & self, const std::vector<Entry> & entries, bool all_logits) {
    llama_context * c = self.get();
    size_t total = 0;
    for (const auto & e : entries) total += e.n;
    std::vector<llama_pos> p0(entries.size());
    for (size_t k = 0; k < entries.size(); ++k) p0[k] = next_pos(self, entries[k].seq);
    BatchBuf & bb = self.batch;
    bb.token.resize(total);
    bb.pos.resize(total);
    bb.n_seq_id.assign(total, 1);
    bb.seq.resize(total);
    bb.seq_id.resize(total);
    bb.logits.resize(total);
    std::vector<int32_t> last(entries.size());
    size_t j = 0;
    for (size_t k = 0; k < entries.size(); ++k) {
        const auto & e = entries[k];
        for (size_t i = 0; i < e.n; ++i, ++j) {
            bb.token[j] = e.tokens[i];
            bb.pos[j] = p0[k] + (llama_pos) i;
            bb.seq[j] = e.seq;
            bb.seq_id[j] = &bb.seq[j];
            bb.logits[j] = all_logits || i + 1 == e.n;
        }
        last[k] = (int32_t) j - 1;
    }
    llama_batch b = { (int32_t) total,    bb.token.data(),  nullptr,         bb.pos.data(),
                      bb.n_seq_id.data(), bb.seq_id.data(), bb.logits.data() };
    int32_t rc;
    std::string backend_error;
    self.has_logits = false;
    {
        nb::gil_scoped_release release;
        clear_recent_errors();
        try {
            rc = self.encoder_only ? llama_encode(c, b) : llama_decode(c, b);
            // llama_decode may return before an accelerator finishes (CUDA, Metal): decode() means
            // "done", so a caller's timing and the Ctrl-C check below see the finished computation
            if (rc == 0) llama_synchronize(c);
        } catch (const std::exception & e) {  // a backend that raises (RPC: lost connection, patch 0011)
            rc = -100;
            backend_error = e.what();
        }
    }
    flush_logs();  // lines ggml's own threads logged during the decode
    if (rc != 0 && rc != 2) {
        const std::string why = rc == 1    ? "no KV cache slot for the batch (n_ctx too small)" :
                                rc == -1   ? "invalid batch" :
                                rc == -100 ? "backend error: " + backend_error + " (close this context)" :
                                             "fatal error " + std::to_string(rc);
        throw LlamaError(std::string(self.encoder_only ? "llama_encode" : "llama_decode") + " failed: " + why + "\n" +
                         take_recent_errors());
    }
    if (rc == 2) {
        // The aborted ubatches may remain in the KV cache: drop what this call added.
        for (size_t k = 0; k < entries.size(); ++k) llama_memory_seq_rm(llama_get_memory(c), entries[k].seq, p0[k], -1);
        if (PyErr_CheckSignals() != 0) throw nb::python_error();
        raise_keyboard_interrupt();
    }
    self.has_logits = true;
    self.n_batch_last = (int32_t) total;
    if (PyErr_CheckSignals() != 0) throw nb::python_error();  // Ctrl-C between batches
    return last;
}

std::vector<llama_token> checked_tokens(const Context & self, const std::vector<int64_t> & tokens) {
    std::vector<llama_token> t(tokens.size());
    for (size_t i = 0; i < tokens.size(); ++i) {
        self.owner->check_token(tokens[i]);
        t[i] = (llama_token) tokens[i];
    }
    return t;
}

static void check_room(Context & self, llama_seq_id seq, size_t n) {
    const int64_t p = n_cells(self, seq);
    const uint32_t n_ctx = llama_n_ctx_seq(self.get());
    if ((uint64_t) p + n > n_ctx) {
        raise_value("the context is full: sequence " + std::to_string(seq) + " holds " + std::to_string(p) +
                    " tokens, + " + std::to_string(n) + " new tokens > n_ctx per sequence (" + std::to_string(n_ctx) +
                    ")");
    }
}

// Evaluate tokens at the end of sequence seq, in chunks of n_batch. Logits (or embeddings) of the
// last token only; the GIL is released during each llama_decode.
static void decode(Context & self, const std::vector<int64_t> & tokens, int64_t seq, bool all_logits) {
    llama_context * c = self.get();
    if (tokens.empty()) raise_value("tokens must not be empty");
    check_seq(c, seq);
    std::vector<llama_token> t = checked_tokens(self, tokens);
    check_room(self, (llama_seq_id) seq, t.size());
    self.check_no_views("decode");
    BusyGuard guard(self);
    SigintScope sigint;
    const size_t n_batch = self.encoder_only ? t.size() : llama_n_batch(c);
    if (self.encoder_only && t.size() > llama_n_ubatch(c)) {
        raise_value("an encoder-only model needs the whole input in one ubatch: " + std::to_string(t.size()) +
                    " tokens > n_ubatch (" + std::to_string(llama_n_ubatch(c)) + ")");
    }
    if (all_logits && t.size() > n_batch) {
        raise_value("all_logits needs the tokens in one batch: " + std::to_string(t.size()) + " > n_batch (" +
                    std::to_string(n_batch) + ")");
    }
    for (size_t i = 0; i < t.size(); i += n_batch) {
        const size_t n = std::min(n_batch, t.size() - i);
        run_batch(self, { Entry{ (llama_seq_id) seq, t.data() + i, n } }, all_logits);
    }
}

// Several sequences in one llama_decode: entries [(seq_id, tokens)], total <= n_batch.
static std::vector<int32_t> decode_batch(Context & self,
                                         const std::vector<std::pair<int64_t, std::vector<int64_t>>> & entries) {
    llama_context * c = self.get();
    if (entries.empty()) raise_value("entries must not be empty");
    std::vector<std::vector<llama_token>> ids;  // checked copies; es views them
    ids.reserve(entries.size());
    std::vector<Entry> es;
    size_t total = 0;
    std::vector<bool> seen(llama_n_seq_max(c), false);
    for (const auto & [seq, tokens] : entries) {
        check_seq(c, seq);
        if (seen[seq]) raise_value("seq_id " + std::to_string(seq) + " appears twice in one batch");
        seen[seq] = true;
        if (tokens.empty()) raise_value("the tokens of seq_id " + std::to_string(seq) + " are empty");
        ids.push_back(checked_tokens(self, tokens));
        es.push_back(Entry{ (llama_seq_id) seq, ids.back().data(), ids.back().size() });
        check_room(self, (llama_seq_id) seq, tokens.size());
        total += tokens.size();
    }
    if (total > llama_n_batch(c)) {
        raise_value("a batch holds at most n_batch (" + std::to_string(llama_n_batch(c)) + ") tokens; got " +
                    std::to_string(total));
    }
    self.check_no_views("decode");
    BusyGuard guard(self);
    SigintScope sigint;
    return run_batch(self, es, false);
}

// A zero-copy logits view's owner: keeps the Python Context alive and counts the view.
struct ViewRef {
    Context * ctx;
    PyObject * ref;
};

static void release_view(void * p) noexcept {  // capsule destructors run with the GIL held
    ViewRef * v = (ViewRef *) p;
    if (v->ctx->views > 0) v->ctx->views--;
    Py_DECREF(v->ref);
    delete v;
}

// Logits of every token: float32 (n_tokens, n_vocab). copy=False returns a read-only view into
// llama.cpp's output buffer when the tokens fit one batch (decode/close refuse while it lives).
static void check_no_backend_sampler(const Context & self) {  // only the sampled token left the device
    if (!self.backend_samplers.empty()) {
        raise_value("no logits while a sampler chain runs on the backend (backend_sampling)");
    }
}

static nb::object eval(nb::handle py_self, const std::vector<int64_t> & tokens, int64_t seq, bool copy) {
    Context & self = nb::cast<Context &>(py_self);
    llama_context * c = self.get();
    if (tokens.empty()) raise_value("tokens must not be empty");
    if (self.encoder_only) raise_value("eval() gives next-token logits: this is an encoder-only model, use embeddings");
    check_seq(c, seq);
    std::vector<llama_token> t = checked_tokens(self, tokens);
    check_room(self, (llama_seq_id) seq, t.size());
    self.check_no_views("eval");
    check_no_backend_sampler(self);
    const size_t n_vocab = (size_t) self.owner->n_vocab();
    const size_t n_batch = llama_n_batch(c);
    BusyGuard guard(self);
    SigintScope sigint;
    if (!copy && t.size() <= n_batch) {
        run_batch(self, { Entry{ (llama_seq_id) seq, t.data(), t.size() } }, true);
        // every token has an output row: llama_get_logits gives them contiguous, in batch order
        float * l = llama_get_logits(c);
        if (!l) throw LlamaError("llama_get_logits returned no logits\n" + take_recent_errors());
        Py_INCREF(py_self.ptr());
        nb::capsule owner(new ViewRef{ &self, py_self.ptr() }, release_view);
        self.views++;
        return nb::cast(nb::ndarray<nb::numpy, const float, nb::ndim<2>>(l, { t.size(), n_vocab }, owner));
    }
    float * out = new float[t.size() * n_vocab];
    nb::capsule owner(out, [](void * p) noexcept { delete[] (float *) p; });
    for (size_t i = 0; i < t.size(); i += n_batch) {
        const size_t n = std::min(n_batch, t.size() - i);
        run_batch(self, { Entry{ (llama_seq_id) seq, t.data() + i, n } }, true);
        for (size_t r = 0; r < n; ++r) {
            const float * l = llama_get_logits_ith(c, (int32_t) r);
            if (!l) throw LlamaError("llama_get_logits_ith returned no logits\n" + take_recent_errors());
            std::copy(l, l + n_vocab, out + (i + r) * n_vocab);
        }
    }
    return nb::cast(nb::ndarray<nb::numpy, float, nb::ndim<2>>(out, { t.size(), n_vocab }, owner));
}

static const float * logits_at(Context & self, int32_t idx) {
    llama_context * c = self.get();
    if (!self.has_logits || self.encoder_only) raise_value("no logits: call decode() first");
    check_no_backend_sampler(self);
    if (idx < -1 || idx >= self.n_batch_last) {
        raise_value("idx must be -1 or a position of the last batch, in [0, " + std::to_string(self.n_batch_last) +
                    "); got " + std::to_string(idx));
    }
    clear_recent_errors();
    const float * l = llama_get_logits_ith(c, idx);
    if (!l)
        raise_value("no logits at batch position " + std::to_string(idx) +
                    " (only positions that asked for logits have them)\n" + take_recent_errors());
    return l;
}

// A float32 numpy array (n,) that owns a copy of src[0:n].
static nb::ndarray<nb::numpy, float, nb::ndim<1>> copy_to_numpy(const float * src, size_t n) {
    float * copy = new float[n];
    std::copy(src, src + n, copy);
    nb::capsule owner(copy, [](void * p) noexcept { delete[] (float *) p; });
    return nb::ndarray<nb::numpy, float, nb::ndim<1>>(copy, { n }, owner);
}

static nb::ndarray<nb::numpy, float, nb::ndim<1>> logits(Context & self, int32_t idx) {
    return copy_to_numpy(logits_at(self, idx), (size_t) self.owner->n_vocab());
}

// Overwrite the logits at batch position idx with values (float32 (n_vocab,)): the buffer that
// llama_get_logits_ith returns and the sampler chain (common_sampler_sample) reads next, so a
// Python logits processor changes what is sampled.
static void set_logits(Context & self, int32_t idx,
                       nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu> values) {
    float * l = const_cast<float *>(logits_at(self, idx));
    const size_t n = (size_t) self.owner->n_vocab();
    if (values.shape(0) != n)
        raise_value("the logits must have n_vocab = " + std::to_string(n) + " values; got " +
                    std::to_string(values.shape(0)));
    self.check_no_views("set the logits");
    std::copy(values.data(), values.data() + n, l);
}

// log-softmax of the raw logits at batch position idx: (logprob of token, top-n ids, their logprobs)
static nb::tuple logprobs(Context & self, int32_t idx, int64_t token, int32_t n_top) {
    const float * l = logits_at(self, idx);
    const int32_t n = self.owner->n_vocab();
    if (token >= 0) self.owner->check_token(token);
    if (n_top < 0 || n_top > n) raise_value("n_top must be in [0, n_vocab]; got " + std::to_string(n_top));
    float mx = -INFINITY;
    for (int32_t i = 0; i < n; ++i) mx = std::max(mx, l[i]);
    double sum = 0.0;
    for (int32_t i = 0; i < n; ++i) sum += std::exp((double) l[i] - mx);
    const double lse = mx + std::log(sum);
    nb::list top_ids, top_lp;
    if (n_top > 0) {  // the n_top largest, ties by id: partial_sort over all n_vocab ids
        std::vector<int32_t> ids(n);
        for (int32_t i = 0; i < n; ++i) ids[i] = i;
        std::partial_sort(ids.begin(), ids.begin() + n_top, ids.end(),
                          [&](int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
        for (int32_t i = 0; i < n_top; ++i) {
            top_ids.append(ids[i]);
            top_lp.append((double) l[ids[i]] - lse);
        }
    }
    nb::object tok_lp = token >= 0 ? nb::object(nb::float_((double) l[token] - lse)) : nb::object(nb::none());
    return nb::make_tuple(tok_lp, top_ids, top_lp);
}

// Pooled embedding of a sequence (pooling != none), or of batch position idx (pooling none).
static nb::ndarray<nb::numpy, float, nb::ndim<1>> embedding(Context & self, int64_t seq, int32_t idx) {
    llama_context * c = self.get();
    if (!self.has_logits) raise_value("no embeddings: call decode() first");
    clear_recent_errors();
    const float * e;
    size_t n = (size_t) llama_model_n_embd(self.owner->get());
    if (llama_pooling_type(c) == LLAMA_POOLING_TYPE_NONE) {
        if (idx < -1 || idx >= self.n_batch_last)
            raise_value("idx must be in [-1, " + std::to_string(self.n_batch_last) + "); got " + std::to_string(idx));
        e = llama_get_embeddings_ith(c, idx);
    } else {
        check_seq(c, seq);
        e = llama_get_embeddings_seq(c, (llama_seq_id) seq);
        if (llama_pooling_type(c) == LLAMA_POOLING_TYPE_RANK)
            n = (size_t) std::max<uint32_t>(1, llama_model_n_cls_out(self.owner->get()));
    }
    if (!e) raise_value("no embeddings: create the context with embeddings=True\n" + take_recent_errors());
    return copy_to_numpy(e, n);
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
    auto cls = nb::class_<Context>(m, "Context", "A llama_context on a Model (see llamabind.Context).");
    add_state_methods(cls);   // state.cpp
    add_memory_methods(cls);  // memory.cpp
    cls.def("__init__", &context_init, nb::arg("model"), nb::arg("n_ctx") = 4096, nb::arg("n_batch") = 2048,
            nb::arg("n_ubatch") = 512, nb::arg("n_threads") = 0, nb::arg("n_threads_batch") = 0,
            nb::arg("n_seq_max") = 1, nb::arg("embeddings") = false, nb::arg("pooling") = -1,
            nb::arg("kv_unified") = true, nb::arg("op_offload") = true, nb::arg("training") = false,
            nb::arg("type_k") = (int) GGML_TYPE_F16, nb::arg("type_v") = (int) GGML_TYPE_F16,
            nb::arg("flash_attn") = -1, nb::arg("training_profile") = false, nb::arg("packed") = false,
            nb::keep_alive<1, 2>(),
            "Wraps llama_init_from_model. n_threads=0: all cores. training: F32 KV cache, no flash "
            "attention, n_ctx == n_batch == n_ubatch, n_seq_max windows of n_ctx / n_seq_max tokens in one "
            "ubatch (for llama_opt_init); training_profile: time every node of the training graphs (cb_eval); "
            "packed (with training): one unified window of n_ctx tokens holding up to n_seq_max documents "
            "(llama_opt_set_segments, patch 0096).")
        .def("close", &Context::close)
        .def_prop_ro("closed", [](const Context & s) { return s.ctx == nullptr; })
        .def_prop_ro("n_ctx", [](const Context & s) { return llama_n_ctx(s.get()); })
        .def_prop_ro("n_ctx_seq", [](const Context & s) { return llama_n_ctx_seq(s.get()); })
        .def_prop_ro("n_batch", [](const Context & s) { return llama_n_batch(s.get()); })
        .def_prop_ro("n_ubatch", [](const Context & s) { return llama_n_ubatch(s.get()); })
        .def_prop_ro("n_seq_max", [](const Context & s) { return llama_n_seq_max(s.get()); })
        .def_prop_ro("n_threads", [](const Context & s) { return llama_n_threads(s.get()); })
        .def_prop_ro("n_threads_batch", [](const Context & s) { return llama_n_threads_batch(s.get()); })
        .def_prop_ro("pooling", [](const Context & s) { return (int) llama_pooling_type(s.get()); })
        .def_prop_ro("encoder_only", [](const Context & s) { return s.encoder_only; })


        .def("decode", &decode, nb::arg("tokens"), nb::arg("seq_id") = 0, nb::arg("all_logits") = false,
             "Evaluate token ids at the end of a sequence, in n_batch chunks (llama_decode, or llama_encode "
             "for encoder-only models).")
        .def("decode_batch", &decode_batch, nb::arg("entries"),
             "[(seq_id, tokens)] in one llama_decode (total <= n_batch); returns each entry's last batch position.")
        .def("eval", &eval, nb::arg("tokens"), nb::arg("seq_id") = 0, nb::arg("copy") = true,
             "Logits of every token, float32 (n_tokens, n_vocab).")

        .def("logits", &logits, nb::arg("idx") = -1, "Logits at a batch position (-1: last): float32 (n_vocab,).")
        .def("set_logits", &set_logits, nb::arg("idx"), nb::arg("values"),
             "Overwrite the logits at a batch position (float32 (n_vocab,)); the sampler reads them next.")
        .def("logprobs", &logprobs, nb::arg("idx"), nb::arg("token"), nb::arg("n_top"),
             "(logprob of token or None, top ids, top logprobs) of the raw logits at batch position idx.")
        .def("embedding", &embedding, nb::arg("seq_id") = 0, nb::arg("idx") = -1,
             "Pooled embedding of a sequence (llama_get_embeddings_seq), or of a batch position with pooling none.")

        .def("set_loras", &set_loras, nb::arg("loras"),
             "[(Lora, scale)] applied to this context (llama_set_adapters_lora).")
        .def_prop_ro("views", [](const Context & s) { return s.views; })
        .def("perf", &perf, "llama_perf_context timings (ms) and token counts.")
        .def("perf_reset", [](Context & s) { llama_perf_context_reset(s.get()); });
}

}  // namespace lb
