// Context's KV cache per sequence (llama_memory_*): positions, removal, shifts, copies, and the
// record of M-RoPE media (whose tokens outnumber their positions) those follow.
#include "objects.h"

#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <tuple>

namespace lb {

llama_pos next_pos(Context & self, llama_seq_id seq) {
    llama_pos p = llama_memory_seq_pos_max(llama_get_memory(self.get()), seq) + 1;  // -1 for an empty sequence
    auto it = self.media.find(seq);
    if (it != self.media.end() && !it->second.empty()) p = std::max(p, it->second.back().p0 + it->second.back().n_pos);
    return p;
}

int64_t n_cells(Context & self, llama_seq_id seq) {
    int64_t n = next_pos(self, seq);
    auto it = self.media.find(seq);
    if (it != self.media.end()) {
        for (const auto & m : it->second) n += m.n_tokens - m.n_pos;
    }
    return n;
}

// Whether a medium starts in positions [p0, p1) (p0 -1: from 0; p1 -1: open end), as llama_memory_seq_* read them.
static bool starts_in(const Context::MediaSpan & m, int64_t p0, int64_t p1) {
    return m.p0 >= std::max<int64_t>(p0, 0) && (p1 < 0 || m.p0 < p1);
}

void forget_media(Context & self, llama_seq_id seq, llama_pos p0, llama_pos p1) {
    for (auto it = self.media.begin(); it != self.media.end();) {
        if (seq < 0 || it->first == seq) {
            auto & v = it->second;
            v.erase(std::remove_if(v.begin(), v.end(), [&](const auto & m) { return starts_in(m, p0, p1); }), v.end());
        }
        it = it->second.empty() ? self.media.erase(it) : std::next(it);
    }
}

static void clear(Context & self) {
    llama_context * c = self.get();
    self.check_no_views("clear the KV cache");
    BusyGuard guard(self);
    llama_memory_clear(llama_get_memory(c), true);
    self.media.clear();
    self.has_logits = false;
    self.n_batch_last = 0;
}

// --- KV cache per sequence (llama_memory_seq_*)
static llama_memory_t memory(Context & self, int64_t seq) {
    llama_context * c = self.get();
    if (seq != -1) check_seq(c, seq);
    self.check_no_views("change the KV cache");
    return llama_get_memory(c);
}

static bool seq_rm(Context & self, int64_t seq, int64_t p0, int64_t p1) {
    llama_memory_t mem = memory(self, seq);
    if (p0 < -1 || p1 < -1) raise_value("positions must be >= 0, or -1 for an open end");
    BusyGuard guard(self);
    self.has_logits = false;
    const bool ok = llama_memory_seq_rm(mem, (llama_seq_id) seq, (llama_pos) p0, (llama_pos) p1);
    if (ok) forget_media(self, (llama_seq_id) seq, (llama_pos) p0, (llama_pos) p1);
    return ok;
}

// Add delta to the positions [p0, p1) of a sequence (llama_memory_seq_add: RoPE'd K is shifted at the
// next decode). Context shift: seq_rm of a span, then the rest moved down over it.
static void seq_add(Context & self, int64_t seq, int64_t p0, int64_t p1, int64_t delta) {
    llama_memory_t mem = memory(self, seq);
    if (seq < 0) raise_value("seq_add needs a sequence id >= 0");
    if (p0 < -1 || p1 < -1) raise_value("positions must be >= 0, or -1 for an open end");
    if (!llama_memory_can_shift(mem)) {
        raise_value("this model's KV cache cannot shift positions (llama_memory_can_shift: false)");
    }
    BusyGuard guard(self);
    self.has_logits = false;
    llama_memory_seq_add(mem, (llama_seq_id) seq, (llama_pos) p0, (llama_pos) p1, (llama_pos) delta);
    auto it = self.media.find((llama_seq_id) seq);
    if (it != self.media.end()) {
        for (auto & m : it->second) {
            if (starts_in(m, p0, p1)) m.p0 += (llama_pos) delta;
        }
    }
}

static void seq_cp(Context & self, int64_t src, int64_t dst, int64_t p0, int64_t p1) {
    llama_memory_t mem = memory(self, src);
    check_seq(self.get(), dst);
    if (src == dst) raise_value("seq_cp needs two different sequences; got " + std::to_string(src) + " twice");
    if (p0 < -1 || p1 < -1) raise_value("positions must be >= 0, or -1 for an open end");
    BusyGuard guard(self);
    llama_memory_seq_cp(mem, (llama_seq_id) src, (llama_seq_id) dst, (llama_pos) p0, (llama_pos) p1);
    auto it = self.media.find((llama_seq_id) src);
    if (it != self.media.end()) {
        std::vector<Context::MediaSpan> spans = it->second;  // copied first: dst's entry may be created
        auto & out = self.media[(llama_seq_id) dst];
        for (const auto & m : spans) {
            if (starts_in(m, p0, p1)) out.push_back(m);
        }
        std::sort(out.begin(), out.end(), [](const auto & a, const auto & b) { return a.p0 < b.p0; });
        if (out.empty()) self.media.erase((llama_seq_id) dst);
    }
}

// A restored state's M-RoPE media record: spans in position order, each inside n_ctx, with more
// tokens than positions.
static void set_media_spans(Context & self, int64_t seq,
                            const std::vector<std::tuple<int64_t, int64_t, int64_t>> & spans) {
    check_seq(self.get(), seq);
    const int64_t n_ctx = llama_n_ctx_seq(self.get());
    std::vector<Context::MediaSpan> v;
    int64_t end = 0, extra = 0;
    for (const auto & [p0, n_pos, n_tokens] : spans) {
        const bool in_range = p0 >= 0 && p0 < n_ctx && n_pos >= 1 && n_pos < n_tokens && n_tokens <= n_ctx;
        if (!in_range || p0 < end || p0 + n_tokens + extra > n_ctx) {  // (in range: no overflow)
            raise_value("not a media record of this context: span (" + std::to_string(p0) + ", " +
                        std::to_string(n_pos) + ", " + std::to_string(n_tokens) + ")");
        }
        end = p0 + n_pos;
        extra += n_tokens - n_pos;
        v.push_back(Context::MediaSpan{ (llama_pos) p0, (llama_pos) n_pos, (int32_t) n_tokens });
    }
    if (v.empty()) {
        self.media.erase((llama_seq_id) seq);
    } else {
        self.media[(llama_seq_id) seq] = std::move(v);
    }
}

static void seq_keep(Context & self, int64_t seq) {
    llama_memory_t mem = memory(self, seq);
    BusyGuard guard(self);
    llama_memory_seq_keep(mem, (llama_seq_id) seq);
    for (auto it = self.media.begin(); it != self.media.end();)
        it = it->first == seq ? std::next(it) : self.media.erase(it);
}

void add_memory_methods(nb::class_<Context> & cls) {
    cls.def(
           "pos",
           [](Context & s, int64_t seq) {
               check_seq(s.get(), seq);
               return next_pos(s, (llama_seq_id) seq);
           },
           nb::arg("seq_id") = 0,
           "A sequence's next position: llama_memory_seq_pos_max + 1, or past its last M-RoPE medium's positions.")
        .def(
            "n_cells",
            [](Context & s, int64_t seq) {
                check_seq(s.get(), seq);
                return n_cells(s, (llama_seq_id) seq);
            },
            nb::arg("seq_id") = 0, "KV cache cells a sequence holds: its positions, + the tokens M-RoPE media add.")
        .def(
            "media_spans",
            [](Context & s, int64_t seq) {
                check_seq(s.get(), seq);
                std::vector<std::tuple<int64_t, int64_t, int64_t>> out;
                auto it = s.media.find((llama_seq_id) seq);
                if (it != s.media.end()) {
                    for (const auto & m : it->second) out.emplace_back(m.p0, m.n_pos, m.n_tokens);
                }
                return out;
            },
            nb::arg("seq_id") = 0, "[(p0, n_pos, n_tokens)]: a sequence's M-RoPE media (for states).")
        .def("set_media_spans", &set_media_spans, nb::arg("seq_id"), nb::arg("spans"),
             "Replace a sequence's M-RoPE media record (a restored state's).")
        .def(
            "pos_min",
            [](Context & s, int64_t seq) {
                check_seq(s.get(), seq);
                return llama_memory_seq_pos_min(llama_get_memory(s.get()), (llama_seq_id) seq);
            },
            nb::arg("seq_id") = 0)
        .def("clear", &clear, "Empty the KV cache (wraps llama_memory_clear).")
        .def_prop_ro(
            "can_shift", [](const Context & c) { return llama_memory_can_shift(llama_get_memory(c.get())); },
            "Whether the KV cache can shift positions (llama_memory_can_shift; false for recurrent models).")
        .def("seq_add", &seq_add, nb::arg("seq_id"), nb::arg("p0"), nb::arg("p1"), nb::arg("delta"),
             "Add delta to positions [p0, p1) of a sequence (-1: open end). Wraps llama_memory_seq_add.")
        .def("seq_rm", &seq_rm, nb::arg("seq_id"), nb::arg("p0") = -1, nb::arg("p1") = -1,
             "Remove positions [p0, p1) of a sequence (-1: all sequences / open end). Wraps llama_memory_seq_rm.")
        .def("seq_cp", &seq_cp, nb::arg("src"), nb::arg("dst"), nb::arg("p0") = -1, nb::arg("p1") = -1,
             "Share positions [p0, p1) of sequence src with dst (llama_memory_seq_cp).")
        .def("seq_keep", &seq_keep, nb::arg("seq_id"), "Drop every sequence but seq_id (llama_memory_seq_keep).");
}

}  // namespace lb
