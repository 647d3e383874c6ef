// llamabind._core._testing: native graphs that reach allocation-dependent code paths of the patch
// series and the upstream seed fixes (in-place aliasing chosen by ggml_gallocr), and report
// whether the aliasing really happened. Not public API.
#include "common.h"

#include <ggml-alloc.h>
#include <ggml-backend.h>
#include <ggml-backend.h>
#include <ggml.h>

#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>

#include <cmath>
#include <memory>

namespace lb {

using F32In = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using F32Out = nb::ndarray<nb::numpy, float, nb::ndim<2>>;
using Result = std::pair<F32Out, bool>;

static void check_pair(const F32In & p, const F32In & q, const char * names) {
    if (p.shape(0) != q.shape(0) || p.shape(1) != q.shape(1))
        raise_value(std::string(names) + " must have the same shape");
    if (p.shape(0) < 1 || p.shape(1) < 1)
        raise_value(std::string(names) + " must be non-empty (rows, n) float32 arrays");
}

// Two (rows, n) float32 inputs, a graph built by `build` on them, allocated with ggml_gallocr on
// the CPU backend and computed. Returns (out, out->data == alias->data).
template <typename Build>
static Result run_graph(const F32In & in0, const F32In & in1, bool in0_is_output, Build build) {
    const int64_t rows = (int64_t) in0.shape(0), n = (int64_t) in0.shape(1);
    ggml_init_params ip = { ggml_tensor_overhead() * 8 + ggml_graph_overhead(), nullptr, /*no_alloc =*/true };
    std::unique_ptr<ggml_context, decltype(&ggml_free)> ctx(ggml_init(ip), ggml_free);
    ggml_tensor * t0 = ggml_new_tensor_2d(ctx.get(), GGML_TYPE_F32, n, rows);
    ggml_tensor * t1 = ggml_new_tensor_2d(ctx.get(), GGML_TYPE_F32, n, rows);
    ggml_set_input(t0);
    ggml_set_input(t1);
    if (in0_is_output) ggml_set_output(t0);  // keeps the allocator from reusing it
    ggml_tensor * alias = nullptr;
    ggml_tensor * out = build(ctx.get(), t0, t1, &alias);
    ggml_set_output(out);
    ggml_cgraph * gf = ggml_new_graph(ctx.get());
    ggml_build_forward_expand(gf, out);
    std::unique_ptr<ggml_backend, decltype(&ggml_backend_free)> be(
        ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr), ggml_backend_free);
    std::unique_ptr<ggml_gallocr, decltype(&ggml_gallocr_free)> ga(
        ggml_gallocr_new(ggml_backend_get_default_buffer_type(be.get())), ggml_gallocr_free);
    if (!ggml_gallocr_alloc_graph(ga.get(), gf)) throw LlamaError("ggml_gallocr_alloc_graph failed");
    ggml_backend_tensor_set(t0, in0.data(), 0, ggml_nbytes(t0));
    ggml_backend_tensor_set(t1, in1.data(), 0, ggml_nbytes(t1));
    if (ggml_backend_graph_compute(be.get(), gf) != GGML_STATUS_SUCCESS) throw LlamaError("graph compute failed");
    const bool aliased = out->data == alias->data;
    float * host = new float[rows * n];
    ggml_backend_tensor_get(out, host, 0, ggml_nbytes(out));
    nb::capsule owner(host, [](void * p) noexcept { delete[] (float *) p; });
    return { F32Out(host, { (size_t) rows, (size_t) n }, owner), aliased };
}

// design.md's reproduction of patches/0001: dy (an input kept as output), y = soft_max(a),
// dx = soft_max_ext_back(dy, y, scale, 0); the allocator may place dx on y.
static Result soft_max_back_graph(F32In dy, F32In a, float scale) {
    check_pair(dy, a, "dy and a");
    if (!std::isfinite(scale)) raise_value("scale must be finite");
    return run_graph(dy, a, true,
                     [scale](ggml_context * ctx, ggml_tensor * t_dy, ggml_tensor * t_a, ggml_tensor ** alias) {
                         ggml_tensor * y = ggml_soft_max(ctx, t_a);
                         *alias = y;
                         return ggml_soft_max_ext_back(ctx, t_dy, y, scale, 0.0f);
                     });
}

// The upstream b9572 fix: dz is an intermediate (dz_in * 1), so the allocator may place
// dx = rms_norm_back(dz, x) on dz (RMS_NORM_BACK is in ggml_op_can_inplace).
static Result rms_norm_back_graph(F32In dz, F32In x, float eps) {
    check_pair(dz, x, "dz and x");
    if (!(eps >= 0.0f) || !std::isfinite(eps)) raise_value("eps must be finite and >= 0");
    return run_graph(dz, x, false,
                     [eps](ggml_context * ctx, ggml_tensor * t_dz, ggml_tensor * t_x, ggml_tensor ** alias) {
                         ggml_set_output(t_x);
                         ggml_tensor * dz1 = ggml_scale(ctx, t_dz, 1.0f);
                         *alias = dz1;
                         return ggml_rms_norm_back(ctx, dz1, t_x, eps);
                     });
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
