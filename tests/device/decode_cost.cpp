// Cost of one single-token llama_decode under the context settings that differ between llama-bench
// and llamabind, in llama.h alone (same tree, same static libraries as _core): which setting, if any,
// makes llamabind's tg slower than llama-bench's on a tiny model, where per-call costs dominate.
//
//   decode_cost MODEL N_GPU_LAYERS N_THREADS
//
// Each line: a variant, then the median microseconds per token over 20 runs of 128 tokens
// (llama-bench's tg128: decode + llama_synchronize per token, random token ids).
#include "llama.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

static void quiet(ggml_log_level, const char *, void *) {}
static bool never_abort(void *) {
    return false;
}

struct Variant {
    const char * name;
    bool kv_unified, abort_cb, perf, explicit_batch, threadpool;
};

static double run(llama_model * model, const Variant & v, int n_threads) {
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 128;
    cp.n_batch = 2048;
    cp.n_ubatch = 512;
    cp.n_threads = cp.n_threads_batch = n_threads;
    cp.kv_unified = v.kv_unified;
    cp.no_perf = !v.perf;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) return -1;
    if (v.abort_cb) llama_set_abort_callback(ctx, never_abort, nullptr);
    ggml_threadpool * tp = nullptr;
    if (v.threadpool) {
        ggml_threadpool_params tpp = ggml_threadpool_params_default(n_threads);
        tp = ggml_threadpool_new(&tpp);
        llama_attach_threadpool(ctx, tp, nullptr);
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    llama_token tok = 1;
    llama_pos pos = 0;
    llama_seq_id seq = 0, *seqp = &seq;
    int32_t one = 1;
    int8_t out = 1;
    auto decode = [&]() {
        llama_batch b =
            v.explicit_batch ? llama_batch{ 1, &tok, nullptr, &pos, &one, &seqp, &out } : llama_batch_get_one(&tok, 1);
        llama_decode(ctx, b);
        llama_synchronize(ctx);
        ++pos;
        tok = std::rand() % n_vocab;
    };
    decode();  // warm-up
    std::vector<double> us;
    for (int r = 0; r < 20; r++) {
        llama_memory_clear(llama_get_memory(ctx), false);
        pos = 0;
        auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < 128; i++) decode();
        us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / 128);
    }
    llama_free(ctx);
    if (tp) ggml_threadpool_free(tp);
    std::sort(us.begin(), us.end());
    return us[us.size() / 2];
}

int main(int argc, char ** argv) {
    if (argc < 4) {
        std::fprintf(stderr, "usage: %s MODEL N_GPU_LAYERS N_THREADS\n", argv[0]);
        return 2;
    }
    llama_log_set(quiet, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = std::atoi(argv[2]);
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) return 1;
    const int n_threads = std::atoi(argv[3]);
    const Variant variants[] = {
        { "llama-bench settings", false, false, false, false, true },
        { "+ kv_unified", true, false, false, false, true },
        { "+ abort callback", false, true, false, false, true },
        { "+ perf timings", false, false, true, false, true },
        { "+ explicit batch", false, false, false, true, true },
        { "- threadpool", false, false, false, false, false },
        { "llamabind settings", true, true, true, true, true },
        { "llama-bench settings (again)", false, false, false, false, true },
    };
    run(model, variants[0], n_threads);  // warm-up: the first context pays one-time costs
    for (const auto & v : variants) std::printf("%-30s %8.1f us/token\n", v.name, run(model, v, n_threads));
    llama_model_free(model);
    return 0;
}
