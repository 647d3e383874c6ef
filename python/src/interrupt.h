// The interrupt scope: Ctrl-C while llama.cpp computes (context.cpp's decode/eval/encode).
#pragma once

#include <atomic>
#include <csignal>
#include <cstring>
#include <mutex>

namespace lb {

// --- Ctrl-C inside a decode. While any decode runs, a SIGINT handler sets g_interrupted and then
// chains to the previous handler (Python's, which schedules KeyboardInterrupt). ggml's CPU backend
// polls the abort callback between graph nodes, so llama_decode returns 2 (aborted) promptly.
inline std::atomic<bool> g_interrupted{ false };
inline std::mutex g_sig_mutex;
inline int g_sig_depth = 0;
inline struct sigaction g_old_sigint;

inline void on_sigint(int sig, siginfo_t * info, void * uctx) {
    g_interrupted.store(true);
    if (g_old_sigint.sa_flags & SA_SIGINFO) {
        if (g_old_sigint.sa_sigaction) g_old_sigint.sa_sigaction(sig, info, uctx);
    } else if (g_old_sigint.sa_handler != SIG_DFL && g_old_sigint.sa_handler != SIG_IGN) {
        g_old_sigint.sa_handler(sig);
    }
}

struct SigintScope {
    SigintScope() {
        std::lock_guard<std::mutex> lock(g_sig_mutex);
        if (g_sig_depth++ == 0) {
            g_interrupted.store(false);
            struct sigaction sa;
            std::memset(&sa, 0, sizeof sa);
            sa.sa_sigaction = on_sigint;
            sa.sa_flags = SA_SIGINFO;
            sigemptyset(&sa.sa_mask);
            sigaction(SIGINT, &sa, &g_old_sigint);
        }
    }
    ~SigintScope() {
        std::lock_guard<std::mutex> lock(g_sig_mutex);
        if (--g_sig_depth == 0) sigaction(SIGINT, &g_old_sigint, nullptr);
    }
};

inline bool abort_callback(void *) {
    return g_interrupted.load(std::memory_order_relaxed);
}

}  // namespace lb
