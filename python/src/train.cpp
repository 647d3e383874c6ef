// Fine-tuning through llama.cpp's optimizer API (llama_opt_init / llama_opt_epoch, ggml-opt's AdamW
// and SGD), a model's GGUF export (llama_model_save_to_file) and conversion (llama_model_quantize).
// The loop over batches is Python's (llamabind.train): each opt_step runs llama_opt_epoch on a
// one-datapoint dataset (n_seq_max windows, one sequence each, in one ubatch: patch 0031), so
// Ctrl-C, progress and NaN checks happen between optimizer steps.
#include "grad_reduce.h"
#include "objects.h"
#include "preference.h"

// llama.cpp's internal adapter struct (ab_map: the A/B tensors), for LoRA training (lora.cpp saves them);
// src/ is on the include path (CMakeLists.txt), and the pin fixes its layout
#include <llama-adapter.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>

namespace lb {

struct TrainState {
    ggml_opt_optimizer_type optimizer = GGML_OPT_OPTIMIZER_TYPE_ADAMW;
    float lr = 1e-5f, wd = 0.0f;
    ggml_opt_result_t result_step = ggml_opt_result_init();  // the eval of the last opt_step
    // token-weighted sums since opt_reset, [0] validation, [1] training: loss x rows, rows, correct
    double loss_sum[2] = { 0, 0 };
    int64_t rows[2] = { 0, 0 }, correct[2] = { 0, 0 };
    std::vector<ggml_tensor *> lora_params;  // adapter tensors flagged as parameters (unflagged after)
    std::unique_ptr<PrefLoss> pref;          // a preference loss (DPO, ORPO) in place of the cross-entropy
    std::unique_ptr<GradReduce> reduce;      // data parallelism: the gradients' all-reduce before each step

    ~TrainState() {
        for (ggml_tensor * t : lora_params) t->flags &= ~GGML_TENSOR_FLAG_PARAM;
        ggml_opt_result_free(result_step);
    }
};

// Time spent per node of the training graphs, by phase (forward up to ggml-opt's "ncorrect" node,
// backward, optimizer steps) and op: llama_context_params.cb_eval asks for every node, so the
// scheduler computes them one at a time and synchronizes after each (a profiling mode: slower).
struct OpProfile {
    int phase = 0;           // 0 forward, 1 backward, 2 optimizer; opt_step starts each eval at 0
    bool loss_seen = false;  // the loss node was computed (ggml_set_loss): the forward pass ends after its accuracy
    int64_t t0 = 0;
    struct Row {
        double ms = 0;
        int64_t n = 0;
    };
    std::map<std::pair<int, std::string>, Row> rows;
};

static bool profile_node(ggml_tensor * t, bool ask, void * ud) {
    auto * p = (OpProfile *) ud;
    if (ask) {
        p->t0 = ggml_time_us();
        return true;
    }
    const double ms = (ggml_time_us() - p->t0) / 1000.0;  // the scheduler synchronized the backend
    if (t->op == GGML_OP_OPT_STEP_ADAMW || t->op == GGML_OP_OPT_STEP_SGD) p->phase = 2;
    // ggml-opt's forward pass ends with the loss and then, unless the loss was chunked (patch 0098: each chunk's
    // accuracy before the loss), the ARGMAX and COUNT_EQUAL of the accuracy
    const bool accuracy = t->op == GGML_OP_ARGMAX || t->op == GGML_OP_COUNT_EQUAL || t->op == GGML_OP_RESHAPE;
    if (p->phase == 0 && p->loss_seen && !accuracy) p->phase = 1;
    auto & r = p->rows[{ p->phase, ggml_op_desc(t) }];
    r.ms += ms;
    r.n += 1;
    if (t->flags & GGML_TENSOR_FLAG_LOSS) p->loss_seen = true;
    return true;
}

void training_context_params(llama_context_params & p, Context & c, bool profile, bool packed) {
    // F32 K/V as upstream's finetune (llama_opt_init frees them where the training graph does not read them: patch
    // 0103); flash attention only when asked for (flash_attn 'on': patch 0052 keeps it where every layer's device
    // has its backward pass, patch 0050)
    if (p.n_ubatch != p.n_ctx || p.n_batch != p.n_ctx)
        raise_value("a training context needs n_ctx == n_batch == n_ubatch (gradients do not flow through the KV "
                    "cache); got " +
                    std::to_string(p.n_ctx) + ", " + std::to_string(p.n_batch) + ", " + std::to_string(p.n_ubatch));
    // packed: one window of n_ctx tokens in one KV stream, its documents (up to n_seq_max) the sequences (patch 0096)
    c.packed = packed;
    // n_seq_max windows of n_ctx / n_seq_max tokens, one sequence (KV stream) each, in one ubatch
    const uint32_t n_seq = packed ? 1u : std::max(1u, p.n_seq_max);
    if (p.n_ctx % n_seq != 0 || (p.n_ctx / n_seq) % 256 != 0)
        raise_value("a training context holds n_seq_max windows of n_ctx / n_seq_max tokens, a multiple of 256 "
                    "(llama.cpp pads each sequence's cells to 256); got n_ctx " +
                    std::to_string(p.n_ctx) + ", n_seq_max " + std::to_string(n_seq));
    p.kv_unified = packed || n_seq == 1;  // one KV stream per window: the attention stays within each (patch 0031)
    p.type_k = GGML_TYPE_F32;
    p.type_v = GGML_TYPE_F32;
    if (p.flash_attn_type == LLAMA_FLASH_ATTN_TYPE_AUTO) p.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    if (profile) {
        c.profile = std::make_shared<OpProfile>();
        p.cb_eval = profile_node;
        p.cb_eval_user_data = c.profile.get();
    }
}

// ggml-opt asks for the optimizer parameters before every step (betas, eps: ggml-opt's defaults
// 0.9, 0.999, 1e-8, those of torch.optim.AdamW)
static ggml_opt_optimizer_params opt_pars(void * ud) {
    const auto * s = (const TrainState *) ud;
    ggml_opt_optimizer_params p = ggml_opt_get_default_optimizer_params(nullptr);
    p.adamw.alpha = p.sgd.alpha = s->lr;
    p.adamw.wd = p.sgd.wd = s->wd;
    return p;
}

static bool no_model_params(const ggml_tensor *, void *) {
    return false;
}

static bool all_but_token_embd(const ggml_tensor * t, void *) {
    return std::strcmp(t->name, "token_embd.weight") != 0;
}

// params: "model" (every F32 weight of the model; token_embd too unless embeddings is false: patch
// 0033) or "lora" (only the A/B tensors of the LoRA adapters applied to this context; the base model
// stays frozen and may be quantized). llama_opt_init marks only model tensors, through param_filter;
// the adapters' are flagged here (ggml_set_param) before it, which is all ggml's backward pass looks at.
static void opt_init(Context & c, const std::string & optimizer, float lr, float wd, const std::string & params,
                     int grad_accum, bool embeddings, const std::string & precision, const std::string & loss,
                     float beta, bool recompute, float max_grad_norm, int64_t ce_chunk_rows, nb::object grad_reduce) {
    BusyGuard guard(c);
    llama_context * ctx = c.get();
    if (c.train) raise_value("opt_init was already called on this context (llama_opt_init runs once)");
    const uint32_t n_ctx = llama_n_ctx(ctx);
    if (llama_n_batch(ctx) != n_ctx || llama_n_ubatch(ctx) != n_ctx)
        raise_value("opt_init needs a training context (n_ctx == n_batch == n_ubatch)");
    if (!(lr > 0) || !std::isfinite(lr)) raise_value("lr must be a finite number > 0; got " + std::to_string(lr));
    if (!(wd >= 0 && wd <= 1))  // ggml-opt asserts it
        raise_value("weight_decay must be in [0, 1]; got " + std::to_string(wd));
    if (!(max_grad_norm >= 0) || !std::isfinite(max_grad_norm))  // ggml-opt asserts it
        raise_value("max_grad_norm must be a finite number >= 0 (0: no clipping); got " +
                    std::to_string(max_grad_norm));
    if (ce_chunk_rows < -1)  // llama_opt_params.ce_chunk_rows: 0 automatic, -1 whole, > 0 rows
        raise_value("loss_chunk_tokens must be None (automatic), 0 (whole) or > 0; got " +
                    std::to_string(ce_chunk_rows));
    if (!grad_reduce.is_none() && !PyCallable_Check(grad_reduce.ptr()))
        raise_type("grad_reduce must be callable or None");
    if (grad_accum < 1 || grad_accum > 65536)
        raise_value("grad_accum (windows per optimizer step) must be in [1, 65536]; got " + std::to_string(grad_accum));
    auto st = std::make_shared<TrainState>();
    if (optimizer == "adamw")
        st->optimizer = GGML_OPT_OPTIMIZER_TYPE_ADAMW;
    else if (optimizer == "sgd")
        st->optimizer = GGML_OPT_OPTIMIZER_TYPE_SGD;
    else
        raise_value("optimizer must be 'adamw' or 'sgd'; got '" + optimizer + "'");
    st->lr = lr;
    st->wd = wd;
    if (params != "model" && params != "lora") raise_value("params must be 'model' or 'lora'; got '" + params + "'");
    if (loss != "cross_entropy" && loss != "dpo" && loss != "orpo" && loss != "grpo")
        raise_value("loss must be 'cross_entropy', 'dpo', 'orpo' or 'grpo'; got '" + loss + "'");
    if (loss != "cross_entropy") {
        if (!(beta > 0) || !std::isfinite(beta))
            raise_value(std::string(loss == "grpo" ? "temperature" : "beta") + " must be a finite number > 0; got " +
                        std::to_string(beta));
        if (loss != "grpo" && llama_n_seq_max(ctx) % 2 != 0)
            raise_value("a preference loss takes pairs of windows (chosen, rejected): n_seq_max must be even; got " +
                        std::to_string(llama_n_seq_max(ctx)));
        st->pref = std::make_unique<PrefLoss>();
        st->pref->method = loss == "dpo" ? PrefLoss::DPO : loss == "orpo" ? PrefLoss::ORPO : PrefLoss::GRPO;
        st->pref->beta = beta;
        st->pref->n_vocab = c.owner->n_vocab();
    }
    if (precision != "f32" && precision != "bf16")
        raise_value("precision must be 'bf16' or 'f32'; got '" + precision + "'");
    if (params == "lora") {
        if (c.loras.empty()) raise_value("params='lora' needs a LoRA adapter applied to the context (set_lora)");
        for (auto & [lora, scale] : c.loras) {
            for (auto & [name, w] : lora->adapter->ab_map) {
                st->lora_params.push_back(w.a);
                st->lora_params.push_back(w.b);
            }
        }
        for (ggml_tensor * t : st->lora_params) {
            if (t->type != GGML_TYPE_F32)
                raise_type("LoRA tensor '" + std::string(t->name) + "' is " + ggml_type_name(t->type) +
                           "; training needs F32 adapters");
        }
        for (ggml_tensor * t : st->lora_params) ggml_set_param(t);
    }
    llama_opt_params p{};
    p.n_ctx_train = 0;  // this context's n_ctx
    p.param_filter = params == "lora" ? no_model_params : embeddings ? llama_opt_param_filter_all : all_but_token_embd;
    p.get_opt_pars = opt_pars;
    p.get_opt_pars_ud = st.get();
    p.optimizer_type = st->optimizer;
    p.n_grad_accum = (uint32_t) grad_accum;  // patch 0025: ggml-opt's opt_period
    // patch 0052: products of F32 tensors in BF16 where the backend can (ggml-cuda, patch 0051)
    p.prec_products = precision == "bf16" ? GGML_PREC_BF16 : GGML_PREC_UNDEFINED;
    // patch 0066: gradient checkpointing, only the layers' outputs kept for the backward pass
    p.recompute_activations = recompute;
    // patch 0094: global-norm gradient clipping before each optimizer step (0: none)
    p.max_grad_norm = max_grad_norm;
    // patch 0098: the cross-entropy in chunks of logits rows (0 automatic, -1 whole)
    p.ce_chunk_rows = ce_chunk_rows;
    if (st->pref) {  // patch 0054: the loss of each ubatch's pairs of sequences
        p.build_loss = pref_build_loss;
        p.build_loss_ud = st->pref.get();
        p.reuse_loss = pref_reuse_loss;  // the graphs kept while the rows repeat, the references an input
        p.set_loss_inputs = pref_set_inputs;
    }
    if (!grad_reduce.is_none()) {  // patches 0102, 0104: the step follows the reduction of the period's gradients
        grad_reduce_attach(p, st->reduce, grad_reduce);
    }
    std::string failed;  // e.g. the training graph's reservation (out of memory)
    {
        nb::gil_scoped_release release;
        try {
            llama_opt_init(ctx, c.owner->get(), p);
        } catch (const std::exception & err) {
            failed = err.what();
        }
    }
    if (!failed.empty()) throw LlamaError(failed);
    c.train = st;
}

using Windows = nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using F64In = nb::ndarray<const double, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using I32In = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// the preference loss of the running opt_step (llama_opt_epoch's callbacks take no userdata; they run on the
// thread that called it, after each eval, while the graph's tensors are allocated: patch 0054)
static thread_local PrefLoss * tl_pref = nullptr;

static void pref_after_eval(bool, ggml_opt_context_t, ggml_opt_dataset_t, ggml_opt_result_t, int64_t, int64_t,
                            int64_t) {
    if (tl_pref) pref_read(*tl_pref);
}

// the documents of a packed context's datapoint (patch 0096): segments (n_seq, n_win), each row non-decreasing from 0
// in steps of 1 (none: a document a window), numbered on across the windows; shared (n_seq, n_win): -1, or a later
// document of the window that the position's token belongs to too (llama_opt_set_shared_tokens). Set on the context
// for llama_opt_epoch; returns each position's document (numbered across the windows), empty for an unpacked context
static std::vector<int32_t> set_segments(Context & c, const std::optional<Windows> & segments,
                                         const std::optional<Windows> & shared, int64_t n_seq, int64_t n_win) {
    if (!c.packed) {
        if (segments || shared)
            raise_value("segments and shared are for a packed training context (Context(..., packed=True))");
        return {};
    }
    if (shared && !segments) raise_value("shared tokens need segments: the documents they are shared between");
    if (shared && ((int64_t) shared->shape(0) != n_seq || (int64_t) shared->shape(1) != n_win))
        raise_value("shared is (windows, ctx_size) = (" + std::to_string(n_seq) + ", " + std::to_string(n_win) +
                    ") document indices or -1; got (" + std::to_string(shared->shape(0)) + ", " +
                    std::to_string(shared->shape(1)) + ")");
    if (segments && ((int64_t) segments->shape(0) != n_seq || (int64_t) segments->shape(1) != n_win))
        raise_value("segments are (windows, ctx_size) = (" + std::to_string(n_seq) + ", " + std::to_string(n_win) +
                    ") document indices; got (" + std::to_string(segments->shape(0)) + ", " +
                    std::to_string(segments->shape(1)) + ")");
    std::vector<int32_t> seg(n_seq * n_win), sh(shared ? n_seq * n_win : 0);
    int32_t next = 0;
    for (int64_t s = 0; s < n_seq; ++s) {
        int32_t prev = 0;
        for (int64_t i = 0; i < n_win; ++i) {
            const int32_t v = segments ? (*segments)(s, i) : 0;
            if (i == 0 ? v != 0 : (v != prev && v != prev + 1))
                raise_value("segments[" + std::to_string(s) + "] must count documents from 0 in steps of 1; got " +
                            std::to_string(v) + " at " + std::to_string(i) + " after " + std::to_string(prev));
            seg[s * n_win + i] = next + v;
            prev = v;
        }
        if (shared) {
            for (int64_t i = 0; i < n_win; ++i) {
                const int32_t v = (*shared)(s, i);
                if (v != -1 && (v <= seg[s * n_win + i] - next || v > prev))
                    raise_value("shared[" + std::to_string(s) + ", " + std::to_string(i) + "] = " + std::to_string(v) +
                                " must be -1 or a later document of its window (after " +
                                std::to_string(seg[s * n_win + i] - next) + ", at most " + std::to_string(prev) + ")");
                sh[s * n_win + i] = v < 0 ? -1 : next + v;
            }
        }
        next += prev + 1;
    }
    const int64_t n_max = llama_n_seq_max(c.get());
    if (next > n_max)
        raise_value("the step holds " + std::to_string(next) + " documents; this packed context holds at most " +
                    std::to_string(n_max) + " (n_seq_max)");
    if (!llama_opt_set_segments(c.get(), seg.data(), seg.size()))
        raise_value("llama_opt_set_segments refused the documents");  // the checks above are its rules
    if (shared && !llama_opt_set_shared_tokens(c.get(), sh.data(), sh.size()))
        raise_value("a shared token must have the same position in both documents: as many tokens of each before it "
                    "(llama_opt_set_shared_tokens)");
    return seg;
}

// One datapoint: n_seq_max windows of n_win + 1 tokens (n_win = n_ctx / n_seq_max), each its own
// sequence; inputs windows[:, :-1], labels windows[:, 1:], or ``labels`` (n_seq_max, n_win) ids,
// -1 for a position left out of the loss (patch 0027). train: forward, backward and, every
// grad_accum-th training datapoint, an optimizer step; else forward only (validation loss).
static void opt_step(Context & c, Windows windows, bool train, std::optional<Windows> labels, std::optional<F64In> refs,
                     std::optional<I32In> prompt_rows, std::optional<Windows> segments, std::optional<Windows> shared) {
    BusyGuard guard(c);
    llama_context * ctx = c.get();
    if (!c.train) raise_value("call opt_init first");
    // a packed context's datapoint is one window of n_ctx tokens: any number of windows that divides it
    const int64_t n_ctx = llama_n_ctx(ctx), n_seq = c.packed ? (int64_t) windows.shape(0) : llama_n_seq_max(ctx);
    if (n_seq < 1 || n_ctx % n_seq != 0)
        raise_value("a packed training step takes windows whose count divides n_ctx = " + std::to_string(n_ctx) +
                    "; got " + std::to_string(windows.shape(0)));
    const int64_t n_win = n_ctx / n_seq;
    if ((int64_t) windows.shape(0) != n_seq || (int64_t) windows.shape(1) != n_win + 1)
        raise_value("a training step takes n_seq_max = " + std::to_string(n_seq) +
                    " windows of n_ctx / n_seq_max + 1 = " + std::to_string(n_win + 1) + " tokens; got (" +
                    std::to_string(windows.shape(0)) + ", " + std::to_string(windows.shape(1)) + ")");
    const int32_t n_vocab = c.owner->n_vocab();
    for (int64_t s = 0; s < n_seq; ++s) {
        for (int64_t i = 0; i <= n_win; ++i) {
            if (windows(s, i) < 0 || windows(s, i) >= n_vocab)
                raise_value("token id " + std::to_string(windows(s, i)) + " at [" + std::to_string(s) + ", " +
                            std::to_string(i) + "] is outside [0, " + std::to_string(n_vocab) + ")");
        }
    }
    if (labels) {
        if ((int64_t) labels->shape(0) != n_seq || (int64_t) labels->shape(1) != n_win)
            raise_value("labels are (n_seq_max, n_ctx / n_seq_max) = (" + std::to_string(n_seq) + ", " +
                        std::to_string(n_win) + ") ids; got (" + std::to_string(labels->shape(0)) + ", " +
                        std::to_string(labels->shape(1)) + ")");
        bool any = false;
        for (int64_t s = 0; s < n_seq; ++s) {
            for (int64_t i = 0; i < n_win; ++i) {
                const int32_t l = (*labels)(s, i);
                if (l < -1 || l >= n_vocab)
                    raise_value("label " + std::to_string(l) + " at [" + std::to_string(s) + ", " + std::to_string(i) +
                                "] is outside [0, " + std::to_string(n_vocab) + ") and not -1 (masked)");
                any = any || l >= 0;
            }
        }
        // an all-masked datapoint would be skipped by llama_opt_epoch, shifting the accumulation period
        if (!any) raise_value("every label of the step is masked (-1): nothing to learn from it");
    }
    const std::vector<int32_t> docs = set_segments(c, segments, shared, n_seq, n_win);
    TrainState & st = *c.train;
    if (st.pref)
        pref_check_step(*st.pref, labels ? labels->data() : nullptr, n_seq, n_win, refs ? refs->data() : nullptr,
                        refs ? (int64_t) refs->shape(0) : 0, prompt_rows ? prompt_rows->data() : nullptr,
                        prompt_rows ? (int64_t) prompt_rows->shape(0) : -1, docs);
    else if (refs || prompt_rows)
        raise_value(std::string(refs ? "refs" : "prompt_rows") + " are for a preference loss (opt_init with loss '" +
                    (refs ? "dpo" : "orpo") + "')");
    ggml_opt_dataset_t ds = ggml_opt_dataset_init(GGML_TYPE_I32, GGML_TYPE_I32, n_ctx, n_ctx, 1, 1);
    auto * data = (int32_t *) ggml_opt_dataset_data(ds)->data;
    auto * lab = (int32_t *) ggml_opt_dataset_labels(ds)->data;
    for (int64_t s = 0; s < n_seq; ++s) {
        std::memcpy(data + s * n_win, &windows(s, 0), n_win * sizeof(int32_t));
        std::memcpy(lab + s * n_win, labels ? &(*labels)(s, 0) : &windows(s, 1), n_win * sizeof(int32_t));
    }
    ggml_opt_result_reset(st.result_step);
    if (c.profile) {
        c.profile->phase = 0;
        c.profile->loss_seen = false;
    }
    std::string failed;  // llama.cpp's error (patch 0053: a graph that cannot be allocated) after the dataset is freed
    {
        nb::gil_scoped_release release;
        try {
            tl_pref = st.pref.get();
            ggml_opt_epoch_callback cb = st.pref ? pref_after_eval : nullptr;
            llama_opt_epoch(ctx, ds, st.result_step, st.result_step, train ? 1 : 0, cb, cb);
            if (st.reduce) ggml_opt_apply_step(llama_opt_get_context(ctx));  // the period's step, if it ended
        } catch (const std::exception & err) {
            failed = err.what();
        }
    }
    tl_pref = nullptr;
    ggml_opt_dataset_free(ds);
    if (!failed.empty()) throw LlamaError(failed);
    if (st.reduce && !st.reduce->error.empty())
        throw std::runtime_error("the gradients' reduction (grad_reduce) failed; no step taken: " + st.reduce->error);
    c.has_logits = false;
    int64_t rows = 0;
    double loss = NAN, acc = NAN;
    ggml_opt_result_ndata(st.result_step, &rows);
    ggml_opt_result_loss(st.result_step, &loss, nullptr);
    ggml_opt_result_accuracy(st.result_step, &acc, nullptr);
    st.loss_sum[train] += loss * rows;
    st.rows[train] += rows;
    st.correct[train] += std::llround(acc * rows);
}

// the context's ggml_opt_context (null before llama_opt_init builds it)
static ggml_opt_context_t opt_of(Context & c) {
    if (!c.train) raise_value("call opt_init first");
    return llama_opt_get_context(c.get());
}

// forward-only evals computed in the training graph (patch 0095)
static void opt_forward_as_training(Context & c, bool on) {
    if (ggml_opt_context_t o = opt_of(c)) ggml_opt_set_forward_as_training(o, on);
}

// the gradients' global norm at the last optimizer step, where clipping computes it (patch 0094)
static float opt_grad_norm(Context & c) {
    ggml_opt_context_t o = opt_of(c);
    return o ? ggml_opt_get_grad_norm(o) : NAN;
}

// (mean loss per labelled token, next-token accuracy, labelled tokens) since the last opt_reset,
// token-weighted over the steps
static nb::tuple opt_result(Context & c, bool train) {
    if (!c.train) raise_value("call opt_init first");
    const TrainState & st = *c.train;
    const int64_t n = st.rows[train];
    if (n == 0) return nb::make_tuple(NAN, NAN, 0);
    return nb::make_tuple(st.loss_sum[train] / n, (double) st.correct[train] / n, n);
}

// the last opt_step's per-window summed log-likelihoods of the labelled tokens (nats), float64 (n_seq_max,):
// of each answer, or (prompt) of the labelled prompt positions before it (0 where none)
static nb::ndarray<nb::numpy, double, nb::ndim<1>> opt_seq_logps(Context & c, bool prompt) {
    if (!c.train || !c.train->pref) raise_value("the context was not set up with a preference loss (opt_init)");
    const auto & v = prompt ? c.train->pref->logps_prompt : c.train->pref->logps;
    double * out = new double[v.size()];
    std::copy(v.begin(), v.end(), out);
    nb::capsule owner(out, [](void * p) noexcept { delete[] (double *) p; });
    return nb::ndarray<nb::numpy, double, nb::ndim<1>>(out, { v.size() }, owner);
}

static void opt_reset(Context & c) {
    if (!c.train) raise_value("call opt_init first");
    TrainState & st = *c.train;
    for (int k = 0; k < 2; ++k) {
        st.loss_sum[k] = 0;
        st.rows[k] = st.correct[k] = 0;
    }
}

// llama_opt_get_stats (patch 0032): counts and milliseconds since opt_init
static nb::dict opt_stats(Context & c) {
    if (!c.train) raise_value("call opt_init first");
    const llama_opt_stats s = llama_opt_get_stats(c.get());
    nb::dict d;
    d["n_evals"] = s.n_evals;
    d["n_graph_builds"] = s.n_graph_builds;
    d["n_opt_builds"] = s.n_opt_builds;
    d["n_graph_allocs"] = s.n_graph_allocs;
    d["t_build_ms"] = s.t_build_ms;
    d["t_alloc_ms"] = s.t_alloc_ms;
    d["t_inputs_ms"] = s.t_inputs_ms;
    d["t_eval_ms"] = s.t_eval_ms;
    d["t_prepare_ms"] = s.t_prepare_ms;
    d["n_kept_batches"] = s.n_kept_batches;
    d["compute_buffer_bytes"] = s.compute_buffer_bytes;  // patch 0066
    return d;
}

// [(phase, op, ms, nodes)] timed by the profiling callback since the last call (which clears it)
static nb::list opt_profile(Context & c) {
    if (!c.profile) raise_value("this context was not made with training_profile=True");
    static const char * phases[] = { "forward", "backward", "optimizer" };
    nb::list out;
    for (const auto & [key, row] : c.profile->rows)
        out.append(nb::make_tuple(phases[key.first], key.second, row.ms, row.n));
    c.profile->rows.clear();
    return out;
}

using F32Flat = nb::ndarray<nb::numpy, float, nb::ndim<1>>;
using F32In = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

static ggml_opt_context_t opt_context(Context & c) {
    ggml_opt_context_t o = opt_of(c);  // patch 0028
    if (!o || ggml_opt_n_params(o) == 0)
        raise_value("the optimizer state exists from the first opt_step on (a forward-only one will do)");
    return o;
}

static F32Flat tensor_to_numpy(const ggml_tensor * t) {
    const size_t n = (size_t) ggml_nelements(t);
    float * out = new float[n];
    nb::capsule owner(out, [](void * p) noexcept { delete[] (float *) p; });
    ggml_backend_tensor_get(t, out, 0, n * sizeof(float));
    return F32Flat(out, { n }, owner);
}

// (AdamW's step counter, [(parameter name, m, v)]): the optimizer state, flat float32 copies
// (m, v None for SGD). Wraps ggml_opt_get_iter / ggml_opt_get_param (patch 0028).
static nb::tuple opt_state(Context & c) {
    BusyGuard guard(c);
    ggml_opt_context_t o = opt_context(c);
    nb::list params;
    for (int64_t i = 0; i < ggml_opt_n_params(o); ++i) {
        ggml_tensor *m = nullptr, *v = nullptr;
        ggml_tensor * node = ggml_opt_get_param(o, i, &m, &v);
        if (!node) continue;
        params.append(nb::make_tuple(std::string(node->name), m ? nb::cast(tensor_to_numpy(m)) : nb::none(),
                                     v ? nb::cast(tensor_to_numpy(v)) : nb::none()));
    }
    return nb::make_tuple(ggml_opt_get_iter(o), params);
}

// Set the optimizer state saved by opt_state: every parameter of this context's optimizer must be
// given, by name, with as many values; nothing is written unless all are.
static void opt_set_state(Context & c, int64_t iter, const std::vector<std::tuple<std::string, F32In, F32In>> & state) {
    BusyGuard guard(c);
    ggml_opt_context_t o = opt_context(c);
    if (iter < 1) raise_value("the optimizer's step counter must be >= 1; got " + std::to_string(iter));
    std::vector<std::tuple<ggml_tensor *, ggml_tensor *, const F32In *, const F32In *>> writes;
    size_t n_params = 0;
    for (int64_t i = 0; i < ggml_opt_n_params(o); ++i) {
        ggml_tensor *m = nullptr, *v = nullptr;
        ggml_tensor * node = ggml_opt_get_param(o, i, &m, &v);
        if (!node || !m || !v) continue;
        ++n_params;
        const auto it =
            std::find_if(state.begin(), state.end(), [&](const auto & e) { return std::get<0>(e) == node->name; });
        if (it == state.end()) raise_value(std::string("the state has no moments for '") + node->name + "'");
        const auto & [name, sm, sv] = *it;
        if ((int64_t) sm.shape(0) != ggml_nelements(m) || (int64_t) sv.shape(0) != ggml_nelements(v))
            raise_value(std::string("the moments for '") + node->name + "' have " + std::to_string(sm.shape(0)) +
                        " values; the parameter has " + std::to_string(ggml_nelements(m)));
        writes.emplace_back(m, v, &sm, &sv);
    }
    if (n_params != state.size())
        raise_value("the state holds " + std::to_string(state.size()) + " parameters; this optimizer has " +
                    std::to_string(n_params));
    for (auto & [m, v, sm, sv] : writes) {
        ggml_backend_tensor_set(m, sm->data(), 0, ggml_nbytes(m));
        ggml_backend_tensor_set(v, sv->data(), 0, ggml_nbytes(v));
    }
    ggml_opt_set_iter(o, iter);
}

static void opt_set_lr(Context & c, float lr) {
    if (!c.train) raise_value("call opt_init first");
    if (!(lr > 0) || !std::isfinite(lr)) raise_value("lr must be a finite number > 0; got " + std::to_string(lr));
    c.train->lr = lr;
}

void register_train(nb::module_ & m) {
    m.def(
        "opt_init", &opt_init, nb::arg("context"), nb::arg("optimizer"), nb::arg("lr"), nb::arg("weight_decay"),
        nb::arg("params") = "model", nb::arg("grad_accum") = 1, nb::arg("embeddings") = true,
        nb::arg("precision") = "f32", nb::arg("loss") = "cross_entropy", nb::arg("beta") = 0.1f,
        nb::arg("recompute") = false, nb::arg("max_grad_norm") = 0.0f, nb::arg("ce_chunk_rows") = 0,
        nb::arg("grad_reduce") = nb::none(),
        "llama_opt_init on a training context, ggml-opt's AdamW or SGD. params 'model': every F32 weight "
        "(llama_opt_param_filter_all; token_embd unless embeddings is false, patch 0033); 'lora': only the A/B "
        "tensors of the adapters applied to the context. grad_accum: opt_steps per optimizer step (their "
        "gradients averaged; llama_opt_params.n_grad_accum, patch 0025). precision 'bf16': products of F32 "
        "tensors in BF16 with F32 accumulation where the backend has them (llama_opt_params.prec_products, "
        "patch 0052); 'f32': F32. loss 'dpo' or 'orpo' (beta: DPO's beta, ORPO's lambda): a preference loss over "
        "windows that alternate chosen, rejected (llama_opt_params.build_loss, patch 0054); 'grpo' (beta: the "
        "sampling temperature T): sum over labelled positions of refs[r] x log softmax(logits / T)[label]. "
        "recompute: keep only the layers' outputs for the backward pass, recompute the rest "
        "(llama_opt_params.recompute_activations, patch 0066). max_grad_norm > 0: the gradients clipped to that "
        "global L2 norm before each optimizer step (llama_opt_params.max_grad_norm, patch 0094); 0: none. "
        "ce_chunk_rows: the cross-entropy in chunks of this many logits rows, each recomputed for the backward "
        "pass (llama_opt_params.ce_chunk_rows, patch 0098); 0 automatic, -1 whole. grad_reduce(grads): called "
        "before each optimizer step with float32 (n,) every trained tensor's gradient, to change in place (an "
        "all-reduce; llama_opt_params.grad_reduce, patch 0102); what it raises is raised by opt_step, no step taken.");
    m.def("opt_forward_as_training", &opt_forward_as_training, nb::arg("context"), nb::arg("on"),
          "ggml_opt_set_forward_as_training: forward-only opt_steps (train=False) between optimizer steps evaluate the "
          "training graph (its backward pass computed and dropped), so that a backend computes their forward nodes as "
          "in a training step (patch 0095).");
    m.def("opt_grad_norm", &opt_grad_norm, nb::arg("context"),
          "ggml_opt_get_grad_norm: the gradients' global L2 norm at the last optimizer step (before clipping), "
          "NaN without clipping or before the first step (patch 0094).");
    m.def("opt_step", &opt_step, nb::arg("context"), nb::arg("windows"), nb::arg("train"),
          nb::arg("labels") = nb::none(), nb::arg("refs") = nb::none(), nb::arg("prompt_rows") = nb::none(),
          nb::arg("segments") = nb::none(), nb::arg("shared") = nb::none(),
          "llama_opt_epoch on n_seq_max windows, int32 (n_seq_max, n_ctx / n_seq_max + 1), one sequence each "
          "(next-token cross-entropy, or the preference loss of opt_init: refs float64 (n_seq_max / 2,) for DPO; "
          "prompt_rows int32 (n_seq_max / 2,) for ORPO, each chosen window's labelled prompt positions; refs float64 "
          "(labelled positions,) for GRPO, each one's coefficient, window-major): "
          "train=True adds the backward pass (and the optimizer step), False only accumulates the validation loss. "
          "A packed context takes any number m of windows dividing n_ctx, (m, n_ctx / m + 1), and segments int32 "
          "(m, n_ctx / m): each position's document in its window, from 0 in steps of 1 (none: one a window; "
          "llama_opt_set_segments, patch 0096), and shared int32 (m, n_ctx / m): -1 or a later document of the window "
          "the position's token belongs to too (a prompt shared by a chosen and a rejected answer; "
          "llama_opt_set_shared_tokens). A packed preference step's documents alternate chosen, rejected.");
    m.def("opt_seq_logps", &opt_seq_logps, nb::arg("context"), nb::arg("prompt") = false,
          "float64 (n_seq_max,): the last opt_step's per-window summed log-likelihood of its answer's labelled "
          "tokens (prompt: of the labelled prompt positions before them, 0 where none); GRPO: float64 (labelled "
          "positions,), each one's log-probability.");
    m.def("opt_result", &opt_result, nb::arg("context"), nb::arg("train"),
          "(mean loss per labelled token, next-token accuracy, labelled tokens) since opt_reset, token-weighted.");
    m.def("opt_reset", &opt_reset, nb::arg("context"));
    m.def("opt_stats", &opt_stats, nb::arg("context"), "llama_opt_get_stats: graph builds, allocations and times.");
    m.def("opt_profile", &opt_profile, nb::arg("context"),
          "[(phase, op, ms, nodes)] of a training_profile context since the last call.");
    m.def("opt_set_lr", &opt_set_lr, nb::arg("context"), nb::arg("lr"));
    m.def("opt_state", &opt_state, nb::arg("context"),
          "(iter, [(name, m, v)]): ggml-opt's optimizer state (patch 0028).");
    m.def("opt_set_state", &opt_set_state, nb::arg("context"), nb::arg("iter"), nb::arg("state"),
          "Set ggml-opt's optimizer state (patch 0028).");
}

}  // namespace lb
