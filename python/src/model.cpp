// Model: a GGUF file loaded by llama.cpp (weights + vocabulary), and its tokenizer.
#include "objects.h"
#include "rpc.h"

#include <gguf.h>

#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <Python.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <memory>
#include <cstring>
#include <sys/stat.h>

namespace lb {

void Model::close() {
    if (in_use.load()) throw LlamaError("the model is in use by another thread: cannot close it now");
    for (auto * c : contexts) {
        if (c->busy.load())
            throw LlamaError("cannot close the model while one of its contexts is in use by another thread");
        c->check_no_views("close the model");
    }
    release();
}

void Model::release() {
    for (auto * c : std::set<Context *>(contexts)) c->release();
    contexts.clear();
    for (auto * l : loras) {  // llama_model_free frees them
        l->adapter = nullptr;
        l->owner = nullptr;
    }
    loras.clear();
    free_projectors(*this);
    if (model) {
        llama_model_free(model);
        model = nullptr;
        vocab = nullptr;
    }
}

// What llama.cpp would otherwise only log: missing file, not a file, not GGUF.
static void check_gguf_file(const std::string & path) {
    struct stat st;
    if (stat(path.c_str(), &st) != 0) raise_file_not_found("no such GGUF file: '" + path + "'");
    if (!S_ISREG(st.st_mode)) raise_value("path must be a GGUF file, but '" + path + "' is not a regular file");
    FILE * f = std::fopen(path.c_str(), "rb");
    if (!f) raise_value("cannot open '" + path + "': " + std::strerror(errno));
    char magic[4] = { 0, 0, 0, 0 };
    size_t n = std::fread(magic, 1, 4, f);
    std::fclose(f);
    if (n < 4 || std::memcmp(magic, "GGUF", 4) != 0) {
        std::string got;
        for (size_t i = 0; i < n; ++i) {
            char buf[8];
            std::snprintf(buf, sizeof buf, "\\x%02x", (unsigned char) magic[i]);
            got += buf;
        }
        raise_value("'" + path + "' is not a GGUF file: it starts with b'" + got + "', expected the magic b'GGUF'");
    }
}

static nb::object gguf_value(const gguf_context * g, int64_t id, enum gguf_type t, const void * data, size_t i) {
    switch (t) {
        case GGUF_TYPE_UINT8: return nb::int_(((const uint8_t *) data)[i]);
        case GGUF_TYPE_INT8: return nb::int_(((const int8_t *) data)[i]);
        case GGUF_TYPE_UINT16: return nb::int_(((const uint16_t *) data)[i]);
        case GGUF_TYPE_INT16: return nb::int_(((const int16_t *) data)[i]);
        case GGUF_TYPE_UINT32: return nb::int_(((const uint32_t *) data)[i]);
        case GGUF_TYPE_INT32: return nb::int_(((const int32_t *) data)[i]);
        case GGUF_TYPE_UINT64: return nb::int_(((const uint64_t *) data)[i]);
        case GGUF_TYPE_INT64: return nb::int_(((const int64_t *) data)[i]);
        case GGUF_TYPE_FLOAT32: return nb::float_(((const float *) data)[i]);
        case GGUF_TYPE_FLOAT64: return nb::float_(((const double *) data)[i]);
        case GGUF_TYPE_BOOL: return nb::bool_(((const int8_t *) data)[i] != 0);
        case GGUF_TYPE_STRING: {
            const char * s = data ? gguf_get_val_str(g, id) : gguf_get_arr_str(g, id, i);
            return nb::steal(PyUnicode_DecodeUTF8(s, (Py_ssize_t) std::strlen(s), "replace"));
        }
        default: return nb::none();
    }
}

// A GGUF file's header (gguf_init_from_file, no tensor data); meta: the tensors' shapes, if asked.
static gguf_context * open_gguf_header(const std::string & path, ggml_context ** meta = nullptr) {
    check_gguf_file(path);
    gguf_init_params params = { /*no_alloc =*/true, /*ctx =*/meta };
    gguf_context * g;
    {
        nb::gil_scoped_release release;
        clear_recent_errors();
        g = gguf_init_from_file(path.c_str(), params);
    }
    if (!g) raise_value("cannot read the GGUF header of '" + path + "'\n" + take_recent_errors());
    return g;
}

// GGUF key/values with their types (ints, floats, bools, strings, lists), read by ggml's gguf.
static nb::dict read_metadata(const std::string & path) {
    gguf_context * g = open_gguf_header(path);
    nb::dict out;
    const int64_t n = gguf_get_n_kv(g);
    for (int64_t id = 0; id < n; ++id) {
        const char * key = gguf_get_key(g, id);
        const enum gguf_type t = gguf_get_kv_type(g, id);
        if (t == GGUF_TYPE_ARRAY) {
            const enum gguf_type at = gguf_get_arr_type(g, id);
            const size_t len = gguf_get_arr_n(g, id);
            const void * data = at == GGUF_TYPE_STRING ? nullptr : gguf_get_arr_data(g, id);
            nb::list l;
            for (size_t i = 0; i < len; ++i) l.append(gguf_value(g, id, at, data, i));
            out[key] = l;
        } else if (t == GGUF_TYPE_STRING) {
            out[key] = gguf_value(g, id, t, (const void *) 1, 0);
        } else {
            out[key] = gguf_value(g, id, t, gguf_get_val_data(g, id), 0);
        }
    }
    gguf_free(g);
    return out;
}

// [(name, ggml type name, ne[0..n_dims))] of a GGUF's tensors (numpy order is ne reversed).
static nb::list read_tensor_info(const std::string & path) {
    ggml_context * meta = nullptr;
    gguf_context * g = open_gguf_header(path, &meta);
    nb::list out;
    for (ggml_tensor * t = ggml_get_first_tensor(meta); t; t = ggml_get_next_tensor(meta, t)) {
        nb::list ne;
        for (int i = 0; i < ggml_n_dims(t); ++i) ne.append(t->ne[i]);
        out.append(nb::make_tuple(std::string(t->name), std::string(ggml_type_name(t->type)), ne));
    }
    gguf_free(g);
    ggml_free(meta);
    return out;
}

// Load progress -> a Python callable(progress: float in [0, 1]) -> bool | None (False cancels).
struct Progress {
    nb::object fn;
    bool cancelled = false;
    std::unique_ptr<nb::python_error> error;  // raised by fn; re-raised after the load returns
};

static bool on_progress(float progress, void * user) {
    Progress * p = (Progress *) user;
    nb::gil_scoped_acquire gil;
    try {
        nb::object r = p->fn(progress);
        const bool go = r.is_none() || nb::cast<bool>(r);
        if (!go) p->cancelled = true;
        return go;
    } catch (nb::python_error & e) {
        p->error = std::make_unique<nb::python_error>(e);
        return false;
    } catch (const std::exception & e) {  // e.g. a cast error on the return value
        PyErr_SetString(PyExc_TypeError, (std::string("progress callback: ") + e.what()).c_str());
        p->error = std::make_unique<nb::python_error>();
        return false;
    }
}

static void model_init(Model * self, const std::string & path, int n_gpu_layers, int load_mode, bool vocab_only,
                       int split_mode, int main_gpu, const std::vector<float> & tensor_split, nb::object progress,
                       const std::vector<std::string> & rpc, bool repack) {
    new (self) Model();
    if (n_gpu_layers < -1)
        raise_value("n_gpu_layers must be >= 0, or -1 for all layers; got " + std::to_string(n_gpu_layers));
    check_gguf_file(path);
    llama_model_params p = llama_model_default_params();
    p.n_gpu_layers = n_gpu_layers;
    p.vocab_only = vocab_only;
    p.use_extra_bufts = repack;  // repacked CPU weight layouts (AMX, AVX2/AArch64 interleaved), llama-cli's --repack
    if (load_mode < LLAMA_LOAD_MODE_AUTO || load_mode > LLAMA_LOAD_MODE_DIRECT_IO) {
        raise_value("load_mode must be one of llama_load_mode (-1 auto, 0 none, 1 mmap, ...); got " +
                    std::to_string(load_mode));
    }
    p.load_mode = (enum llama_load_mode) load_mode;
    if (split_mode < LLAMA_SPLIT_MODE_NONE || split_mode > LLAMA_SPLIT_MODE_TENSOR) {
        raise_value("split_mode must be 0 (none), 1 (layer), 2 (row) or 3 (tensor); got " + std::to_string(split_mode));
    }
    p.split_mode = (enum llama_split_mode) split_mode;
    bool any_rpc = false;
    std::vector<ggml_backend_dev_t> devices = offload_devices(rpc, any_rpc);  // rpc.cpp
    const size_t n_gpu = devices.size();                                      // what tensor_split and main_gpu index
    devices.push_back(nullptr);
    if (any_rpc) p.devices = devices.data();
    const int n_dev = (int) llama_max_devices();
    std::vector<float> split(std::max<size_t>(n_dev, tensor_split.size()), 0.0f);
    if (!tensor_split.empty()) {
        if ((int) tensor_split.size() > n_dev || (n_gpu > 0 && tensor_split.size() > n_gpu)) {
            raise_value("tensor_split has " + std::to_string(tensor_split.size()) + " entries; the model has " +
                        std::to_string(n_gpu) + " GPU/RPC devices (at most " + std::to_string(n_dev) +
                        " in this build)");
        }
        float sum = 0.0f;
        for (size_t i = 0; i < tensor_split.size(); ++i) {
            if (!std::isfinite(tensor_split[i]) || tensor_split[i] < 0.0f)
                raise_value("tensor_split entries must be finite and >= 0");
            split[i] = tensor_split[i];
            sum += split[i];
        }
        if (sum <= 0.0f) raise_value("tensor_split must have a positive entry");
        p.tensor_split = split.data();
    }
    if (main_gpu < 0 || (n_gpu > 0 && (size_t) main_gpu >= n_gpu) || (n_gpu == 0 && main_gpu != 0)) {
        raise_value("main_gpu must be in [0, " + std::to_string(std::max<size_t>(n_gpu, 1)) + "); got " +
                    std::to_string(main_gpu));
    }
    p.main_gpu = main_gpu;
    Progress prog;
    if (!progress.is_none()) {
        if (!PyCallable_Check(progress.ptr())) raise_type("progress must be a callable(float) or None");
        prog.fn = progress;
        p.progress_callback = on_progress;
        p.progress_callback_user_data = &prog;
    }
    llama_model * m;
    {
        nb::gil_scoped_release release;
        clear_recent_errors();
        m = llama_model_load_from_file(path.c_str(), p);
    }
    if (prog.error) {
        if (m) llama_model_free(m);
        throw nb::python_error(*prog.error);
    }
    if (!m && prog.cancelled) raise_value("loading '" + path + "' was cancelled by the progress callback");
    if (!m) raise_value("failed to load the GGUF model '" + path + "'\n" + take_recent_errors());
    self->model = m;
    self->vocab = llama_model_get_vocab(m);
    self->path = path;
    self->vocab_only = vocab_only;
    self->output_offloaded = n_gpu > 0 && (n_gpu_layers < 0 || n_gpu_layers > llama_model_n_layer(m));
}

static std::vector<int32_t> tokenize(Model & self, const std::string & text, bool add_special, bool parse_special) {
    const llama_vocab * vocab = self.get_vocab();
    if (text.size() > (size_t) INT32_MAX / 2)
        raise_value("text is too long to tokenize: " + std::to_string(text.size()) + " bytes");
    std::vector<int32_t> out(text.size() + 8);
    int32_t n;
    ModelUse use(self);
    {
        nb::gil_scoped_release release;
        n = llama_tokenize(vocab, text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(), add_special,
                           parse_special);
        if (n < 0 && n != INT32_MIN) {
            out.resize((size_t) -n);
            n = llama_tokenize(vocab, text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(), add_special,
                               parse_special);
        }
    }
    if (n < 0) throw LlamaError("llama_tokenize failed (result too large)");
    out.resize((size_t) n);
    return out;
}

static std::vector<int32_t> checked_tokens(const Model & self, const std::vector<int64_t> & tokens) {
    std::vector<int32_t> t(tokens.size());
    for (size_t i = 0; i < tokens.size(); ++i) {
        self.check_token(tokens[i]);
        t[i] = (int32_t) tokens[i];
    }
    return t;
}

static nb::str detokenize(Model & self, const std::vector<int64_t> & tokens, bool remove_special,
                          bool unparse_special) {
    const llama_vocab * vocab = self.get_vocab();
    std::vector<int32_t> t = checked_tokens(self, tokens);
    std::string buf(t.size() * 8 + 16, '\0');
    int32_t n = llama_detokenize(vocab, t.data(), (int32_t) t.size(), buf.data(), (int32_t) buf.size(), remove_special,
                                 unparse_special);
    if (n < 0) {
        buf.resize((size_t) -n);
        n = llama_detokenize(vocab, t.data(), (int32_t) t.size(), buf.data(), (int32_t) buf.size(), remove_special,
                             unparse_special);
    }
    if (n < 0) throw LlamaError("llama_detokenize failed");
    return nb::steal<nb::str>(PyUnicode_DecodeUTF8(buf.data(), n, "replace"));
}

static nb::bytes token_to_piece(Model & self, int64_t token, bool special) {
    self.check_token(token);
    char buf[256];
    int32_t n = llama_token_to_piece(self.get_vocab(), (int32_t) token, buf, sizeof buf, 0, special);
    if (n < 0) {
        std::string big((size_t) -n, '\0');
        n = llama_token_to_piece(self.get_vocab(), (int32_t) token, big.data(), (int32_t) big.size(), 0, special);
        return nb::bytes(big.data(), (size_t) std::max(n, 0));
    }
    return nb::bytes(buf, (size_t) n);
}

static nb::object opt_token(llama_token t) {
    return t == LLAMA_TOKEN_NULL ? nb::object(nb::none()) : nb::object(nb::int_(t));
}

// llama_model_save_to_file (a full fine-tune's weights) and llama_model_quantize, for llamabind.train
static void model_save(Model & m, const std::string & path) {
    llama_model * model = m.get();
    if (m.vocab_only) raise_value("a vocab_only model has no weights to save");
    FILE * f = std::fopen(path.c_str(), "wb");  // llama_model_save_to_file throws on this inside llama.cpp
    if (!f) raise_value("cannot write '" + path + "': " + std::strerror(errno));
    std::fclose(f);
    nb::gil_scoped_release release;
    llama_model_save_to_file(model, path.c_str());
}

static void quantize_model(const std::string & src, const std::string & dst, int ftype, int n_threads) {
    llama_model_quantize_params p = llama_model_quantize_default_params();
    p.ftype = (llama_ftype) ftype;
    p.allow_requantize = true;
    p.nthread = n_threads;
    uint32_t rc;
    {
        nb::gil_scoped_release release;
        clear_recent_errors();
        rc = llama_model_quantize(src.c_str(), dst.c_str(), &p);
    }
    if (rc != 0) throw LlamaError("llama_model_quantize failed for '" + src + "'\n" + take_recent_errors());
}

void register_model(nb::module_ & m) {
    nb::class_<Model>(m, "Model", "A GGUF model loaded by llama_model_load_from_file (see llamabind.Model).")
        .def("__init__", &model_init, nb::arg("path"), nb::arg("n_gpu_layers") = -1, nb::arg("load_mode") = -1,
             nb::arg("vocab_only") = false, nb::arg("split_mode") = 1, nb::arg("main_gpu") = 0,
             nb::arg("tensor_split") = std::vector<float>(), nb::arg("progress").none() = nb::none(),
             nb::arg("rpc") = std::vector<std::string>(), nb::arg("repack") = true,
             "Load a GGUF file. Raises FileNotFoundError (no file), ValueError (not GGUF, corrupt, truncated).")
        .def("close", &Model::close, "Free the weights and every context opened on this model.")
        .def_prop_ro("closed", [](const Model & s) { return s.model == nullptr; })
        .def_prop_ro("path", [](const Model & s) { return s.path; })
        .def_prop_ro("vocab_only", [](const Model & s) { return s.vocab_only; })
        .def_prop_ro(
            "output_offloaded", [](const Model & s) { return s.output_offloaded; },
            "Whether the output layer (the logits) runs on a GPU/RPC device.")
        .def_prop_ro("n_vocab", &Model::n_vocab)
        .def_prop_ro("n_ctx_train", [](const Model & s) { return llama_model_n_ctx_train(s.get()); })
        .def_prop_ro("n_embd", [](const Model & s) { return llama_model_n_embd(s.get()); })
        .def_prop_ro("n_layer", [](const Model & s) { return llama_model_n_layer(s.get()); })
        .def_prop_ro("n_params", [](const Model & s) { return llama_model_n_params(s.get()); })
        .def_prop_ro(
            "size", [](const Model & s) { return llama_model_size(s.get()); }, "Size of the weights in bytes.")
        .def_prop_ro("description",
                     [](const Model & s) {
                         char buf[256];
                         int n = llama_model_desc(s.get(), buf, sizeof buf);
                         return std::string(buf, (size_t) std::max(0, std::min(n, (int) sizeof buf - 1)));
                     })
        .def_prop_ro("token_bos", [](const Model & s) { return opt_token(llama_vocab_bos(s.get_vocab())); })
        .def_prop_ro("token_eos", [](const Model & s) { return opt_token(llama_vocab_eos(s.get_vocab())); })
        .def_prop_ro("add_bos", [](const Model & s) { return llama_vocab_get_add_bos(s.get_vocab()); })
        .def_prop_ro("add_eos", [](const Model & s) { return llama_vocab_get_add_eos(s.get_vocab()); })
        .def_prop_ro("add_sep", [](const Model & s) { return llama_vocab_get_add_sep(s.get_vocab()); })
        .def_prop_ro("token_sep", [](const Model & s) { return opt_token(llama_vocab_sep(s.get_vocab())); })
        .def_prop_ro("n_cls_out", [](const Model & s) { return llama_model_n_cls_out(s.get()); })
        .def(
            "is_eog",
            [](const Model & s, int64_t t) {
                s.check_token(t);
                return llama_vocab_is_eog(s.get_vocab(), (llama_token) t);
            },
            nb::arg("token"), "True for end-of-generation tokens (EOS, EOT, ...). Wraps llama_vocab_is_eog.")
        .def(
            "chat_template",
            [](const Model & s, const nb::object & name) -> nb::object {
                std::string n = name.is_none() ? std::string() : nb::cast<std::string>(name);
                const char * t = llama_model_chat_template(s.get(), name.is_none() ? nullptr : n.c_str());
                return t ? nb::cast(std::string(t)) : nb::none();
            },
            nb::arg("name") = nb::none(), "The GGUF chat template (tokenizer.chat_template), or None.")
        .def("tokenize", &tokenize, nb::arg("text"), nb::arg("add_special") = true, nb::arg("parse_special") = false,
             "str -> list of token ids. Wraps llama_tokenize.")
        .def("detokenize", &detokenize, nb::arg("tokens"), nb::arg("remove_special") = false,
             nb::arg("unparse_special") = false,
             "Token ids -> str (invalid UTF-8 replaced by U+FFFD). Wraps llama_detokenize.")
        .def("token_to_piece", &token_to_piece, nb::arg("token"), nb::arg("special") = false,
             "One token id -> its UTF-8 bytes (possibly part of a character). Wraps llama_token_to_piece.");
    m.def("read_tensor_info", &read_tensor_info, nb::arg("path"),
          "[(name, ggml type name, ne list)] of a GGUF file's tensors (ggml order: ne[0] first).");
    m.def("read_metadata", &read_metadata, nb::arg("path"),
          "GGUF key/values of a file as a dict (typed: int, float, bool, str, list). Wraps gguf_init_from_file.");
    m.def("model_save", &model_save, nb::arg("model"), nb::arg("path"), "llama_model_save_to_file.");
    m.def("quantize_model", &quantize_model, nb::arg("src"), nb::arg("dst"), nb::arg("ftype"), nb::arg("n_threads"),
          "llama_model_quantize with allow_requantize (ftype: llama_ftype, e.g. 0 = ALL_F32, 1 = MOSTLY_F16).");
}

}  // namespace lb
