// llamabind._core._testing: native graphs that the test suite needs to reach code paths of the
// patch series before the general per-op API exists. Not public API.
#include "common.h"

#include <ggml-alloc.h>
#include <ggml-backend.h>
#include <ggml-cpu.h>
#include <ggml.h>

#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>

#include <cmath>
#include <memory>

namespace lb {

using F32In = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using F32Out = nb::ndarray<nb::numpy, float, nb::ndim<2>>;

// The graph of design.md's reproduction, allocated by ggml_gallocr on the CPU backend:
//   a, dy inputs (dy also an output, so its buffer is not reused); y = soft_max(a);
//   dx = soft_max_ext_back(dy, y, scale, 0). Returns (dx, whether dx was placed on y's memory).
static std::pair<F32Out, bool> soft_max_back_graph(F32In dy_in, F32In a_in, float scale) {
    if (dy_in.shape(0) != a_in.shape(0) || dy_in.shape(1) != a_in.shape(1)) {
        raise_value("dy and a must have the same shape");
    }
    const int64_t rows = (int64_t) a_in.shape(0), n = (int64_t) a_in.shape(1);
    if (rows < 1 || n < 1) raise_value("dy and a must be non-empty (rows, n) float32 arrays");
    if (!std::isfinite(scale)) raise_value("scale must be finite");

    ggml_init_params ip = {ggml_tensor_overhead() * 8 + ggml_graph_overhead(), nullptr, /*no_alloc =*/true};
    std::unique_ptr<ggml_context, decltype(&ggml_free)> ctx(ggml_init(ip), ggml_free);
    ggml_tensor * a = ggml_new_tensor_2d(ctx.get(), GGML_TYPE_F32, n, rows);
    ggml_set_input(a);
    ggml_tensor * dy = ggml_new_tensor_2d(ctx.get(), GGML_TYPE_F32, n, rows);
    ggml_set_input(dy);
    ggml_set_output(dy);
    ggml_tensor * y = ggml_soft_max(ctx.get(), a);
    ggml_tensor * dx = ggml_soft_max_ext_back(ctx.get(), dy, y, scale, 0.0f);
    ggml_set_output(dx);
    ggml_cgraph * gf = ggml_new_graph(ctx.get());
    ggml_build_forward_expand(gf, dx);

    std::unique_ptr<ggml_backend, decltype(&ggml_backend_free)> be(ggml_backend_cpu_init(), ggml_backend_free);
    std::unique_ptr<ggml_gallocr, decltype(&ggml_gallocr_free)> ga(
        ggml_gallocr_new(ggml_backend_get_default_buffer_type(be.get())), ggml_gallocr_free);
    if (!ggml_gallocr_alloc_graph(ga.get(), gf)) throw LlamaError("ggml_gallocr_alloc_graph failed");
    ggml_backend_tensor_set(a, a_in.data(), 0, ggml_nbytes(a));
    ggml_backend_tensor_set(dy, dy_in.data(), 0, ggml_nbytes(dy));
    if (ggml_backend_graph_compute(be.get(), gf) != GGML_STATUS_SUCCESS) throw LlamaError("graph compute failed");
    const bool aliased = dx->data == y->data;

    float * out = new float[rows * n];
    ggml_backend_tensor_get(dx, out, 0, ggml_nbytes(dx));
    nb::capsule owner(out, [](void * p) noexcept { delete[] (float *) p; });
    return {F32Out(out, {(size_t) rows, (size_t) n}, owner), aliased};
}

// dz is an intermediate (dz_in * 1), so ggml_gallocr may place dx = rms_norm_back(dz, x) on dz's
// buffer (RMS_NORM_BACK is in ggml_op_can_inplace). Returns (dx, whether dx was placed on dz).
static std::pair<F32Out, bool> rms_norm_back_graph(F32In dz_in, F32In x_in, float eps) {
    if (dz_in.shape(0) != x_in.shape(0) || dz_in.shape(1) != x_in.shape(1)) raise_value("dz and x must have the same shape");
    const int64_t rows = (int64_t) x_in.shape(0), n = (int64_t) x_in.shape(1);
    if (rows < 1 || n < 1) raise_value("dz and x must be non-empty (rows, n) float32 arrays");
    if (!(eps >= 0.0f) || !std::isfinite(eps)) raise_value("eps must be finite and >= 0");
    ggml_init_params ip = {ggml_tensor_overhead() * 8 + ggml_graph_overhead(), nullptr, /*no_alloc =*/true};
    std::unique_ptr<ggml_context, decltype(&ggml_free)> ctx(ggml_init(ip), ggml_free);
    ggml_tensor * dz0 = ggml_new_tensor_2d(ctx.get(), GGML_TYPE_F32, n, rows);
    ggml_set_input(dz0);
    ggml_tensor * x = ggml_new_tensor_2d(ctx.get(), GGML_TYPE_F32, n, rows);
    ggml_set_input(x);
    ggml_set_output(x);
    ggml_tensor * dz = ggml_scale(ctx.get(), dz0, 1.0f);
    ggml_tensor * dx = ggml_rms_norm_back(ctx.get(), dz, x, eps);
    ggml_set_output(dx);
    ggml_cgraph * gf = ggml_new_graph(ctx.get());
    ggml_build_forward_expand(gf, dx);
    std::unique_ptr<ggml_backend, decltype(&ggml_backend_free)> be(ggml_backend_cpu_init(), ggml_backend_free);
    std::unique_ptr<ggml_gallocr, decltype(&ggml_gallocr_free)> ga(
        ggml_gallocr_new(ggml_backend_get_default_buffer_type(be.get())), ggml_gallocr_free);
    if (!ggml_gallocr_alloc_graph(ga.get(), gf)) throw LlamaError("ggml_gallocr_alloc_graph failed");
    ggml_backend_tensor_set(dz0, dz_in.data(), 0, ggml_nbytes(dz0));
    ggml_backend_tensor_set(x, x_in.data(), 0, ggml_nbytes(x));
    if (ggml_backend_graph_compute(be.get(), gf) != GGML_STATUS_SUCCESS) throw LlamaError("graph compute failed");
    const bool aliased = dx->data == dz->data;
    float * out = new float[rows * n];
    ggml_backend_tensor_get(dx, out, 0, ggml_nbytes(dx));
    nb::capsule owner(out, [](void * p) noexcept { delete[] (float *) p; });
    return {F32Out(out, {(size_t) rows, (size_t) n}, owner), aliased};
}

void register_testing(nb::module_ & m) {
    nb::module_ t = m.def_submodule("_testing", "Native helpers for llamabind's test suite (not public API).");
    t.def("soft_max_back_graph", &soft_max_back_graph, nb::arg("dy"), nb::arg("a"), nb::arg("scale") = 1.0f,
          "dx = soft_max_ext_back(dy, soft_max(a), scale, 0) through ggml_gallocr on CPU; (rows, n) float32.\n"
          "Returns (dx, aliased): aliased is True when the allocator placed dx in y's buffer.");
    t.def("rms_norm_back_graph", &rms_norm_back_graph, nb::arg("dz"), nb::arg("x"), nb::arg("eps"),
          "dx = rms_norm_back(dz * 1, x, eps) through ggml_gallocr on CPU; (rows, n) float32.\n"
          "Returns (dx, aliased): aliased is True when the allocator placed dx in dz's buffer.");
}

}  // namespace lb
