// See grad_reduce.h.
#include "grad_reduce.h"

#include <ggml-backend.h>
#include <nanobind/ndarray.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <string>

namespace nb = nanobind;

namespace lb {

// DLPack's device of a gradient's memory where DLPack names it and the gradient is one dense block: host memory,
// a CUDA device's; (0, 0) else
static std::pair<int, int> dl_device_of(const ggml_tensor * t) {
    ggml_backend_buffer_t b = t->view_src ? t->view_src->buffer : t->buffer;
    if (b == nullptr || t->data == nullptr || !ggml_is_contiguous(t)) return { 0, 0 };
    if (ggml_backend_buffer_is_host(b)) return { nb::device::cpu::value, 0 };
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(b));
    return dev == nullptr ? std::pair<int, int>{ 0, 0 } : dlpack_device(dev);
}

// the accumulators as DLPack arrays: where ones next by address lie one after the other in one buffer DLPack names
// (ggml-opt allocates them so: one array a buffer), one array over the run, the padding between two included
// (less than the buffer's alignment: nothing else lies there); a gradient in other memory: its host copy
static nb::list gradient_arrays(ggml_tensor ** grads, int n_grads, std::vector<std::vector<float>> & copies) {
    struct Run {
        ggml_backend_buffer_t buf;
        char * data;
        char * end;
        std::pair<int, int> dev;
    };

    std::vector<int> order(n_grads);  // by address: a bucket comes in the backward pass's order, the reverse
    for (int i = 0; i < n_grads; ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](int a, int b) { return grads[a]->data < grads[b]->data; });
    std::vector<Run> runs;
    for (int i : order) {
        const auto dev = dl_device_of(grads[i]);
        char * data = dev.first ? (char *) grads[i]->data : (char *) copies[i].data();
        char * end = data + ggml_nbytes(grads[i]);
        if (dev.first && !runs.empty() && runs.back().dev == dev && runs.back().buf == grads[i]->buffer) {
            char * const base = (char *) ggml_backend_buffer_get_base(grads[i]->buffer);
            const size_t align = ggml_backend_buffer_get_alignment(grads[i]->buffer);
            const uint64_t next = GGML_PAD((uint64_t) (runs.back().end - base), align);
            if (data == base + next) {
                runs.back().end = end;
                continue;
            }
        }
        runs.push_back({ dev.first ? grads[i]->buffer : nullptr, data, end,
                         dev.first ? dev : std::pair<int, int>{ nb::device::cpu::value, 0 } });
    }
    nb::list arrays;  // views without an owner: valid during the call only
    for (const Run & r : runs) {
        const size_t shape[1] = { (size_t) (r.end - r.data) / sizeof(float) };
        nb::ndarray<nb::array_api, float, nb::ndim<1>> view((float *) r.data, 1, shape, nb::handle(), nullptr,
                                                            nb::dtype<float>(), r.dev.first, r.dev.second);
        arrays.append(nb::cast(view, nb::rv_policy::reference));
    }
    return arrays;
}

bool grad_reduce_host(ggml_tensor ** grads, int n_grads, void * userdata) {
    auto & r = *(GradReduce *) userdata;
    if (!r.error.empty()) return false;  // a failed reduction ends the run: no more steps
    r.copies.resize(n_grads);            // kept from step to step: no allocation per step where the sizes stay
    for (int i = 0; i < n_grads; ++i) {  // the accumulators are F32 (ggml-opt makes them so)
        if (dl_device_of(grads[i]).first != 0) {
            r.copies[i].clear();  // (in place: no copy)
        } else {
            r.copies[i].resize(ggml_nelements(grads[i]));
            ggml_backend_tensor_get(grads[i], r.copies[i].data(), 0, ggml_nbytes(grads[i]));
        }
    }
    r.n_calls++;
    {
        nb::gil_scoped_acquire gil;
        try {
            r.fn(gradient_arrays(grads, n_grads, r.copies));
        } catch (nb::python_error & e) {  // kept, raised by opt_step: its type and message, not the traceback
            r.error = std::string(nb::str(e.type().attr("__name__")).c_str()) + ": " + nb::str(e.value()).c_str();
        } catch (const std::exception & e) {
            r.error = e.what();
        }
    }
    if (!r.error.empty()) return false;  // no step from gradients the other ranks did not see
    for (int i = 0; i < n_grads; ++i) {
        if (!r.copies[i].empty()) ggml_backend_tensor_set(grads[i], r.copies[i].data(), 0, ggml_nbytes(grads[i]));
    }
    return true;
}

bool grad_ready_host(ggml_tensor ** grads, int n_grads, void * userdata) {
    auto & r = *(GradReduce *) userdata;
    for (int i = 0; i < n_grads; ++i) {
        if (dl_device_of(grads[i]).first == 0) return false;  // (host copies: grad_reduce_host's)
    }
    if (!r.error.empty()) return true;  // the step is refused already
    nb::gil_scoped_acquire gil;
    std::vector<std::vector<float>> none(n_grads);
    try {
        r.ready(gradient_arrays(grads, n_grads, none));
    } catch (nb::python_error & e) {
        r.error = std::string(nb::str(e.type().attr("__name__")).c_str()) + ": " + nb::str(e.value()).c_str();
    } catch (const std::exception & e) {
        r.error = e.what();
    }
    return true;
}

void grad_reduce_attach(llama_opt_params & p, std::unique_ptr<GradReduce> & r, nb::object fn) {
    r = std::make_unique<GradReduce>();
    r->fn = fn;
    p.grad_reduce = grad_reduce_host;
    p.grad_reduce_ud = r.get();
    if (nb::hasattr(fn, "ready") && PyCallable_Check(fn.attr("ready").ptr()) && nb::hasattr(fn, "bucket_bytes")) {
        const int64_t bytes = nb::cast<int64_t>(fn.attr("bucket_bytes"));
        if (bytes > 0) {
            r->ready = fn.attr("ready");
            p.grad_ready = grad_ready_host;
            p.grad_bucket_bytes = (size_t) bytes;
        }
    }
}

}  // namespace lb
