// One FLASH_ATTN_EXT with a mask whose -INF run starts inside a 32-key block, on a named device and on the
// CPU, for patch 0004's test (issue 57; tests only):
//   lb-fa-mask DEVICE  ->  "nmse=<NMSE of DEVICE's result against the CPU's>"
// q: F32 [64, 1, 4] (one query: the vec kernel), k, v: F16 [64, 256, 4], mask: F16 [256, 1], 0 for keys
// 0..207 and -INF from 208 on (keys 192..223 form one block of the vec kernel: finite and -INF lanes),
// F32 precision; inputs from a fixed seed.
#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

namespace {

constexpr int D = 64, N_KV = 256, H = 4, N_VALID = 208;

std::vector<float> run(ggml_backend_dev_t dev, const std::vector<float> & q, const std::vector<ggml_fp16_t> & k,
                       const std::vector<ggml_fp16_t> & v, const std::vector<ggml_fp16_t> & mask) {
    ggml_init_params ip = { 16 * ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * tq = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, D, 1, H);
    ggml_tensor * tk = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, D, N_KV, H);
    ggml_tensor * tv = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, D, N_KV, H);
    ggml_tensor * tm = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, N_KV, 1);
    ggml_tensor * out = ggml_flash_attn_ext(ctx, tq, tk, tv, tm, 1.0f / std::sqrt((float) D), 0.0f, 0.0f);
    ggml_flash_attn_ext_set_prec(out, GGML_PREC_F32);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);

    std::vector<float> res;
    if (!ggml_backend_dev_supports_op(dev, out)) {
        ggml_free(ctx);
        return res;
    }
    ggml_backend_t backend = ggml_backend_dev_init(dev, nullptr);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
    ggml_backend_tensor_set(tq, q.data(), 0, ggml_nbytes(tq));
    ggml_backend_tensor_set(tk, k.data(), 0, ggml_nbytes(tk));
    ggml_backend_tensor_set(tv, v.data(), 0, ggml_nbytes(tv));
    ggml_backend_tensor_set(tm, mask.data(), 0, ggml_nbytes(tm));
    if (ggml_backend_graph_compute(backend, gf) == GGML_STATUS_SUCCESS) {
        res.resize(ggml_nelements(out));
        ggml_backend_tensor_get(out, res.data(), 0, ggml_nbytes(out));
    }
    ggml_backend_buffer_free(buf);
    ggml_backend_free(backend);
    ggml_free(ctx);
    return res;
}

}  // namespace

int main(int argc, char ** argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s DEVICE\n", argv[0]);
        return 2;
    }
    ggml_backend_load_all();
    ggml_backend_dev_t dev = ggml_backend_dev_by_name(argv[1]);
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!dev || !cpu) {
        fprintf(stderr, "no device %s (or no CPU)\n", argv[1]);
        return 1;
    }
    std::mt19937 gen(57);
    std::uniform_real_distribution<float> dis(-1.0f, 1.0f);
    std::vector<float> q(D * H);
    std::vector<ggml_fp16_t> k(D * N_KV * H), v(D * N_KV * H), mask(N_KV);
    for (auto & x : q) x = dis(gen);
    for (auto & x : k) x = ggml_fp32_to_fp16(dis(gen));
    for (auto & x : v) x = ggml_fp32_to_fp16(dis(gen));
    for (int j = 0; j < N_KV; ++j) mask[j] = ggml_fp32_to_fp16(j < N_VALID ? 0.0f : -INFINITY);

    const std::vector<float> a = run(dev, q, k, v, mask), b = run(cpu, q, k, v, mask);
    if (a.empty() || a.size() != b.size()) {
        fprintf(stderr, "FLASH_ATTN_EXT not supported or failed on %s\n", argv[1]);
        return 1;
    }
    double err = 0.0, ref = 0.0;
    for (size_t i = 0; i < a.size(); ++i) {
        err += (double) (a[i] - b[i]) * (a[i] - b[i]);
        ref += (double) b[i] * b[i];
    }
    printf("nmse=%.3e\n", err / ref);
    return 0;
}
