// The load / generate / close cycle of tests/test_reliability.py::test_no_leak_over_load_generate_close_cycles,
// written against llama.h alone (no llamabind), so host-memory growth seen through the binding can be
// compared with the same cycles in llama.cpp's own API, built from the same patched tree.
//
//   load_cycles MODEL N_CYCLES N_GPU_LAYERS [gen|load]
//
// Prints one line per 25 cycles: cycle, RSS (KiB, /proc/self/statm) and glibc's heap in use
// (mallinfo2: uordblks + hblkhd, bytes), then "drift_rss_mb" and "drift_heap_mb" after the first 10
// (warm-up) cycles. tests/device/rss_probe.py builds it and runs it beside the Python cycles.
#include "llama.h"

#include <malloc.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

static long rss_kib() {
    long pages_total = 0, pages_rss = 0;
    FILE * f = std::fopen("/proc/self/statm", "r");
    if (!f || std::fscanf(f, "%ld %ld", &pages_total, &pages_rss) != 2) {
        if (f) std::fclose(f);
        return -1;
    }
    std::fclose(f);
    return pages_rss * (sysconf(_SC_PAGESIZE) / 1024);
}

static size_t heap_in_use() {
    struct mallinfo2 mi = mallinfo2();
    return mi.uordblks + mi.hblkhd;
}

static void quiet(ggml_log_level, const char *, void *) {}

static bool cycle(const char * path, int ngl, bool gen) {
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = ngl;
    llama_model * model = llama_model_load_from_file(path, mp);
    if (!model) return false;
    if (gen) {
        llama_context_params cp = llama_context_default_params();
        cp.n_ctx = 64;
        cp.n_batch = 64;
        cp.n_threads = cp.n_threads_batch = 1;
        llama_context * ctx = llama_init_from_model(model, cp);
        if (!ctx) {
            llama_model_free(model);
            return false;
        }
        const llama_vocab * vocab = llama_model_get_vocab(model);
        std::vector<llama_token> toks(16);
        int n = llama_tokenize(vocab, "Hi", 2, toks.data(), (int) toks.size(), true, false);
        toks.resize(n > 0 ? n : 0);
        llama_sampler * smpl = llama_sampler_init_greedy();
        llama_batch batch = llama_batch_get_one(toks.data(), (int) toks.size());
        llama_token next = 0;
        for (int i = 0; i < 2; i++) {
            if (llama_decode(ctx, batch) != 0) break;
            next = llama_sampler_sample(smpl, ctx, -1);
            batch = llama_batch_get_one(&next, 1);
        }
        llama_sampler_free(smpl);
        llama_free(ctx);
    }
    llama_model_free(model);
    return true;
}

int main(int argc, char ** argv) {
    if (argc < 4) {
        std::fprintf(stderr, "usage: %s MODEL N_CYCLES N_GPU_LAYERS [gen|load]\n", argv[0]);
        return 2;
    }
    const char * path = argv[1];
    const int n = std::atoi(argv[2]);
    const int ngl = std::atoi(argv[3]);
    const bool gen = argc < 5 || std::strcmp(argv[4], "load") != 0;
    llama_log_set(quiet, nullptr);
    llama_backend_init();
    for (int i = 0; i < 10; i++) {
        if (!cycle(path, ngl, gen)) {
            std::fprintf(stderr, "cycle failed\n");
            return 1;
        }
    }
    const long rss0 = rss_kib();
    const size_t heap0 = heap_in_use();
    for (int i = 1; i <= n; i++) {
        if (!cycle(path, ngl, gen)) {
            std::fprintf(stderr, "cycle failed\n");
            return 1;
        }
        if (i % 25 == 0) std::printf("cycle %d rss_kib %ld heap_bytes %zu\n", i, rss_kib(), heap_in_use());
    }
    std::printf("drift_rss_mb %.2f drift_heap_mb %.2f\n", (rss_kib() - rss0) / 1024.0,
                ((double) heap_in_use() - (double) heap0) / 1048576.0);
    llama_backend_free();
    return 0;
}
