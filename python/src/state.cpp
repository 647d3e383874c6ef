// Context state: the KV cache saved and restored as bytes or a file (llama_state_*), methods of
// _core.Context (context.cpp registers the class).
#include "objects.h"

#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <sys/stat.h>

namespace lb {

static nb::bytes state_get(Context & self) {
    llama_context * c = self.get();
    BusyGuard guard(self);
    std::string buf;
    {
        nb::gil_scoped_release release;
        buf.resize(llama_state_get_size(c));
        buf.resize(llama_state_get_data(c, (uint8_t *) buf.data(), buf.size()));
    }
    if (buf.empty()) throw LlamaError("llama_state_get_data failed\n" + take_recent_errors());
    return nb::bytes(buf.data(), buf.size());
}

static void after_failed_restore(Context & self) {
    llama_memory_clear(llama_get_memory(self.get()), true);  // a partial restore is not a state: start empty
    self.media.clear();
    self.has_logits = false;
}

static void state_set(Context & self, nb::bytes data) {
    llama_context * c = self.get();
    self.check_no_views("restore a state");
    BusyGuard guard(self);
    clear_recent_errors();
    size_t n;
    {
        nb::gil_scoped_release release;
        n = llama_state_set_data(c, (const uint8_t *) data.c_str(), data.size());
    }
    if (n == 0 || n != data.size()) {
        after_failed_restore(self);
        raise_value("not a state of this context (llama_state_set_data read " + std::to_string(n) + " of " +
                    std::to_string(data.size()) + " bytes); the KV cache was cleared\n" + take_recent_errors());
    }
    self.media.clear();       // nor the M-RoPE media record (positions past the last image are lost)
    self.has_logits = false;  // at this pin a state holds the KV cache only, not the outputs
    self.n_batch_last = 0;
}

static void state_save_file(Context & self, const std::string & path, const std::vector<int64_t> & tokens) {
    llama_context * c = self.get();
    std::vector<llama_token> t = checked_tokens(self, tokens);
    BusyGuard guard(self);
    clear_recent_errors();
    bool ok;
    {
        nb::gil_scoped_release release;
        ok = llama_state_save_file(c, path.c_str(), t.data(), t.size());
    }
    if (!ok) raise_value("cannot save the state to '" + path + "'\n" + take_recent_errors());
}

static std::vector<int32_t> state_load_file(Context & self, const std::string & path) {
    llama_context * c = self.get();
    struct stat st;
    if (stat(path.c_str(), &st) != 0) raise_file_not_found("no such state file: '" + path + "'");
    self.check_no_views("restore a state");
    BusyGuard guard(self);
    std::vector<llama_token> t(llama_n_ctx(c));
    size_t n = 0;
    clear_recent_errors();
    bool ok;
    {
        nb::gil_scoped_release release;
        ok = llama_state_load_file(c, path.c_str(), t.data(), t.size(), &n);
    }
    if (!ok) {
        after_failed_restore(self);
        raise_value("'" + path + "' is not a state file of this context; the KV cache was cleared\n" +
                    take_recent_errors());
    }
    self.media.clear();
    self.has_logits = false;
    self.n_batch_last = 0;
    return std::vector<int32_t>(t.begin(), t.begin() + n);
}

void add_state_methods(nb::class_<Context> & cls) {
    cls.def("state_get", &state_get, "The whole context state as bytes (llama_state_get_data).")
        .def("state_set", &state_set, nb::arg("data"), "Restore a state from state_get (llama_state_set_data).")
        .def("state_save_file", &state_save_file, nb::arg("path"), nb::arg("tokens"))
        .def("state_load_file", &state_load_file, nb::arg("path"));
}

}  // namespace lb
