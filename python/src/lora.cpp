// LoRA adapters (llama_adapter_lora_*): loaded on a Model, applied per Context with a scale.
#include "objects.h"

#include <nanobind/stl/string.h>

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
}

}  // namespace lb
