// See grad_reduce.h.
#include "grad_reduce.h"

#include <ggml-backend.h>
#include <nanobind/ndarray.h>

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
            nb::list arrays;  // views without an owner: valid during the call only
            for (int i = 0; i < n_grads; ++i) {
                const size_t shape[1] = { (size_t) ggml_nelements(grads[i]) };
                auto [type, id] = dl_device_of(grads[i]);
                float * data = type ? (float *) grads[i]->data : r.copies[i].data();
                if (!type) type = nb::device::cpu::value;
                nb::ndarray<nb::array_api, float, nb::ndim<1>> view(data, 1, shape, nb::handle(), nullptr,
                                                                    nb::dtype<float>(), type, id);
                arrays.append(nb::cast(view, nb::rv_policy::reference));
            }
            r.fn(arrays);
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

}  // namespace lb
