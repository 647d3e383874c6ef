// The fiber scheduler under the Metal kernels run on the CPU (issue 57; tests only). See lb_msl_rt.h.
#include "lb_msl_rt.h"

#include <sys/mman.h>
#include <ucontext.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace lbrt {

namespace {

enum state { RUNNABLE, WAIT_TG, WAIT_SG, DONE };
constexpr size_t STACK = 256 * 1024;

struct fiber {
    ucontext_t uc;
    char * stack = nullptr;
    state st = DONE;
    thread_pos pos;
};

struct simdgroup {
    int live = 0, arrived = 0;
    void * ptr[32];
    void (*fn)(void * const *, void *) = nullptr;
    void * ud = nullptr;
};

// one OS thread's threadgroup in flight
struct group {
    const dispatch * d = nullptr;
    std::vector<fiber> f;
    std::vector<simdgroup> sg;
    std::vector<std::vector<unsigned char>> tgmem;
    ucontext_t sched;
    int n = 0, live = 0, tg_arrived = 0, cur = -1;
};

thread_local group * G = nullptr;

void entry() {
    group & g = *G;
    g.d->thunk(*g.d);
    fiber & me = g.f[g.cur];
    me.st = DONE;
    g.live--;
    g.sg[me.pos.sgitg].live--;
    // a lane or thread that returns no longer holds back the others
    simdgroup & s = g.sg[me.pos.sgitg];
    if (s.arrived > 0 && s.arrived == s.live) {
        void * ptr[32];
        for (int l = 0; l < 32; ++l) ptr[l] = s.ptr[l];
        s.fn(ptr, s.ud);
        for (int t = 0; t < g.n; ++t) if (g.f[t].st == WAIT_SG && g.f[t].pos.sgitg == me.pos.sgitg) g.f[t].st = RUNNABLE;
        s.arrived = 0;
    }
    if (g.tg_arrived > 0 && g.tg_arrived == g.live) {
        for (int t = 0; t < g.n; ++t) if (g.f[t].st == WAIT_TG) g.f[t].st = RUNNABLE;
        g.tg_arrived = 0;
    }
    // uc_link returns to the scheduler
}

[[noreturn]] void deadlock(const group & g) {
    std::string what;
    for (int t = 0; t < g.n; ++t) {
        const fiber & f = g.f[t];
        if (f.st == DONE) continue;
        what += " t" + std::to_string(t) + (f.st == WAIT_TG ? ":barrier" : ":simd");
    }
    std::fprintf(stderr, "lbrt: deadlock in threadgroup (%u,%u,%u): the threads wait at different barriers:%s\n",
                 g.f[0].pos.tgpig[0], g.f[0].pos.tgpig[1], g.f[0].pos.tgpig[2], what.c_str());
    std::abort();
}

void run_group(group & g, unsigned gx, unsigned gy, unsigned gz) {
    const dispatch & d = *g.d;
    const unsigned nx = d.tptg[0], ny = d.tptg[1];
    for (int i = 0; i < (int) g.tgmem.size(); ++i) std::memset(g.tgmem[i].data(), 0, g.tgmem[i].size());
    for (auto & s : g.sg) { s = simdgroup(); }
    for (int t = 0; t < g.n; ++t) {
        fiber & f = g.f[t];
        f.pos.tgpig[0] = gx; f.pos.tgpig[1] = gy; f.pos.tgpig[2] = gz;
        f.pos.tpitg[0] = t % nx; f.pos.tpitg[1] = (t / nx) % ny; f.pos.tpitg[2] = t / (nx * ny);
        f.pos.tiitg = t; f.pos.sgitg = t / 32; f.pos.tiisg = t % 32;
        for (int i = 0; i < MAX_TGMEM; ++i) f.pos.tgmem[i] = i < (int) g.tgmem.size() && !g.tgmem[i].empty() ? g.tgmem[i].data() : nullptr;
        g.sg[t / 32].live++;
        getcontext(&f.uc);
        f.uc.uc_stack.ss_sp = f.stack;
        f.uc.uc_stack.ss_size = STACK;
        f.uc.uc_link = &g.sched;
        makecontext(&f.uc, entry, 0);
        f.st = RUNNABLE;
    }
    g.live = g.n;
    g.tg_arrived = 0;
    while (g.live > 0) {
        bool ran = false;
        for (int t = 0; t < g.n; ++t) {
            if (g.f[t].st != RUNNABLE) continue;
            g.cur = t;
            swapcontext(&g.sched, &g.f[t].uc);
            ran = true;
        }
        if (!ran) deadlock(g);
    }
}

void prepare(group & g, const dispatch & d) {
    g.d = &d;
    g.n = (int) (d.tptg[0] * d.tptg[1] * d.tptg[2]);
    if ((int) g.f.size() < g.n) {
        const size_t old = g.f.size();
        g.f.resize(g.n);
        for (size_t i = old; i < g.f.size(); ++i) {
            void * p = mmap(nullptr, STACK, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (p == MAP_FAILED) { std::perror("lbrt: mmap"); std::abort(); }
            g.f[i].stack = (char *) p;
        }
    }
    g.sg.assign((g.n + 31) / 32, simdgroup());
    g.tgmem.resize(MAX_TGMEM);
    for (int i = 0; i < MAX_TGMEM; ++i) g.tgmem[i].assign(d.tgmem_size[i], 0);
    if (d.set_fc) d.set_fc(d.fc);
}

void block(state st) {
    group & g = *G;
    fiber & me = g.f[g.cur];
    me.st = st;
    swapcontext(&me.uc, &g.sched);
}

thread_local group tl_group;

}  // namespace

const thread_pos & pos() { return G->f[G->cur].pos; }

void threadgroup_barrier() {
    group & g = *G;
    if (++g.tg_arrived == g.live) {
        for (int t = 0; t < g.n; ++t) if (g.f[t].st == WAIT_TG) g.f[t].st = RUNNABLE;
        g.tg_arrived = 0;
        return;
    }
    block(WAIT_TG);
}

void simd_collective(void * mine, void (*fn)(void * const *, void *), void * ud) {
    group & g = *G;
    fiber & me = g.f[g.cur];
    simdgroup & s = g.sg[me.pos.sgitg];
    if (s.arrived == 0) { for (int l = 0; l < 32; ++l) s.ptr[l] = nullptr; s.fn = fn; s.ud = ud; }
    else if (s.fn != fn) {
        std::fprintf(stderr, "lbrt: divergent simdgroup operations in simdgroup %u (lane %u)\n", me.pos.sgitg, me.pos.tiisg);
        std::abort();
    }
    s.ptr[me.pos.tiisg] = mine;
    if (++s.arrived == s.live) {
        void * ptr[32];
        for (int l = 0; l < 32; ++l) ptr[l] = s.ptr[l];
        s.arrived = 0;
        fn(ptr, ud);
        for (int t = 0; t < g.n; ++t) if (g.f[t].st == WAIT_SG && g.f[t].pos.sgitg == me.pos.sgitg) g.f[t].st = RUNNABLE;
        return;
    }
    block(WAIT_SG);
}

void run(const dispatch & d) {
    const unsigned long n_groups = (unsigned long) d.grid[0] * d.grid[1] * d.grid[2];
    if (n_groups == 0 || d.tptg[0] * d.tptg[1] * d.tptg[2] == 0) return;
    static const int n_env = [] { const char * v = std::getenv("LB_MTL_THREADS"); return v ? std::atoi(v) : 0; }();
    int n_threads = n_env > 0 ? n_env : (int) std::thread::hardware_concurrency();
    if ((unsigned long) n_threads > n_groups) n_threads = (int) n_groups;
    std::atomic<unsigned long> next{0};
    auto work = [&] {
        group & g = tl_group;
        group * saved = G;
        G = &g;
        prepare(g, d);
        for (unsigned long i; (i = next.fetch_add(1)) < n_groups;) {
            run_group(g, (unsigned) (i % d.grid[0]), (unsigned) ((i / d.grid[0]) % d.grid[1]),
                      (unsigned) (i / ((unsigned long) d.grid[0] * d.grid[1])));
        }
        G = saved;
    };
    std::vector<std::thread> pool;
    for (int i = 1; i < n_threads; ++i) pool.emplace_back(work);
    work();
    for (auto & t : pool) t.join();
}

namespace {
kernel_table * tables = nullptr;
std::mutex tables_mu;
}

void register_table(kernel_table * t) {
    std::lock_guard<std::mutex> lk(tables_mu);
    t->next = tables;
    tables = t;
}

const kernel_entry * find_kernel(const char * name) {
    std::lock_guard<std::mutex> lk(tables_mu);
    for (const kernel_table * t = tables; t; t = t->next)
        for (int i = 0; i < t->n; ++i) if (std::strcmp(t->entries[i].name, name) == 0) return &t->entries[i];
    return nullptr;
}

}  // namespace lbrt
