// The op table of llamabind.ops: ggml op name -> the ggml_* call that builds it. Shapes, dtypes and
// parameters are validated in Python (llamabind/ops/) before a call reaches here; this table only
// checks the counts of sources and parameters so that nothing here reads out of range.
#include "ops.h"

#include <functional>
#include <unordered_map>

namespace lb {

namespace {

struct Args {
    ggml_context * ctx;
    const std::vector<ggml_tensor *> & s;
    const std::vector<int64_t> & i;
    const std::vector<double> & f;
    float fl(size_t k) const { return (float) f[k]; }
    int in(size_t k) const { return (int) i[k]; }
};

struct OpDef {
    size_t n_src;  // sources, the last n_opt of them may be null (optional)
    size_t n_opt;
    size_t n_int;
    size_t n_float;
    std::function<ggml_tensor *(const Args &)> build;
};

using T = ggml_tensor *;

static ggml_tensor * bf16_product(ggml_tensor * t) {
    ggml_prec_set_src(t, GGML_PREC_BF16, 0);
    ggml_prec_set_src(t, GGML_PREC_BF16, 1);
    return t;
}

const std::unordered_map<std::string, OpDef> & table() {
    static const std::unordered_map<std::string, OpDef> t = {
        // element-wise, binary (b broadcasts to a: ggml_can_repeat)
        { "add", { 2, 0, 0, 0, [](const Args & a) { return ggml_add(a.ctx, a.s[0], a.s[1]); } } },
        { "sub", { 2, 0, 0, 0, [](const Args & a) { return ggml_sub(a.ctx, a.s[0], a.s[1]); } } },
        { "mul", { 2, 0, 0, 0, [](const Args & a) { return ggml_mul(a.ctx, a.s[0], a.s[1]); } } },
        { "div", { 2, 0, 0, 0, [](const Args & a) { return ggml_div(a.ctx, a.s[0], a.s[1]); } } },
        { "scale", { 1, 0, 0, 1, [](const Args & a) { return ggml_scale(a.ctx, a.s[0], a.fl(0)); } } },
        { "clamp", { 1, 0, 0, 2, [](const Args & a) { return ggml_clamp(a.ctx, a.s[0], a.fl(0), a.fl(1)); } } },
        // element-wise, unary
        { "sqr", { 1, 0, 0, 0, [](const Args & a) { return ggml_sqr(a.ctx, a.s[0]); } } },
        { "sqrt", { 1, 0, 0, 0, [](const Args & a) { return ggml_sqrt(a.ctx, a.s[0]); } } },
        { "exp", { 1, 0, 0, 0, [](const Args & a) { return ggml_exp(a.ctx, a.s[0]); } } },
        { "log", { 1, 0, 0, 0, [](const Args & a) { return ggml_log(a.ctx, a.s[0]); } } },
        { "abs", { 1, 0, 0, 0, [](const Args & a) { return ggml_abs(a.ctx, a.s[0]); } } },
        { "neg", { 1, 0, 0, 0, [](const Args & a) { return ggml_neg(a.ctx, a.s[0]); } } },
        { "silu", { 1, 0, 0, 0, [](const Args & a) { return ggml_silu(a.ctx, a.s[0]); } } },
        { "gelu", { 1, 0, 0, 0, [](const Args & a) { return ggml_gelu(a.ctx, a.s[0]); } } },
        { "relu", { 1, 0, 0, 0, [](const Args & a) { return ggml_relu(a.ctx, a.s[0]); } } },
        { "sigmoid", { 1, 0, 0, 0, [](const Args & a) { return ggml_sigmoid(a.ctx, a.s[0]); } } },
        { "tanh", { 1, 0, 0, 0, [](const Args & a) { return ggml_tanh(a.ctx, a.s[0]); } } },
        { "silu_back", { 2, 0, 0, 0, [](const Args & a) { return ggml_silu_back(a.ctx, a.s[0], a.s[1]); } } },
        { "swiglu", { 2, 0, 0, 0, [](const Args & a) { return ggml_swiglu_split(a.ctx, a.s[0], a.s[1]); } } },
        // matrix products
        { "mul_mat", { 2, 0, 0, 0, [](const Args & a) { return ggml_mul_mat(a.ctx, a.s[0], a.s[1]); } } },
        { "out_prod", { 2, 0, 0, 0, [](const Args & a) { return ggml_out_prod(a.ctx, a.s[0], a.s[1]); } } },
        // the same of F32 sources, allowed in BF16 with F32 accumulation (ggml_prec_set_src; patches 0051, 0055)
        { "mul_mat_bf16",
          { 2, 0, 0, 0, [](const Args & a) { return bf16_product(ggml_mul_mat(a.ctx, a.s[0], a.s[1])); } } },
        { "out_prod_bf16",
          { 2, 0, 0, 0, [](const Args & a) { return bf16_product(ggml_out_prod(a.ctx, a.s[0], a.s[1])); } } },
        // reductions
        { "sum", { 1, 0, 0, 0, [](const Args & a) { return ggml_sum(a.ctx, a.s[0]); } } },
        { "sum_rows", { 1, 0, 0, 0, [](const Args & a) { return ggml_sum_rows(a.ctx, a.s[0]); } } },
        { "mean", { 1, 0, 0, 0, [](const Args & a) { return ggml_mean(a.ctx, a.s[0]); } } },
        { "argmax", { 1, 0, 0, 0, [](const Args & a) { return ggml_argmax(a.ctx, a.s[0]); } } },
        // normalization
        { "norm", { 1, 0, 0, 1, [](const Args & a) { return ggml_norm(a.ctx, a.s[0], a.fl(0)); } } },
        { "rms_norm", { 1, 0, 0, 1, [](const Args & a) { return ggml_rms_norm(a.ctx, a.s[0], a.fl(0)); } } },
        { "rms_norm_back",
          { 2, 0, 0, 1, [](const Args & a) { return ggml_rms_norm_back(a.ctx, a.s[0], a.s[1], a.fl(0)); } } },
        { "group_norm",
          { 1, 0, 1, 1, [](const Args & a) { return ggml_group_norm(a.ctx, a.s[0], a.in(0), a.fl(0)); } } },
        { "l2_norm", { 1, 0, 0, 1, [](const Args & a) { return ggml_l2_norm(a.ctx, a.s[0], a.fl(0)); } } },
        // softmax
        { "soft_max_ext",
          { 2, 1, 0, 2, [](const Args & a) { return ggml_soft_max_ext(a.ctx, a.s[0], a.s[1], a.fl(0), a.fl(1)); } } },
        { "soft_max_ext_back",
          { 2, 0, 0, 2,
            [](const Args & a) { return ggml_soft_max_ext_back(a.ctx, a.s[0], a.s[1], a.fl(0), a.fl(1)); } } },
        // cross-entropy (training's loss) and its gradient with respect to the logits
        { "cross_entropy_loss",
          { 2, 0, 0, 0, [](const Args & a) { return ggml_cross_entropy_loss(a.ctx, a.s[0], a.s[1]); } } },
        { "cross_entropy_loss_back",
          { 3, 0, 0, 0, [](const Args & a) { return ggml_cross_entropy_loss_back(a.ctx, a.s[0], a.s[1], a.s[2]); } } },
        // rope: ints n_dims, mode, n_ctx_orig;
        // floats freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow
        { "rope_ext",
          { 3, 1, 3, 6,
            [](const Args & a) {
                return ggml_rope_ext(a.ctx, a.s[0], a.s[1], a.s[2], a.in(0), a.in(1), a.in(2), a.fl(0), a.fl(1),
                                     a.fl(2), a.fl(3), a.fl(4), a.fl(5));
            } } },
        { "rope_ext_back",
          { 3, 1, 3, 6,
            [](const Args & a) {
                return ggml_rope_ext_back(a.ctx, a.s[0], a.s[1], a.s[2], a.in(0), a.in(1), a.in(2), a.fl(0), a.fl(1),
                                          a.fl(2), a.fl(3), a.fl(4), a.fl(5));
            } } },
        // + ints sections[4]
        { "rope_multi",
          { 3, 1, 7, 6,
            [](const Args & a) {
                int sections[4] = { a.in(3), a.in(4), a.in(5), a.in(6) };
                return ggml_rope_multi(a.ctx, a.s[0], a.s[1], a.s[2], a.in(0), sections, a.in(1), a.in(2), a.fl(0),
                                       a.fl(1), a.fl(2), a.fl(3), a.fl(4), a.fl(5));
            } } },
        { "rope_multi_back",
          { 3, 1, 7, 6,
            [](const Args & a) {
                int sections[4] = { a.in(3), a.in(4), a.in(5), a.in(6) };
                return ggml_rope_multi_back(a.ctx, a.s[0], a.s[1], a.s[2], a.in(0), sections, a.in(1), a.in(2), a.fl(0),
                                            a.fl(1), a.fl(2), a.fl(3), a.fl(4), a.fl(5));
            } } },
        // shape and data movement
        { "concat", { 2, 0, 1, 0, [](const Args & a) { return ggml_concat(a.ctx, a.s[0], a.s[1], a.in(0)); } } },
        { "get_rows", { 2, 0, 0, 0, [](const Args & a) { return ggml_get_rows(a.ctx, a.s[0], a.s[1]); } } },
        { "set_rows", { 3, 0, 0, 0, [](const Args & a) { return ggml_set_rows(a.ctx, a.s[0], a.s[1], a.s[2]); } } },
        { "cast", { 1, 0, 1, 0, [](const Args & a) { return ggml_cast(a.ctx, a.s[0], (ggml_type) a.in(0)); } } },
        { "cpy", { 2, 0, 0, 0, [](const Args & a) { return ggml_cpy(a.ctx, a.s[0], a.s[1]); } } },
        { "transpose", { 1, 0, 0, 0, [](const Args & a) { return ggml_transpose(a.ctx, a.s[0]); } } },
        { "permute",
          { 1, 0, 4, 0,
            [](const Args & a) { return ggml_permute(a.ctx, a.s[0], a.in(0), a.in(1), a.in(2), a.in(3)); } } },
        { "reshape_4d",
          { 1, 0, 4, 0,
            [](const Args & a) { return ggml_reshape_4d(a.ctx, a.s[0], a.i[0], a.i[1], a.i[2], a.i[3]); } } },
        { "cont", { 1, 0, 0, 0, [](const Args & a) { return ggml_cont(a.ctx, a.s[0]); } } },
        { "repeat_4d",
          { 1, 0, 4, 0,
            [](const Args & a) { return ggml_repeat_4d(a.ctx, a.s[0], a.i[0], a.i[1], a.i[2], a.i[3]); } } },
        { "pad_ext",
          { 1, 0, 8, 0,
            [](const Args & a) {
                return ggml_pad_ext(a.ctx, a.s[0], a.in(0), a.in(1), a.in(2), a.in(3), a.in(4), a.in(5), a.in(6),
                                    a.in(7));
            } } },
        // convolution and pooling: im2col ints s0, s1, p0, p1, d0, d1, is_2D, dst_type
        { "im2col",
          { 2, 0, 8, 0,
            [](const Args & a) {
                return ggml_im2col(a.ctx, a.s[0], a.s[1], a.in(0), a.in(1), a.in(2), a.in(3), a.in(4), a.in(5),
                                   a.i[6] != 0, (ggml_type) a.in(7));
            } } },
        { "conv_1d",
          { 2, 0, 3, 0,
            [](const Args & a) { return ggml_conv_1d(a.ctx, a.s[0], a.s[1], a.in(0), a.in(1), a.in(2)); } } },
        { "conv_2d",
          { 2, 0, 6, 0,
            [](const Args & a) {
                return ggml_conv_2d(a.ctx, a.s[0], a.s[1], a.in(0), a.in(1), a.in(2), a.in(3), a.in(4), a.in(5));
            } } },
        { "conv_transpose_1d",
          { 2, 0, 3, 0,
            [](const Args & a) { return ggml_conv_transpose_1d(a.ctx, a.s[0], a.s[1], a.in(0), a.in(1), a.in(2)); } } },
        { "pool_1d",
          { 1, 0, 4, 0,
            [](const Args & a) {
                return ggml_pool_1d(a.ctx, a.s[0], (ggml_op_pool) a.in(0), a.in(1), a.in(2), a.in(3));
            } } },
        { "pool_2d",
          { 1, 0, 5, 2,
            [](const Args & a) {
                return ggml_pool_2d(a.ctx, a.s[0], (ggml_op_pool) a.in(0), a.in(1), a.in(2), a.in(3), a.in(4), a.fl(0),
                                    a.fl(1));
            } } },
        { "interpolate",
          { 1, 0, 5, 0,
            [](const Args & a) {
                return ggml_interpolate(a.ctx, a.s[0], a.i[0], a.i[1], a.i[2], a.i[3], (uint32_t) a.i[4]);
            } } },
        // generators and sorting
        { "arange", { 0, 0, 0, 3, [](const Args & a) { return ggml_arange(a.ctx, a.fl(0), a.fl(1), a.fl(2)); } } },
        { "timestep_embedding",
          { 1, 0, 2, 0, [](const Args & a) { return ggml_timestep_embedding(a.ctx, a.s[0], a.in(0), a.in(1)); } } },
        { "argsort",
          { 1, 0, 1, 0, [](const Args & a) { return ggml_argsort(a.ctx, a.s[0], (ggml_sort_order) a.in(0)); } } },
        { "top_k", { 1, 0, 1, 0, [](const Args & a) { return ggml_top_k(a.ctx, a.s[0], a.in(0)); } } },
        // attention: q, k, v, mask (optional); floats scale, max_bias, logit_softcap
        { "flash_attn_ext",
          { 4, 1, 0, 3,
            [](const Args & a) {
                T r = ggml_flash_attn_ext(a.ctx, a.s[0], a.s[1], a.s[2], a.s[3], a.fl(0), a.fl(1), a.fl(2));
                ggml_flash_attn_ext_set_prec(r, GGML_PREC_F32);
                return r;
            } } },
    };
    return t;
}

}  // namespace

ggml_tensor * build_op(ggml_context * ctx, const std::string & name, const std::vector<ggml_tensor *> & srcs,
                       const std::vector<int64_t> & ints, const std::vector<double> & floats) {
    auto it = table().find(name);
    if (it == table().end()) raise_value("unknown ggml op '" + name + "'");
    const OpDef & d = it->second;
    if (srcs.size() != d.n_src || ints.size() != d.n_int || floats.size() != d.n_float) {
        raise_value("op '" + name + "' takes " + std::to_string(d.n_src) + " sources, " + std::to_string(d.n_int) +
                    " int and " + std::to_string(d.n_float) + " float parameters");
    }
    for (size_t k = 0; k + d.n_opt < d.n_src; ++k) {
        if (!srcs[k]) raise_value("op '" + name + "': source " + std::to_string(k) + " is required");
    }
    ggml_tensor * t = d.build(Args{ ctx, srcs, ints, floats });
    if (!t) throw LlamaError("ggml could not build op '" + name + "'");
    return t;
}

std::vector<std::string> op_names() {
    std::vector<std::string> out;
    for (auto & kv : table()) out.push_back(kv.first);
    return out;
}

}  // namespace lb

// ---- quantization of rows on the host (ggml_quantize_chunk), for llamabind.ops.quantize
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

namespace lb {

using F32Rows = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using U8Rows = nb::ndarray<uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

static void quantize_rows(int type, F32Rows src, U8Rows dst) {
    const ggml_type t = (ggml_type) type;
    if (type < 0 || type >= GGML_TYPE_COUNT || !ggml_is_quantized(t))
        raise_value("not a quantized ggml type: " + std::to_string(type));
    if (ggml_quantize_requires_imatrix(t)) raise_value(std::string(ggml_type_name(t)) + " needs an importance matrix");
    const int64_t nrows = (int64_t) src.shape(0), n = (int64_t) src.shape(1);
    if (n % ggml_blck_size(t) != 0) {
        raise_value("row length " + std::to_string(n) + " is not a multiple of " + ggml_type_name(t) +
                    "'s block size " + std::to_string(ggml_blck_size(t)));
    }
    if ((int64_t) dst.shape(0) != nrows || dst.shape(1) != ggml_row_size(t, n)) raise_value("dst has the wrong shape");
    nb::gil_scoped_release release;
    ggml_quantize_init(t);
    ggml_quantize_chunk(t, src.data(), dst.data(), 0, nrows, n, nullptr);
}

void register_ops(nb::module_ & m) {
    m.def("quantize_rows", &quantize_rows, nb::arg("type"), nb::arg("src"), nb::arg("dst"),
          "Quantize float32 rows (nrows, n) into dst (nrows, ggml_row_size). Wraps ggml_quantize_chunk.");
    m.def("op_names", &op_names, "Names of the ggml ops that Graph.op builds.");
}

}  // namespace lb
