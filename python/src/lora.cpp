// LoRA adapters (llama_adapter_lora_*): loaded on a Model, applied per Context with a scale.
#include "objects.h"

#include <gguf.h>
#include <llama-adapter.h>  // llama.cpp's internal adapter struct (ab_map), as train.cpp
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <sys/stat.h>

#include <algorithm>
#include <cmath>

namespace lb {

Lora::~Lora() {
    if (!owner) return;
    owner->loras.erase(this);
    for (Context * c : owner->contexts) {
        auto & v = c->loras;
        v.erase(std::remove_if(v.begin(), v.end(), [this](const auto & e) { return e.first == this; }), v.end());
    }
}

void Lora::close() {
    if (!adapter) return;
    if (owner) {
        for (Context * c : owner->contexts) {
            for (auto & [l, s] : c->loras) {
                if (l == this)
                    throw LlamaError("the LoRA adapter is applied to a context: remove it there first (set_loras)");
            }
        }
        llama_adapter_lora_free(adapter);
        owner->loras.erase(this);
    }
    adapter = nullptr;
    owner = nullptr;
}

static void lora_init(Lora * self, Model & model, const std::string & path) {
    new (self) Lora();
    llama_model * m = model.get();
    struct stat st;
    if (stat(path.c_str(), &st) != 0) raise_file_not_found("no such LoRA adapter file: '" + path + "'");
    clear_recent_errors();
    llama_adapter_lora * a;
    {
        nb::gil_scoped_release release;
        a = llama_adapter_lora_init(m, path.c_str());
    }
    if (!a) raise_value("cannot load the LoRA adapter '" + path + "' for this model\n" + take_recent_errors());
    self->adapter = a;
    self->owner = &model;
    self->path = path;
    model.loras.insert(self);
}

void set_loras(Context & self, const std::vector<std::pair<Lora *, double>> & loras) {
    llama_context * c = self.get();
    std::vector<llama_adapter_lora *> as;
    std::vector<float> scales;
    for (const auto & [l, s] : loras) {
        if (!l || !l->adapter) raise_value("the LoRA adapter is closed");
        if (l->owner != self.owner) raise_value("the LoRA adapter was loaded on a different model");
        if (!std::isfinite(s)) raise_value("a LoRA scale must be finite; got " + std::to_string(s));
        as.push_back(l->adapter);
        scales.push_back((float) s);
    }
    BusyGuard guard(self);
    clear_recent_errors();
    if (llama_set_adapters_lora(c, as.data(), as.size(), scales.data()) != 0) {
        throw LlamaError("llama_set_adapters_lora failed\n" + take_recent_errors());
    }
    self.loras.clear();
    for (const auto & [l, s] : loras) self.loras.push_back({ l, (float) s });
}

// Writing adapters: a new one from numpy arrays (train.lora_init), a trained one from its tensors (Lora.save).
using F32Matrix = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

struct F32Tensor {
    std::string name;
    const float * data;
    int64_t rows, cols;  // numpy (rows, cols) is ggml ne = [cols, rows]
};

// A LoRA adapter GGUF as llama_adapter_lora_init reads it: general.type "adapter",
// general.architecture, adapter.type "lora", adapter.lora.alpha, F32 tensors NAME.lora_a/.lora_b.
// gguf_write_to_file reads the data where it lies (no copy).
static void write_lora(const std::string & path, const std::string & arch, float alpha,
                       const std::vector<F32Tensor> & tensors) {
    ggml_init_params ip = { (tensors.size() + 1) * ggml_tensor_overhead(), nullptr, /*no_alloc =*/true };
    ggml_context * ctx = ggml_init(ip);
    gguf_context * g = gguf_init_empty();
    gguf_set_val_str(g, "general.type", "adapter");
    gguf_set_val_str(g, "general.architecture", arch.c_str());
    gguf_set_val_str(g, "adapter.type", "lora");
    gguf_set_val_f32(g, "adapter.lora.alpha", alpha);
    for (const auto & d : tensors) {
        if (d.name.size() >= GGML_MAX_NAME) {
            gguf_free(g);
            ggml_free(ctx);
            raise_value("tensor name too long: " + d.name);
        }
        ggml_tensor * t = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, d.cols, d.rows);
        ggml_set_name(t, d.name.c_str());
        t->data = (void *) d.data;
        gguf_add_tensor(g, t);
    }
    const bool ok = gguf_write_to_file(g, path.c_str(), false);
    gguf_free(g);
    ggml_free(ctx);
    if (!ok) raise_value("cannot write '" + path + "'");
}

static void lora_write(const std::string & path, const std::string & arch, float alpha,
                       const std::vector<std::pair<std::string, F32Matrix>> & tensors) {
    std::vector<F32Tensor> views;
    for (auto & [name, a] : tensors) views.push_back({ name, a.data(), (int64_t) a.shape(0), (int64_t) a.shape(1) });
    write_lora(path, arch, alpha, views);
}

// The adapter's A/B tensors as they are now (after training), read back from their buffers.
static void lora_save(Lora & l, const std::string & path) {
    if (!l.adapter) raise_value("the LoRA adapter is closed");
    char arch[128] = { 0 };
    llama_model_meta_val_str(l.owner->get(), "general.architecture", arch, sizeof(arch));
    std::vector<std::string> names;
    for (auto & [name, w] : l.adapter->ab_map) names.push_back(name);
    std::sort(names.begin(), names.end());
    std::vector<std::vector<float>> data;  // host copies of the (possibly device) tensors
    std::vector<F32Tensor> views;
    data.reserve(2 * names.size());
    for (auto & name : names) {
        const auto & w = l.adapter->ab_map.at(name);
        for (ggml_tensor * t : { w.a, w.b }) {
            if (t->type != GGML_TYPE_F32) raise_type("only F32 adapters can be saved; '" + name + "' is not");
            data.emplace_back(ggml_nelements(t));
            ggml_backend_tensor_get(t, data.back().data(), 0, ggml_nbytes(t));
            views.push_back({ t->name, data.back().data(), t->ne[1], t->ne[0] });
        }
    }
    write_lora(path, arch, l.adapter->alpha, views);
}

void register_lora(nb::module_ & m) {
    nb::class_<Lora>(m, "Lora", "A LoRA adapter loaded on a Model (llama_adapter_lora_init).")
        .def("__init__", &lora_init, nb::arg("model"), nb::arg("path"), nb::keep_alive<1, 2>())
        .def("close", &Lora::close)
        .def_prop_ro("closed", [](const Lora & l) { return l.adapter == nullptr; })
        .def_prop_ro("path", [](const Lora & l) { return l.path; })
        .def("metadata", [](const Lora & l) {
            if (!l.adapter) raise_value("the LoRA adapter is closed");
            nb::dict out;
            char k[512], v[4096];
            for (int32_t i = 0; i < llama_adapter_meta_count(l.adapter); ++i) {
                if (llama_adapter_meta_key_by_index(l.adapter, i, k, sizeof k) < 0) continue;
                if (llama_adapter_meta_val_str_by_index(l.adapter, i, v, sizeof v) < 0) continue;
                out[k] = std::string(v);
            }
            return out;
        });
    m.def("lora_write", &lora_write, nb::arg("path"), nb::arg("arch"), nb::arg("alpha"), nb::arg("tensors"),
          "Write a LoRA adapter GGUF: [(name, float32 (rows, cols))], names ending .lora_a / .lora_b.");
    m.def("lora_save", &lora_save, nb::arg("adapter"), nb::arg("path"),
          "Write a loaded adapter's current A/B tensors (e.g. after training) as a LoRA adapter GGUF.");
}

}  // namespace lb
