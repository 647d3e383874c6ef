// Sampler: llama.cpp common's sampler (common_sampler_init over common_params_sampling): logit
// bias -> penalties -> DRY -> top-n-sigma -> top_k -> typical_p -> top_p -> min_p -> XTC ->
// temperature -> dist, or mirostat v1/v2, with an optional GBNF grammar (user, JSON schema or a
// chat template's tool-call grammar, lazy with triggers). The same code path as llama-cli/server.
// Backend sampling (attach): the chain joins the context's decode graph (llama_set_sampler, as
// llama-server's backend_sampling): its leading samplers with ggml implementations (logit bias,
// penalties, top-k, top-p, min-p, temperature, greedy/dist) run on the output layer's device and
// only the sampled token (or the surviving candidates, for the rest of the chain) is copied back.
#include "objects.h"

#include <sampling.h>

#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <thread>

namespace lb {

struct Sampler {
    common_sampler * chain = nullptr;
    const llama_vocab * vocab = nullptr;
    int32_t n_vocab = 0;
    bool grammar = false;  // a grammar never runs on the backend (common_sampler_sample asserts)
    bool argmax = false;   // the chain is logit bias + greedy: the token is the argmax of the biased logits
    std::vector<llama_logit_bias> bias;  // the user's and the model's suppressed tokens (argmax only)
    std::vector<float> scratch;          // biased logits (argmax only)
    std::vector<llama_token_data> cand;  // the candidates of sample_many's path (common_sampler's set_logits)
    bool was_attached = false;           // llama_sampler_chain_backend_init may run once per chain
    Context * attached = nullptr;        // the context whose decode graph runs this chain
    llama_seq_id attached_seq = 0;       // for this sequence
    ~Sampler() { close(); }
    void detach() {
        if (!attached) return;
        if (attached->ctx) llama_set_sampler(attached->ctx, attached_seq, nullptr);
        attached->backend_samplers.erase(attached_seq);
        attached->has_logits = false;  // the last decode made no raw logits
        attached = nullptr;
    }
    void close() {
        detach();
        if (chain) {
            common_sampler_free(chain);
            chain = nullptr;
        }
    }
    common_sampler * get() const {
        if (!chain) raise_value("the sampler is closed");
        return chain;
    }
};

template <typename T>
static T take(nb::dict & d, const char * key, T dflt) {
    if (!d.contains(key)) return dflt;
    nb::object v = d[key];
    nb::del(d[key]);
    if (v.is_none()) return dflt;
    try {
        return nb::cast<T>(v);
    } catch (const nb::cast_error &) {
        raise_type(std::string("sampling parameter ") + key + " has the wrong type (" +
                   nb::type_name(v.type()).c_str() + ")");
    }
}

static float finite(const char * name, double v) {
    if (!std::isfinite(v)) raise_value(std::string(name) + " must be a finite number; got " + std::to_string(v));
    return (float) v;
}

// A finite float parameter (NaN/inf would reach samplers that divide or compare by it).
static float num(nb::dict & d, const char * key, double dflt) {
    return finite(key, take<double>(d, key, dflt));
}

// params: the fields of llamabind.SamplingParams (validated in Python; re-checked here where a
// bad value would reach a GGML_ASSERT or an infinite loop).
static void sampler_init(Sampler * self, Model & model, nb::dict params, const ChatParams * chat) {
    new (self) Sampler();
    model.get();
    const llama_vocab * vocab = model.get_vocab();
    const int32_t n_vocab = model.n_vocab();
    common_params_sampling p;
    nb::dict d = nb::dict(params);  // a copy: keys are removed as they are read
    const int64_t seed = take<int64_t>(d, "seed", (int64_t) LLAMA_DEFAULT_SEED);
    if (seed < 0 || seed > 0xFFFFFFFFll) raise_value("seed must be in [0, 2**32 - 1]; got " + std::to_string(seed));
    p.seed = (uint32_t) seed;
    // defaults: common_params_sampling's own (what llama-cli uses), except where noted
    using P = common_params_sampling;
    static const std::pair<const char *, float P::*> floats[] = { { "temperature", &P::temp },
                                                                  { "dynatemp_range", &P::dynatemp_range },
                                                                  { "dynatemp_exponent", &P::dynatemp_exponent },
                                                                  { "top_p", &P::top_p },
                                                                  { "min_p", &P::min_p },
                                                                  { "typical_p", &P::typ_p },
                                                                  { "top_n_sigma", &P::top_n_sigma },
                                                                  { "xtc_probability", &P::xtc_probability },
                                                                  { "xtc_threshold", &P::xtc_threshold },
                                                                  { "repeat_penalty", &P::penalty_repeat },
                                                                  { "frequency_penalty", &P::penalty_freq },
                                                                  { "presence_penalty", &P::penalty_present },
                                                                  { "dry_multiplier", &P::dry_multiplier },
                                                                  { "dry_base", &P::dry_base },
                                                                  { "mirostat_tau", &P::mirostat_tau },
                                                                  { "mirostat_eta", &P::mirostat_eta } };
    static const std::pair<const char *, int32_t P::*> ints[] = { { "top_k", &P::top_k },
                                                                  { "min_keep", &P::min_keep },
                                                                  { "repeat_last_n", &P::penalty_last_n },
                                                                  { "dry_allowed_length", &P::dry_allowed_length },
                                                                  { "mirostat", &P::mirostat } };
    for (const auto & [key, field] : floats) p.*field = num(d, key, p.*field);
    for (const auto & [key, field] : ints) p.*field = take<int>(d, key, p.*field);
    p.dry_penalty_last_n = take<int>(d, "dry_penalty_last_n", -1);  // -1: the context size (common: 64)
    p.dry_sequence_breakers = take<std::vector<std::string>>(d, "dry_sequence_breakers", p.dry_sequence_breakers);
    p.ignore_eos = take<bool>(d, "ignore_eos", p.ignore_eos);
    p.no_perf = true;
    if (p.mirostat < 0 || p.mirostat > 2)
        raise_value("mirostat must be 0 (off), 1 or 2; got " + std::to_string(p.mirostat));
    if (p.penalty_last_n < -1) raise_value("repeat_last_n must be >= -1; got " + std::to_string(p.penalty_last_n));
    if (p.dry_penalty_last_n < -1)
        raise_value("dry_penalty_last_n must be >= -1; got " + std::to_string(p.dry_penalty_last_n));
    if (p.dry_allowed_length < 0)
        raise_value("dry_allowed_length must be >= 0; got " + std::to_string(p.dry_allowed_length));
    if (p.min_keep < 0) raise_value("min_keep must be >= 0; got " + std::to_string(p.min_keep));
    // common's "-1 = the context size": without a context at hand, the model's training context
    // (the samplers allocate a ring buffer of that many tokens)
    const int32_t whole = std::min<int32_t>(std::max<int32_t>(llama_model_n_ctx_train(model.get()), 1), 1 << 20);
    if (p.penalty_last_n == -1) p.penalty_last_n = whole;
    if (p.dry_penalty_last_n == -1) p.dry_penalty_last_n = whole;
    if (p.penalty_last_n > (1 << 20) || p.dry_penalty_last_n > (1 << 20))
        raise_value("repeat_last_n and dry_penalty_last_n must be <= 2**20");

    // logit bias: {token id: bias}; -inf bans the token
    nb::dict bias = take<nb::dict>(d, "logit_bias", nb::dict());
    for (auto [k, v] : bias) {
        const int64_t t = nb::cast<int64_t>(k);
        model.check_token(t, "logit_bias token");
        const double b = nb::cast<double>(v);
        if (std::isnan(b) || b == INFINITY)
            raise_value("logit_bias values must be finite or -inf; got " + std::to_string(b));
        p.logit_bias.push_back({ (llama_token) t, (float) b });
    }
    if (p.ignore_eos) {
        for (int32_t t = 0; t < n_vocab; ++t) {
            if (llama_vocab_is_eog(vocab, t)) p.logit_bias.push_back({ t, -INFINITY });
        }
    }

    // grammar: a user's GBNF, or one from a chat template (tool calls / JSON schema output)
    std::string grammar = take<std::string>(d, "grammar", "");
    if (chat && !chat->p.grammar.empty()) {
        if (!grammar.empty()) raise_value("give either grammar or a chat response format/tools, not both");
        const common_chat_params & cp = chat->p;
        p.grammar = { chat->from_schema ? COMMON_GRAMMAR_TYPE_OUTPUT_FORMAT : COMMON_GRAMMAR_TYPE_TOOL_CALLS,
                      cp.grammar };
        p.grammar_lazy = cp.grammar_lazy;
        p.generation_prompt = cp.generation_prompt;
        for (const auto & t : cp.preserved_tokens) {
            auto ids = common_tokenize(vocab, t, false, true);
            if (ids.size() == 1) p.preserved_tokens.insert(ids[0]);
        }
        for (const auto & t : cp.grammar_triggers) {
            if (t.type == COMMON_GRAMMAR_TRIGGER_TYPE_WORD) {
                auto ids = common_tokenize(vocab, t.value, false, true);
                if (ids.size() == 1 && p.preserved_tokens.count(ids[0])) {
                    common_grammar_trigger tt;
                    tt.type = COMMON_GRAMMAR_TRIGGER_TYPE_TOKEN;
                    tt.value = t.value;
                    tt.token = ids[0];
                    p.grammar_triggers.push_back(tt);
                    continue;
                }
            }
            p.grammar_triggers.push_back(t);
        }
        if (p.grammar_lazy && p.grammar_triggers.empty())
            raise_value("the chat template gave a lazy grammar without triggers");
    } else if (!grammar.empty()) {
        p.grammar = { COMMON_GRAMMAR_TYPE_USER, grammar };
    }
    if (d.size() != 0) {
        std::string names;
        for (auto [k, v] : d) names += (names.empty() ? "" : ", ") + nb::cast<std::string>(nb::str(k));
        raise_type("unknown sampling parameter(s): " + names);
    }

    // Greedy decoding (temperature 0): common's chain runs top-k, top-p, min-p and a temperature-0
    // filter, then draws from the one token left: the argmax of the logits after logit bias,
    // penalties and DRY, which those filters never remove. A chain of logit bias, penalties, DRY and
    // llama's greedy sampler picks that token without sorting the vocabulary on the CPU, and is one
    // argmax kernel with backend sampling (the filters' kernels there cost ~0.1 ms per token on an
    // H100). typical_p, XTC, dynamic temperature and mirostat can move the choice off the argmax:
    // with them, common's chain as it is.
    const bool greedy =
        p.temp <= 0.0f && p.mirostat == 0 && p.typ_p >= 1.0f && p.xtc_probability <= 0.0f && p.dynatemp_range <= 0.0f;
    if (greedy) p.samplers = { COMMON_SAMPLER_TYPE_PENALTIES, COMMON_SAMPLER_TYPE_DRY };
    self->grammar = !p.grammar.grammar.empty();
    common_sampler * s = nullptr;
    {
        clear_recent_errors();
        try {
            s = common_sampler_init(model.get(), p);
        } catch (const std::exception & e) {
            raise_value(std::string("invalid sampler parameters: ") + e.what() + "\n" + take_recent_errors());
        }
    }
    if (!s) raise_value("common_sampler_init failed\n" + take_recent_errors());
    if (greedy) {  // common ends the chain with dist: greedy instead
        llama_sampler * chain = common_sampler_get(s);
        llama_sampler_free(llama_sampler_chain_remove(chain, llama_sampler_chain_n(chain) - 1));
        llama_sampler_chain_add(chain, llama_sampler_init_greedy());
    }
    // nothing between the logit bias and greedy changes a logit (and no grammar, which
    // common_sampler_sample applies): sample() takes the argmax of the biased logits itself instead
    // of copying n_vocab candidates through the chain first (83 -> 18.5 us per token on the CPU at
    // n_vocab 49k; with a bias, one copy of the logits more)
    self->argmax =
        greedy && !self->grammar && p.dry_multiplier == 0.0f &&
        (p.penalty_last_n == 0 || (p.penalty_repeat == 1.0f && p.penalty_freq == 0.0f && p.penalty_present == 0.0f));
    if (self->argmax) {  // the bias common_sampler_init merges: the user's, then the model's suppress tokens
        self->bias = p.logit_bias;
        int32_t n_suppress = 0;
        const llama_token * suppress = llama_vocab_get_suppress_tokens(vocab, &n_suppress);
        for (int32_t i = 0; i < n_suppress; ++i) self->bias.push_back({ suppress[i], -INFINITY });
    }
    self->chain = s;
    self->vocab = vocab;
    self->n_vocab = n_vocab;
}

void forget_backend_sampler(Context & c) {
    for (auto & [seq, s] : c.backend_samplers) s->attached = nullptr;
    c.backend_samplers.clear();
}

// Attach the chain to ctx's sequence seq_id (llama_set_sampler). False when llama.cpp cannot run its
// first sampler on the output device (the chain then samples on the CPU, as before).
static bool attach(Sampler & self, Context & ctx, int32_t seq_id) {
    common_sampler * s = self.get();
    llama_context * c = ctx.get();
    if (self.grammar) raise_value("a sampler chain with a grammar cannot run on the backend");
    if (self.was_attached) raise_value("this sampler chain was attached once already: build a new one");
    if (ctx.encoder_only) raise_value("an encoder-only model has no logits to sample");
    const int32_t n_seq = (int32_t) llama_n_seq_max(c);
    if (seq_id < 0 || seq_id >= n_seq) {
        raise_value("seq_id must be in [0, " + std::to_string(n_seq) + "); got " + std::to_string(seq_id));
    }
    BusyGuard guard(ctx);
    auto prev = ctx.backend_samplers.find(seq_id);
    if (prev != ctx.backend_samplers.end()) prev->second->detach();  // an abandoned stream's chain: superseded
    self.was_attached = true;
    bool ok;
    {
        nb::gil_scoped_release release;
        clear_recent_errors();
        ok = llama_set_sampler(c, seq_id, common_sampler_get(s));
    }
    if (!ok) return false;
    self.attached = &ctx;
    self.attached_seq = seq_id;
    ctx.backend_samplers[seq_id] = &self;
    return true;
}

static void detach(Sampler & self) {
    if (!self.attached) return;
    BusyGuard guard(*self.attached);
    self.detach();
}

// The token llama_sampler_greedy picks: the first index of the largest logit (NaNs never win;
// a NaN at 0 keeps 0). Eight running maxima instead of one compare chain (3x faster at n_vocab 49k:
// the single chain is bound by its latency), then the first index that holds the maximum.
static llama_token first_argmax(const float * l, int32_t n) {
    if (std::isnan(l[0])) return 0;
    float m[8];
    std::fill(m, m + 8, l[0]);
    int32_t i = 0;
    for (; i + 8 <= n; i += 8) {
        for (int k = 0; k < 8; ++k) m[k] = l[i + k] > m[k] ? l[i + k] : m[k];
    }
    for (; i < n; ++i) m[0] = l[i] > m[0] ? l[i] : m[0];
    const float best = *std::max_element(m, m + 8);
    for (i = 0; i < n; ++i) {
        if (l[i] == best) return i;
    }
    return 0;
}

// An argmax chain's token (logit bias + greedy): the first argmax of the logits row plus llama_sampler_logit_bias's
// sums, in its order (the user's and the model's suppressed tokens).
static llama_token biased_argmax(Sampler & self, const float * l) {
    if (!self.bias.empty()) {
        self.scratch.assign(l, l + self.n_vocab);
        for (const auto & b : self.bias) self.scratch[b.token] += b.bias;
        l = self.scratch.data();
    }
    return first_argmax(l, self.n_vocab);
}

// Sample the next token from the logits of batch position idx (-1: the last output), and accept
// it into the chain's state (penalties, grammar, mirostat), as llama-cli does.
static int32_t sample(Sampler & self, Context & ctx, int32_t idx) {
    common_sampler * s = self.get();
    llama_context * c = ctx.get();
    if (!ctx.has_logits) raise_value("no logits to sample from: decode() first");
    if (idx < -1 || (idx >= 0 && idx >= ctx.n_batch_last)) {
        raise_value("idx must be -1 or a position of the last batch, in [0, " + std::to_string(ctx.n_batch_last) +
                    "); got " + std::to_string(idx));
    }
    BusyGuard guard(ctx);
    llama_token t;
    std::string err;
    {
        nb::gil_scoped_release release;
        clear_recent_errors();
        try {
            // a chain that ran whole in the decode graph left its token: skip common_sampler_sample,
            // which would copy the (absent) logits of the whole vocabulary first
            t = self.attached == &ctx ? llama_get_sampled_token_ith(c, idx) : LLAMA_TOKEN_NULL;
            if (t == LLAMA_TOKEN_NULL && self.argmax) {  // decode() synchronized already
                if (const float * l = llama_get_logits_ith(c, idx)) t = biased_argmax(self, l);
            }
            if (t == LLAMA_TOKEN_NULL) t = common_sampler_sample(s, c, idx);
            common_sampler_accept(s, t, true);
        } catch (const std::exception & e) {
            err = e.what();
        }
    }
    if (!err.empty()) throw LlamaError("sampling failed: " + err + "\n" + take_recent_errors());
    return t;
}

// One chain's token from a logits row, off the GIL and off the context (sample_many's threads): the argmax path as
// sample(), else what common_sampler_sample does for a chain without grammar or reasoning budget (the candidates of
// every token, the chain applied, its selected token), then common_sampler_accept. The same token as sample().
static llama_token sample_row(Sampler & self, const float * l) {
    if (self.argmax) {
        const llama_token t = biased_argmax(self, l);
        common_sampler_accept(self.chain, t, true);
        return t;
    }
    self.cand.resize(self.n_vocab);
    for (int32_t i = 0; i < self.n_vocab; ++i) self.cand[i] = llama_token_data{ i, l[i], 0.0f };
    llama_token_data_array cur_p = { self.cand.data(), self.cand.size(), -1, false };
    llama_sampler_apply(common_sampler_get(self.chain), &cur_p);
    if (cur_p.selected < 0 || cur_p.selected >= (int64_t) cur_p.size) throw std::runtime_error("no token selected");
    const llama_token t = cur_p.data[cur_p.selected].id;
    common_sampler_accept(self.chain, t, true);
    return t;
}

// sample() for several chains at once, chain k from batch position idxs[k] of ctx's last batch, the chains without
// a grammar spread over n_threads threads (each chain is its own state: the tokens are those sample() would give
// called on each in turn); chains with a grammar, or attached to ctx, take sample() in this thread.
static std::vector<int32_t> sample_many(const std::vector<Sampler *> & samplers, Context & ctx,
                                        const std::vector<int32_t> & idxs, int n_threads) {
    const size_t n = samplers.size();
    if (idxs.size() != n)
        raise_value("sample_many: one batch position a sampler (got " + std::to_string(n) + " samplers and " +
                    std::to_string(idxs.size()) + " positions)");
    if (n_threads < 1 || n_threads > 512)
        raise_value("n_threads must be in [1, 512]; got " + std::to_string(n_threads));
    for (size_t k = 0; k < n; ++k) {
        if (!samplers[k]) raise_type("sample_many: samplers must be Sampler objects, not None");
        samplers[k]->get();
        for (size_t j = 0; j < k; ++j) {
            if (samplers[j] == samplers[k]) raise_value("sample_many: a sampler is given twice (its state is one)");
        }
    }
    for (int32_t idx : idxs) {  // every position checked before any chain samples (and changes its state)
        if (idx < -1 || (idx >= 0 && idx >= ctx.n_batch_last)) {
            raise_value("idx must be -1 or a position of the last batch, in [0, " + std::to_string(ctx.n_batch_last) +
                        "); got " + std::to_string(idx));
        }
    }
    std::vector<int32_t> out(n, LLAMA_TOKEN_NULL);
    std::vector<size_t> par;  // the chains sampled by the threads
    for (size_t k = 0; k < n; ++k) {
        Sampler & s = *samplers[k];
        if (s.grammar || s.attached == &ctx) {
            out[k] = sample(s, ctx, idxs[k]);
        } else {
            par.push_back(k);
        }
    }
    if (par.empty()) return out;
    if (!ctx.has_logits) raise_value("no logits to sample from: decode() first");
    std::vector<const float *> rows(n, nullptr);
    BusyGuard guard(ctx);
    std::string err;
    {
        nb::gil_scoped_release release;
        clear_recent_errors();
        llama_synchronize(ctx.get());
        for (size_t k : par) rows[k] = llama_get_logits_ith(ctx.get(), idxs[k]);  // in this thread: it synchronizes
        const size_t n_thr = std::min<size_t>((size_t) n_threads, par.size());
        std::vector<std::string> errs(n_thr);
        auto work = [&](size_t w) {
            for (size_t i = w; i < par.size(); i += n_thr) {
                const size_t k = par[i];
                try {
                    if (!rows[k]) throw std::runtime_error("no logits at batch position " + std::to_string(idxs[k]));
                    out[k] = sample_row(*samplers[k], rows[k]);
                } catch (const std::exception & e) {
                    if (errs[w].empty()) errs[w] = e.what();
                }
            }
        };
        std::vector<std::thread> threads;
        for (size_t w = 1; w < n_thr; ++w) threads.emplace_back(work, w);
        work(0);
        for (auto & t : threads) t.join();
        for (const auto & e : errs) {
            if (err.empty() && !e.empty()) err = e;
        }
    }
    if (!err.empty()) throw LlamaError("sampling failed: " + err + "\n" + take_recent_errors());
    return out;
}

static void accept(Sampler & self, const std::vector<int64_t> & tokens, bool is_generated) {
    common_sampler * s = self.get();
    for (int64_t t : tokens) {
        if (t < 0 || t >= self.n_vocab) raise_value("token id " + std::to_string(t) + " is out of range [0, n_vocab)");
    }
    try {
        for (int64_t t : tokens) common_sampler_accept(s, (llama_token) t, is_generated);
    } catch (const std::exception & e) {
        // a grammar that cannot accept the token: llama.cpp throws std::runtime_error
        raise_value(std::string("the sampler rejected a token: ") + e.what());
    }
}

void register_sampling(nb::module_ & m) {
    m.def("sample_many", &sample_many, nb::arg("samplers"), nb::arg("context"), nb::arg("idxs"), nb::arg("n_threads"),
          "sample() of each chain at its batch position of context's last batch, chains without a grammar over "
          "n_threads threads; ValueError for unequal lengths, a chain given twice or a bad position.");
    nb::class_<Sampler>(m, "Sampler", "llama.cpp common's sampler chain (common_sampler_init).")
        .def("__init__", &sampler_init, nb::arg("model"), nb::arg("params"), nb::arg("chat").none() = nb::none(),
             nb::keep_alive<1, 2>(),
             "params: dict of llamabind.SamplingParams fields; chat: the ChatParams whose grammar to apply. "
             "Raises ValueError (bad value, grammar that does not parse), TypeError (unknown key).")
        .def("sample", &sample, nb::arg("context"), nb::arg("idx") = -1,
             "Next token id from the logits of batch position idx (-1: last), accepted into the chain "
             "(common_sampler_sample + common_sampler_accept).")
        .def("accept", &accept, nb::arg("tokens"), nb::arg("is_generated") = false,
             "Feed tokens to the chain's state (penalties; grammar only if is_generated).")
        .def("attach", &attach, nb::arg("context"), nb::arg("seq_id") = 0,
             "Run the chain inside context's decode graph for sequence seq_id (llama_set_sampler): sample() "
             "then reads the token sampled on the device. Returns False if llama.cpp cannot offload "
             "the chain. Once per chain; ValueError with a grammar or a seq_id out of range. A chain attached to the "
             "same sequence before is detached. Until detach(), the context has no logits.")
        .def("detach", &detach, "Take the chain out of the context's decode graph (llama_set_sampler(nullptr)).")
        .def_prop_ro("attached", [](const Sampler & s) { return s.attached != nullptr; })
        .def("reset", [](Sampler & s) { common_sampler_reset(s.get()); })
        .def("close", &Sampler::close)
        .def_prop_ro("seed", [](const Sampler & s) { return common_sampler_get_seed(s.get()); })
        .def_prop_ro("description", [](const Sampler & s) { return common_sampler_print(s.get()); });
}

}  // namespace lb
