// Sampler: a llama.cpp sampler chain (llama_sampler_chain_init + llama_sampler_init_*), in the
// order of common/sampling.cpp: penalties -> top_k -> top_p -> min_p -> temperature -> dist.
// temperature <= 0 gives greedy decoding (argmax) after the penalties.
#include "objects.h"

#include <nanobind/stl/vector.h>

#include <cmath>

namespace lb {

struct Sampler {
    llama_sampler * chain = nullptr;
    ~Sampler() { close(); }
    void close() {
        if (chain) {
            llama_sampler_free(chain);
            chain = nullptr;
        }
    }
    llama_sampler * get() const {
        if (!chain) raise_value("the sampler is closed");
        return chain;
    }
};

static void check_finite(const char * name, double v) {
    if (!std::isfinite(v)) raise_value(std::string(name) + " must be a finite number; got " + std::to_string(v));
}

static void sampler_init(Sampler * self, Model & model, double temperature, int top_k, double top_p, double min_p,
                         double repeat_penalty, int repeat_last_n, double frequency_penalty, double presence_penalty,
                         uint32_t seed) {
    new (self) Sampler();
    model.get();
    check_finite("temperature", temperature);
    check_finite("top_p", top_p);
    check_finite("min_p", min_p);
    check_finite("repeat_penalty", repeat_penalty);
    check_finite("frequency_penalty", frequency_penalty);
    check_finite("presence_penalty", presence_penalty);
    if (top_k < 0) raise_value("top_k must be >= 0 (0 disables it); got " + std::to_string(top_k));
    if (top_p <= 0.0 || top_p > 1.0) raise_value("top_p must be in (0, 1] (1 disables it); got " + std::to_string(top_p));
    if (min_p < 0.0 || min_p > 1.0) raise_value("min_p must be in [0, 1] (0 disables it); got " + std::to_string(min_p));
    if (repeat_penalty <= 0.0) raise_value("repeat_penalty must be > 0 (1 disables it); got " + std::to_string(repeat_penalty));
    if (repeat_last_n < -1) raise_value("repeat_last_n must be >= 0, or -1 for the whole context; got " + std::to_string(repeat_last_n));

    llama_sampler_chain_params cp = llama_sampler_chain_default_params();
    cp.no_perf = true;
    llama_sampler * c = llama_sampler_chain_init(cp);
    if (repeat_last_n != 0 && (repeat_penalty != 1.0 || frequency_penalty != 0.0 || presence_penalty != 0.0)) {
        llama_sampler_chain_add(c, llama_sampler_init_penalties(model.n_vocab(), repeat_last_n == -1 ? 1 << 30 : repeat_last_n,
                                                                (float) repeat_penalty, (float) frequency_penalty,
                                                                (float) presence_penalty));
    }
    if (temperature <= 0.0) {
        llama_sampler_chain_add(c, llama_sampler_init_greedy());
    } else {
        if (top_k > 0) llama_sampler_chain_add(c, llama_sampler_init_top_k(top_k));
        if (top_p < 1.0) llama_sampler_chain_add(c, llama_sampler_init_top_p((float) top_p, 1));
        if (min_p > 0.0) llama_sampler_chain_add(c, llama_sampler_init_min_p((float) min_p, 1));
        llama_sampler_chain_add(c, llama_sampler_init_temp((float) temperature));
        llama_sampler_chain_add(c, llama_sampler_init_dist(seed));
    }
    self->chain = c;
}

// Sample the next token from the context's last logits, and accept it into the chain's state.
static int32_t sample(Sampler & self, Context & ctx) {
    llama_sampler * s = self.get();
    llama_context * c = ctx.get();
    if (!ctx.has_logits) raise_value("no logits to sample from: decode() the prompt first");
    BusyGuard guard(ctx);
    llama_token t;
    {
        nb::gil_scoped_release release;
        t = llama_sampler_sample(s, c, -1);
    }
    return t;
}

static void accept(Sampler & self, Model & model, const std::vector<int64_t> & tokens) {
    llama_sampler * s = self.get();
    for (int64_t t : tokens) {
        model.check_token(t);
        llama_sampler_accept(s, (llama_token) t);
    }
}

void register_sampling(nb::module_ & m) {
    nb::class_<Sampler>(m, "Sampler", "A llama.cpp sampler chain (llama_sampler_chain_init).")
        .def("__init__", &sampler_init, nb::arg("model"), nb::arg("temperature") = 0.8, nb::arg("top_k") = 40,
             nb::arg("top_p") = 0.95, nb::arg("min_p") = 0.05, nb::arg("repeat_penalty") = 1.0, nb::arg("repeat_last_n") = 64,
             nb::arg("frequency_penalty") = 0.0, nb::arg("presence_penalty") = 0.0, nb::arg("seed") = LLAMA_DEFAULT_SEED, nb::keep_alive<1, 2>())
        .def("sample", &sample, nb::arg("context"), "Next token id from the context's last logits (llama_sampler_sample).")
        .def("accept", &accept, nb::arg("model"), nb::arg("tokens"), "Feed tokens to the chain's state (e.g. penalties).")
        .def("reset", [](Sampler & s) { llama_sampler_reset(s.get()); })
        .def("close", &Sampler::close)
        .def_prop_ro("description", [](const Sampler & s) {
            std::string out;
            llama_sampler * c = s.get();
            for (int i = 0; i < llama_sampler_chain_n(c); ++i) {
                if (i) out += " -> ";
                out += llama_sampler_name(llama_sampler_chain_get(c, i));
            }
            return out;
        });
}

}  // namespace lb
