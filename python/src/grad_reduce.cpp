// See grad_reduce.h.
#include "grad_reduce.h"

#include <ggml-backend.h>
#include <nanobind/ndarray.h>

#include <exception>
#include <string>

namespace nb = nanobind;

namespace lb {

bool grad_reduce_host(ggml_tensor ** grads, int n_grads, void * userdata) {
    auto & r = *(GradReduce *) userdata;
    if (!r.error.empty()) return false;  // a failed reduction ends the run: no more steps
    size_t n = 0;
    for (int i = 0; i < n_grads; ++i) n += ggml_nelements(grads[i]);
    r.buf.resize(n);
    size_t off = 0;
    for (int i = 0; i < n_grads; ++i) {  // the accumulators are F32 (ggml-opt makes them so)
        ggml_backend_tensor_get(grads[i], r.buf.data() + off, 0, ggml_nbytes(grads[i]));
        off += ggml_nelements(grads[i]);
    }
    r.n_calls++;
    {
        nb::gil_scoped_acquire gil;
        try {
            nb::ndarray<nb::numpy, float, nb::ndim<1>> view(r.buf.data(), { n }, nb::handle());
            r.fn(nb::cast(view, nb::rv_policy::reference));  // the buffer itself (no owner: a copy by default)
        } catch (nb::python_error & e) {  // kept, raised by opt_step: its type and message, not the traceback
            r.error = std::string(nb::str(e.type().attr("__name__")).c_str()) + ": " + nb::str(e.value()).c_str();
        } catch (const std::exception & e) {
            r.error = e.what();
        }
    }
    if (!r.error.empty()) return false;  // no step from gradients the other ranks did not see
    off = 0;
    for (int i = 0; i < n_grads; ++i) {
        ggml_backend_tensor_set(grads[i], r.buf.data() + off, 0, ggml_nbytes(grads[i]));
        off += ggml_nelements(grads[i]);
    }
    return true;
}

}  // namespace lb
