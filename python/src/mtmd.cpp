// Images and audio in (llama.cpp's libmtmd, tools/mtmd): a projector (mmproj GGUF) loaded on a
// Model, media decoded into bitmaps, a prompt with media markers tokenized into text and media
// chunks, and the chunks evaluated into a Context (media: encoder, then the embeddings decoded).
#include "interrupt.h"
#include "objects.h"

#include <mtmd-helper.h>
#include <mtmd.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <sys/stat.h>

#include <cstring>
#include <map>
#include <memory>

namespace lb {

struct Projector {
    Model * owner = nullptr;
    mtmd_context * ctx = nullptr;
    std::string path;
    std::string marker;
    // tests: copies of the encoder graph's tensors with these names (mtmd_context_params.cb_eval)
    std::vector<std::string> capture;
    std::map<std::string, std::pair<std::vector<int64_t>, std::vector<float>>> captured;

    ~Projector() { release(); }
    void release() {
        if (ctx) mtmd_free(ctx);
        ctx = nullptr;
        if (owner) owner->projectors.erase(this);
        owner = nullptr;
    }
    mtmd_context * get() const {
        if (!ctx) raise_value("the projector is closed");
        if (!owner || !owner->model) raise_value("the projector's model is closed");
        return ctx;
    }
    // a captured name, or the scheduler's copy of one on another backend ("CUDA0#inp_raw#0")
    static std::string base_name(const char * name) {
        std::string n(name);
        const size_t a = n.find('#');
        if (a == std::string::npos) return n;
        const size_t b = n.find('#', a + 1);
        return n.substr(a + 1, b == std::string::npos ? std::string::npos : b - a - 1);
    }
    bool wanted(const char * name) const {
        const std::string n = base_name(name);
        for (const auto & c : capture)
            if (c == n) return true;
        return false;
    }
};

void free_projectors(Model & m) {
    for (auto * p : std::set<Projector *>(m.projectors)) p->release();
    m.projectors.clear();
}

// An image or audio clip decoded for the projector (mtmd_bitmap).
struct Media {
    std::unique_ptr<mtmd_bitmap, decltype(&mtmd_bitmap_free)> bmp{ nullptr, &mtmd_bitmap_free };
    const mtmd_bitmap * get() const {
        if (!bmp) raise_value("the media is empty");
        return bmp.get();
    }
};

// One chunk of a tokenized multimodal prompt (a copy, owned here).
struct Chunk {
    std::unique_ptr<mtmd_input_chunk, decltype(&mtmd_input_chunk_free)> c{ nullptr, &mtmd_input_chunk_free };
};

static bool capture_cb(ggml_tensor * t, bool ask, void * ud) {
    auto * p = static_cast<Projector *>(ud);
    auto save = [p](ggml_tensor * x) {
        const std::string name = Projector::base_name(x->name);
        if (x->type != GGML_TYPE_F32 || !x->buffer || p->captured.count(name)) return;
        std::vector<int64_t> shape;
        for (int i = ggml_n_dims(x) - 1; i >= 0; --i) shape.push_back(x->ne[i]);
        std::vector<float> data(ggml_nelements(x));
        if (!ggml_is_contiguous(x)) return;
        ggml_backend_tensor_get(x, data.data(), 0, ggml_nbytes(x));
        p->captured[name] = { shape, std::move(data) };
    };
    bool want = p->wanted(t->name);
    for (int i = 0; i < GGML_MAX_SRC && !want; ++i)
        want = t->src[i] && p->wanted(t->src[i]->name) && !p->captured.count(Projector::base_name(t->src[i]->name));
    if (ask) return want;
    if (p->wanted(t->name)) save(t);
    for (int i = 0; i < GGML_MAX_SRC; ++i)
        if (t->src[i] && p->wanted(t->src[i]->name)) save(t->src[i]);
    return true;
}

static void projector_init(Projector * self, Model & model, const std::string & path, bool use_gpu, int n_threads,
                           int image_min_tokens, int image_max_tokens, bool warmup, const std::string & marker,
                           const std::vector<std::string> & capture) {
    new (self) Projector();
    llama_model * m = model.get();
    if (model.vocab_only) raise_value("the model was loaded with vocab_only=True: it cannot take media");
    struct stat st;
    if (stat(path.c_str(), &st) != 0) raise_file_not_found("no such mmproj file: '" + path + "'");
    if (!S_ISREG(st.st_mode)) raise_value("mmproj must be a GGUF file, but '" + path + "' is not a regular file");
    if (n_threads < 1) raise_value("n_threads must be >= 1; got " + std::to_string(n_threads));
    if (image_min_tokens < -1 || image_max_tokens < -1 ||
        (image_min_tokens > 0 && image_max_tokens > 0 && image_min_tokens > image_max_tokens)) {
        raise_value("image_min_tokens/image_max_tokens must be -1 (the projector's) or positive, min <= max");
    }
    self->capture = capture;
    self->marker = marker;
    mtmd_context_params p = mtmd_context_params_default();
    p.use_gpu = use_gpu;
    p.print_timings = false;
    p.n_threads = n_threads;
    p.warmup = warmup;
    p.media_marker = self->marker.c_str();
    p.image_min_tokens = image_min_tokens;
    p.image_max_tokens = image_max_tokens;
    if (!capture.empty()) {
        p.cb_eval = capture_cb;
        p.cb_eval_user_data = self;
    }
    clear_recent_errors();
    mtmd_context * c;
    {
        ModelUse use(model);
        nb::gil_scoped_release release;
        c = mtmd_init_from_file(path.c_str(), m, p);
    }
    flush_logs();
    if (!c) raise_value("cannot load the projector '" + path + "' for this model\n" + take_recent_errors());
    self->ctx = c;
    self->owner = &model;
    self->path = path;
    model.projectors.insert(self);
}

static Media * wrap(mtmd_bitmap * b) {
    auto * m = new Media();
    m->bmp.reset(b);
    return m;
}

// Bytes of an image (stb_image: JPEG, PNG, BMP, GIF, ...) or audio file (WAV, MP3, FLAC).
static Media * media_from_bytes(const Projector & self, nb::bytes data) {
    mtmd_context * c = self.get();
    if (data.size() == 0) raise_value("the media is empty (0 bytes)");
    clear_recent_errors();
    mtmd_helper_bitmap_wrapper w;
    {
        nb::gil_scoped_release release;
        w = mtmd_helper_bitmap_init_from_buf(c, (const unsigned char *) data.c_str(), data.size(), false,
                                             mtmd_helper_init_opt_default());
    }
    flush_logs();
    if (w.video_ctx) {
        mtmd_helper_video_free(w.video_ctx);
        if (w.bitmap) mtmd_bitmap_free(w.bitmap);
        raise_value("video input is not supported (this build of libmtmd has no video decoder)");
    }
    if (!w.bitmap) {
        const std::string why = take_recent_errors();
        if (why.find("does not support audio") != std::string::npos)
            raise_value("this projector takes images, not audio ('" + self.path + "')");
        if (why.find("does not support vision") != std::string::npos ||
            why.find("does not support image") != std::string::npos)
            raise_value("this projector takes audio, not images ('" + self.path + "')");
        raise_value(
            "cannot decode the media: not an image (JPEG, PNG, BMP, GIF, ...) or audio file (WAV, MP3, FLAC) that "
            "libmtmd reads, or a corrupt one\n" +
            why);
    }
    return wrap(w.bitmap);
}

static Media * media_from_rgb(const Projector & self,
                              nb::ndarray<const uint8_t, nb::ndim<3>, nb::c_contig, nb::device::cpu> rgb,
                              const std::string & id) {
    self.get();
    if (rgb.shape(2) != 3) raise_value("an image array must be (height, width, 3) uint8 RGB");
    if (rgb.shape(0) == 0 || rgb.shape(1) == 0) raise_value("an image array must not be empty");
    mtmd_bitmap * b = mtmd_bitmap_init((uint32_t) rgb.shape(1), (uint32_t) rgb.shape(0), rgb.data());
    if (!b) raise_value("mtmd_bitmap_init failed");
    mtmd_bitmap_set_id(b, id.c_str());
    return wrap(b);
}

static Media * media_from_pcm(const Projector & self,
                              nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu> pcm,
                              const std::string & id) {
    self.get();
    if (pcm.shape(0) == 0) raise_value("an audio array must not be empty");
    mtmd_bitmap * b = mtmd_bitmap_init_from_audio(pcm.shape(0), pcm.data());
    if (!b) raise_value("mtmd_bitmap_init_from_audio failed");
    mtmd_bitmap_set_id(b, id.c_str());
    return wrap(b);
}

// Text with one marker per media -> [Chunk] (mtmd_tokenize).
static nb::list tokenize(const Projector & self, const std::string & text, const std::vector<const Media *> & media,
                         bool add_special, bool parse_special) {
    mtmd_context * c = self.get();
    std::vector<const mtmd_bitmap *> bmps;
    for (const Media * m : media) {
        if (!m) raise_type("media must be Media objects");
        bmps.push_back(m->get());
    }
    size_t n_markers = 0;
    for (size_t pos = text.find(self.marker); pos != std::string::npos; pos = text.find(self.marker, pos + 1))
        ++n_markers;
    if (n_markers != bmps.size()) {
        raise_value("the prompt has " + std::to_string(n_markers) + " media markers and " +
                    std::to_string(bmps.size()) + " media were given");
    }
    for (const mtmd_bitmap * b : bmps) {
        if (mtmd_bitmap_is_audio(b) && !mtmd_support_audio(c))
            raise_value("this projector takes images, not audio ('" + self.path + "')");
        if (!mtmd_bitmap_is_audio(b) && !mtmd_support_vision(c))
            raise_value("this projector takes audio, not images ('" + self.path + "')");
    }
    mtmd_input_text in{ text.c_str(), text.size(), add_special, parse_special };
    std::unique_ptr<mtmd_input_chunks, decltype(&mtmd_input_chunks_free)> out(mtmd_input_chunks_init(),
                                                                              &mtmd_input_chunks_free);
    clear_recent_errors();
    int32_t rc;
    {
        ModelUse use(*self.owner);
        nb::gil_scoped_release release;
        rc = mtmd_tokenize(c, out.get(), &in, bmps.data(), bmps.size());
    }
    flush_logs();
    if (rc != 0)
        raise_value("cannot preprocess the media (mtmd_tokenize returned " + std::to_string(rc) + ")\n" +
                    take_recent_errors());
    nb::list chunks;
    for (size_t i = 0; i < mtmd_input_chunks_size(out.get()); ++i) {
        auto * ch = new Chunk();
        ch->c.reset(mtmd_input_chunk_copy(mtmd_input_chunks_get(out.get(), i)));
        chunks.append(nb::cast(ch, nb::rv_policy::take_ownership));
    }
    return chunks;
}

// Evaluate one media chunk after what seq_id holds (mtmd_helper_eval_chunk_single: the encoder,
// then the embeddings through llama_decode in n_batch pieces, non-causal where the model wants it).
// Returns the next position. Ctrl-C (between decode steps) rolls the chunk back.
static int64_t eval_media(Projector & self, Context & ctx, const Chunk & chunk, int64_t seq_id, bool logits_last) {
    mtmd_context * c = self.get();
    llama_context * lc = ctx.get();
    if (ctx.owner != self.owner) raise_value("the context is on a different model than the projector");
    check_seq(lc, seq_id);
    const llama_pos n_past = next_pos(ctx, (llama_seq_id) seq_id);
    if (mtmd_input_chunk_get_type(chunk.c.get()) == MTMD_INPUT_CHUNK_TYPE_TEXT)
        raise_value("eval_media takes an image or audio chunk");
    const llama_pos n_pos = mtmd_input_chunk_get_n_pos(chunk.c.get());
    const size_t n_tokens = mtmd_input_chunk_get_n_tokens(chunk.c.get());
    const int64_t held = n_cells(ctx, (llama_seq_id) seq_id);
    const uint32_t n_ctx = llama_n_ctx_seq(lc);
    if ((uint64_t) held + n_tokens > n_ctx) {
        raise_value("the media takes " + std::to_string(n_tokens) + " tokens after " + std::to_string(held) +
                    ", more than n_ctx (" + std::to_string(n_ctx) +
                    ") has room for; use a larger n_ctx or fewer image tokens (image_max_tokens)");
    }
    ctx.check_no_views("decode");
    BusyGuard guard(ctx);
    SigintScope sigint;
    llama_pos new_n_past = n_past;
    int32_t rc;
    clear_recent_errors();
    ctx.has_logits = false;
    {
        ModelUse use(*self.owner);
        nb::gil_scoped_release release;
        rc = mtmd_helper_eval_chunk_single(c, lc, chunk.c.get(), n_past, (llama_seq_id) seq_id,
                                           (int32_t) llama_n_batch(lc), logits_last, &new_n_past);
        if (rc == 0) llama_synchronize(lc);
    }
    flush_logs();
    if (rc != 0) {
        llama_memory_seq_rm(llama_get_memory(lc), (llama_seq_id) seq_id, n_past, -1);
        if (g_interrupted.load()) {
            if (PyErr_CheckSignals() != 0) throw nb::python_error();
            raise_keyboard_interrupt();
        }
        throw LlamaError("evaluating the media failed (mtmd_helper_eval_chunk_single returned " + std::to_string(rc) +
                         ")\n" + take_recent_errors());
    }
    if ((size_t) n_pos != n_tokens) {  // M-RoPE: n_tokens cells on n_pos positions
        ctx.media[(llama_seq_id) seq_id].push_back(Context::MediaSpan{ n_past, n_pos, (int32_t) n_tokens });
    }
    ctx.has_logits = logits_last;
    ctx.n_batch_last = logits_last ? 1 : 0;
    if (PyErr_CheckSignals() != 0) throw nb::python_error();
    return new_n_past;
}

// The projector's output embeddings of a media chunk (mtmd_encode_chunk): (n_tokens, n_embd) float32.
static nb::ndarray<nb::numpy, float> encode(Projector & self, const Chunk & chunk) {
    mtmd_context * c = self.get();
    if (mtmd_input_chunk_get_type(chunk.c.get()) == MTMD_INPUT_CHUNK_TYPE_TEXT)
        raise_value("encode takes an image or audio chunk");
    const size_t n_tok = mtmd_input_chunk_get_n_tokens(chunk.c.get());
    const size_t n_embd = (size_t) llama_model_n_embd_inp(self.owner->get());
    clear_recent_errors();
    int32_t rc;
    {
        ModelUse use(*self.owner);
        nb::gil_scoped_release release;
        rc = mtmd_encode_chunk(c, chunk.c.get());
    }
    flush_logs();
    if (rc != 0) throw LlamaError("mtmd_encode_chunk failed\n" + take_recent_errors());
    float * out = new float[n_tok * n_embd];
    std::memcpy(out, mtmd_get_output_embd(c), n_tok * n_embd * sizeof(float));
    nb::capsule owner(out, [](void * p) noexcept { delete[] (float *) p; });
    return nb::ndarray<nb::numpy, float>(out, { n_tok, n_embd }, owner);
}

void register_mtmd(nb::module_ & m) {
    // mtmd's and clip's logs -> Python logging (ServerCore sets it again: tools/server's
    // server_context constructor points it at common's silenced logger)
    mtmd_helper_log_set(log_to_python, nullptr);
    nb::class_<Media>(m, "Media", "An image or audio clip decoded for a projector (mtmd_bitmap).")
        .def_prop_ro("is_audio", [](const Media & x) { return mtmd_bitmap_is_audio(x.get()); })
        .def_prop_ro("nx", [](const Media & x) { return mtmd_bitmap_get_nx(x.get()); })
        .def_prop_ro("ny", [](const Media & x) { return mtmd_bitmap_get_ny(x.get()); })
        .def_prop_ro("id", [](const Media & x) { return std::string(mtmd_bitmap_get_id(x.get())); });
    nb::class_<Chunk>(m, "Chunk", "A text, image or audio chunk of a multimodal prompt (mtmd_input_chunk).")
        .def_prop_ro("type",
                     [](const Chunk & x) {
                         switch (mtmd_input_chunk_get_type(x.c.get())) {
                             case MTMD_INPUT_CHUNK_TYPE_TEXT: return "text";
                             case MTMD_INPUT_CHUNK_TYPE_IMAGE: return "image";
                             case MTMD_INPUT_CHUNK_TYPE_AUDIO: return "audio";
                             default: return "other";
                         }
                     })
        .def_prop_ro("n_tokens", [](const Chunk & x) { return mtmd_input_chunk_get_n_tokens(x.c.get()); })
        .def_prop_ro("n_pos", [](const Chunk & x) { return mtmd_input_chunk_get_n_pos(x.c.get()); })
        .def_prop_ro("id",
                     [](const Chunk & x) {
                         const char * id = mtmd_input_chunk_get_id(x.c.get());
                         return std::string(id ? id : "");
                     })
        .def_prop_ro("tokens", [](const Chunk & x) {
            size_t n = 0;
            const llama_token * t = mtmd_input_chunk_get_tokens_text(x.c.get(), &n);
            return std::vector<int32_t>(t, t + (t ? n : 0));
        });
    nb::class_<Projector>(m, "Projector", "A multimodal projector (mmproj GGUF) on a Model (mtmd_init_from_file).")
        .def("__init__", &projector_init, nb::arg("model"), nb::arg("path"), nb::arg("use_gpu") = true,
             nb::arg("n_threads") = 4, nb::arg("image_min_tokens") = -1, nb::arg("image_max_tokens") = -1,
             nb::arg("warmup") = true, nb::arg("marker") = std::string(mtmd_default_marker()),
             nb::arg("capture") = std::vector<std::string>(), nb::keep_alive<1, 2>())
        .def("close", &Projector::release)
        .def_prop_ro("closed", [](const Projector & p) { return p.ctx == nullptr; })
        .def_prop_ro("path", [](const Projector & p) { return p.path; })
        .def_prop_ro("marker", [](const Projector & p) { return p.marker; })
        .def_prop_ro("vision", [](const Projector & p) { return mtmd_support_vision(p.get()); })
        .def_prop_ro("audio", [](const Projector & p) { return mtmd_support_audio(p.get()); })
        .def_prop_ro("audio_sample_rate", [](const Projector & p) { return mtmd_get_audio_sample_rate(p.get()); })
        .def_prop_ro("uses_mrope", [](const Projector & p) { return mtmd_decode_use_mrope(p.get()); })
        .def("media_from_bytes", &media_from_bytes, nb::arg("data"), nb::rv_policy::take_ownership)
        .def("media_from_rgb", &media_from_rgb, nb::arg("rgb"), nb::arg("id"), nb::rv_policy::take_ownership)
        .def("media_from_pcm", &media_from_pcm, nb::arg("pcm"), nb::arg("id"), nb::rv_policy::take_ownership)
        .def("tokenize", &tokenize, nb::arg("text"), nb::arg("media"), nb::arg("add_special") = true,
             nb::arg("parse_special") = true)
        .def("eval_media", &eval_media, nb::arg("context"), nb::arg("chunk"), nb::arg("seq_id") = 0,
             nb::arg("logits_last") = true)
        .def("encode", &encode, nb::arg("chunk"))
        .def("captured", [](Projector & p) {
            nb::dict out;
            for (auto & [name, v] : p.captured) {
                auto * data = new std::vector<float>(v.second);
                nb::capsule owner(data, [](void * q) noexcept { delete (std::vector<float> *) q; });
                std::vector<size_t> shape(v.first.begin(), v.first.end());
                out[name.c_str()] = nb::ndarray<nb::numpy, float>(data->data(), shape.size(), shape.data(), owner);
            }
            p.captured.clear();
            return out;
        });
}

}  // namespace lb
