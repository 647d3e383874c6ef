// The fiber scheduler under the Metal kernels run on the CPU (issue 57; tests only). See lb_msl_rt.h.
#include "lb_msl_rt.h"

#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

// The context switch: callee-saved registers, MXCSR and the x87 control word on the old stack, its stack
// pointer to *save, then the same from new_sp (the System V x86-64 ABI's callee-saved state). ucontext's
// swapcontext would do the same plus two sigprocmask system calls per switch, most of a dispatch's time.
extern "C" void lb_fiber_switch(void ** save, void * new_sp);
asm(R"(
    .text
    .globl lb_fiber_switch
    .type lb_fiber_switch, @function
lb_fiber_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size lb_fiber_switch, .-lb_fiber_switch
)");

namespace lbrt {

namespace {

enum state { RUNNABLE, WAIT_TG, WAIT_SG, DONE };
constexpr size_t STACK = 256 * 1024;
constexpr size_t GUARD = 64 * 1024;
constexpr unsigned char GUARD_BYTE = 0xcd;

struct fiber {
    void * sp = nullptr;
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
    void * sched = nullptr;
    int n = 0, live = 0, tg_arrived = 0, cur = -1;
    bool resumed = false;  // a barrier or simdgroup operation released its threads: the pass starts over
    unsigned long long generation = 0;  // threadgroups run by this group (tg_local's poison, once per threadgroup)
};

thread_local group * G = nullptr;

[[noreturn]] void entry() {
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
        for (int t = 0; t < g.n; ++t)
            if (g.f[t].st == WAIT_SG && g.f[t].pos.sgitg == me.pos.sgitg) g.f[t].st = RUNNABLE;
        s.arrived = 0;
        g.resumed = true;
    }
    if (g.tg_arrived > 0 && g.tg_arrived == g.live) {
        for (int t = 0; t < g.n; ++t)
            if (g.f[t].st == WAIT_TG) g.f[t].st = RUNNABLE;
        g.tg_arrived = 0;
        g.resumed = true;
    }
    void * dead;
    lb_fiber_switch(&dead, g.sched);  // never resumed
    __builtin_unreachable();
}

// a new fiber's stack: lb_fiber_switch's frame (zeroed registers, this thread's MXCSR and x87 control
// word) below entry() as the return address, at a 16-byte boundary so that entry starts as if called
void * fresh_stack(char * stack) {
    uintptr_t top = ((uintptr_t) stack + STACK) & ~(uintptr_t) 15;
    uint64_t * sp = (uint64_t *) (top - 16);
    sp[0] = (uint64_t) (uintptr_t) &entry;
    for (int i = 1; i <= 6; ++i) sp[-i] = 0;
    uint32_t ctl[2];
    asm volatile("stmxcsr %0" : "=m"(ctl[0]));
    asm volatile("fnstcw %0" : "=m"(ctl[1]));
    sp -= 7;
    std::memcpy(sp, ctl, 8);
    return sp;
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

// LB_MTL_LANE_ORDER=forward: first to last instead (to tell a kernel's reliance on lock step)
bool forward_order() {
    static const bool fwd = [] {
        const char * v = std::getenv("LB_MTL_LANE_ORDER");
        return v && std::strcmp(v, "forward") == 0;
    }();
    return fwd;
}

// what a threadgroup's memory holds when it starts: on a GPU whatever the last threadgroup left there, never
// promised to be zero. Poison (every byte 0xFF: NaN in float, half and bfloat, -1 in integers), so that a kernel
// reading what it did not write fails; LB_MTL_TGMEM_FILL=zero fills zeros instead (what hid a removed zero-init)
static int tgmem_fill() {
    static const int fill = [] {
        const char * v = std::getenv("LB_MTL_TGMEM_FILL");
        return v && std::strcmp(v, "zero") == 0 ? 0x00 : 0xFF;
    }();
    return fill;
}

}  // namespace

// a threadgroup array declared in a kernel's body (gen_kernels.py: a static thread_local, one per OS thread): filled
// as the threadgroup memory the host sets when the first of a threadgroup's threads reaches its declaration
void tg_local(void * p, std::size_t n) {
    static thread_local std::unordered_map<void *, unsigned long long> filled;
    unsigned long long & gen = filled[p];
    if (gen != G->generation) {
        std::memset(p, tgmem_fill(), n);
        gen = G->generation;
    }
}

namespace {

void run_group(group & g, unsigned gx, unsigned gy, unsigned gz) {
    const dispatch & d = *g.d;
    const unsigned nx = d.tptg[0], ny = d.tptg[1];
    g.generation++;
    for (int i = 0; i < (int) g.tgmem.size(); ++i) {
        if (g.tgmem[i].empty()) continue;
        std::memset(g.tgmem[i].data(), tgmem_fill(), d.tgmem_size[i]);
        std::memset(g.tgmem[i].data() + d.tgmem_size[i], GUARD_BYTE, GUARD);
    }
    for (auto & s : g.sg) {
        s = simdgroup();
    }
    for (int t = 0; t < g.n; ++t) {
        fiber & f = g.f[t];
        f.pos.tgpig[0] = gx;
        f.pos.tgpig[1] = gy;
        f.pos.tgpig[2] = gz;
        f.pos.tpitg[0] = t % nx;
        f.pos.tpitg[1] = (t / nx) % ny;
        f.pos.tpitg[2] = t / (nx * ny);
        f.pos.tiitg = t;
        f.pos.sgitg = t / 32;
        f.pos.tiisg = t % 32;
        for (int i = 0; i < MAX_TGMEM; ++i)
            f.pos.tgmem[i] = i < (int) g.tgmem.size() && !g.tgmem[i].empty() ? g.tgmem[i].data() : nullptr;
        g.sg[t / 32].live++;
        f.sp = fresh_stack(f.stack);
        f.st = RUNNABLE;
    }
    g.live = g.n;
    g.tg_arrived = 0;
    // the threads run from the last to the first: a simdgroup's lanes run one after the other between
    // two simdgroup operations, where a GPU runs them in lock step, and kernels let lane 0 do the serial
    // part of a step on data all lanes read in the same step (fa_vec_common.metal: every lane reads the
    // scores ss[] for its V columns, then lane 0, leaving the loop, writes S and M into ss[0..1]). Lane 0
    // last keeps that order in every step: the thread that completes a barrier or simdgroup operation
    // yields too, and the pass starts over from the last thread (else that thread would run its next
    // step first, ahead of the lanes it released)
    while (g.live > 0) {
        bool ran = false;
        g.resumed = false;
        for (int k = 0; k < g.n && !g.resumed; ++k) {
            const int t = forward_order() ? k : g.n - 1 - k;
            if (g.f[t].st != RUNNABLE) continue;
            g.cur = t;
            lb_fiber_switch(&g.sched, g.f[t].sp);
            ran = true;
        }
        if (!ran) deadlock(g);
    }
    for (int i = 0; i < (int) g.tgmem.size(); ++i) {
        if (g.tgmem[i].empty()) continue;
        const unsigned char * guard = g.tgmem[i].data() + d.tgmem_size[i];
        for (size_t k = GUARD; k-- > 0;) {
            if (guard[k] != GUARD_BYTE) {
                std::fprintf(
                    stderr,
                    "lbrt: %s wrote threadgroup memory [[threadgroup(%d)]] at byte %zu of %lu set by the host\n",
                    d.name ? d.name : "a kernel", i, d.tgmem_size[i] + k, d.tgmem_size[i]);
                std::abort();
            }
        }
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
            if (p == MAP_FAILED) {
                std::perror("lbrt: mmap");
                std::abort();
            }
            g.f[i].stack = (char *) p;
        }
    }
    g.sg.assign((g.n + 31) / 32, simdgroup());
    g.tgmem.resize(MAX_TGMEM);
    // each threadgroup buffer with a guard of GUARD bytes after it (checked after every threadgroup)
    for (int i = 0; i < MAX_TGMEM; ++i) g.tgmem[i].assign(d.tgmem_size[i] ? d.tgmem_size[i] + GUARD : 0, 0);
    if (d.set_fc) d.set_fc(d.fc);
}

void block(state st) {
    group & g = *G;
    fiber & me = g.f[g.cur];
    me.st = st;
    lb_fiber_switch(&me.sp, g.sched);
}

thread_local group tl_group;

// An integer division by zero (or INT_MIN / -1) traps on x86 but not on a GPU, and kernels compute such
// quotients they then leave unused (fa_common.metal's mask row pointer when there is no mask: iq2 %
// ne32 with ne32 = 0). Inside a kernel, SIGFPE from DIV/IDIV gives quotient and remainder 0 and skips
// the instruction; anywhere else it stays fatal.
int div_length(const unsigned char * ip) {
    int n = 0;
    while (ip[n] == 0x66 || ip[n] == 0x67) ++n;  // operand/address size prefixes
    if ((ip[n] & 0xf0) == 0x40) ++n;             // REX
    if (ip[n] != 0xf6 && ip[n] != 0xf7) return 0;
    const unsigned char modrm = ip[n + 1];
    const int mod = modrm >> 6, rm = modrm & 7, reg = (modrm >> 3) & 7;
    if (reg != 6 && reg != 7) return 0;  // DIV, IDIV
    n += 2;
    if (mod != 3 && rm == 4) {  // SIB
        const int base = ip[n] & 7;
        ++n;
        if (mod == 0 && base == 5) n += 4;
    }
    if (mod == 1)
        n += 1;
    else if (mod == 2 || (mod == 0 && rm == 5))
        n += 4;
    return n;
}

void on_sigfpe(int sig, siginfo_t *, void * uc_void) {
    auto * uc = static_cast<ucontext_t *>(uc_void);
    const auto * ip = (const unsigned char *) uc->uc_mcontext.gregs[REG_RIP];
    const int n = G ? div_length(ip) : 0;
    if (n == 0) {
        signal(sig, SIG_DFL);
        raise(sig);
        return;
    }
    uc->uc_mcontext.gregs[REG_RAX] = 0;
    uc->uc_mcontext.gregs[REG_RDX] = 0;
    uc->uc_mcontext.gregs[REG_RIP] += n;
}

void install_sigfpe() {
    static std::once_flag once;
    std::call_once(once, [] {
        struct sigaction sa = {};
        sa.sa_sigaction = on_sigfpe;
        sa.sa_flags = SA_SIGINFO;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGFPE, &sa, nullptr);
    });
}

}  // namespace

namespace {
bool g_half_simd_max_fault = false;  // set by the device's init, before any dispatch
}  // namespace

void set_half_simd_max_fault(bool on) {
    g_half_simd_max_fault = on;
}

bool half_simd_max_fault() {
    return g_half_simd_max_fault;
}

const thread_pos & pos() {
    return G->f[G->cur].pos;
}

void threadgroup_barrier() {
    group & g = *G;
    if (++g.tg_arrived == g.live) {
        for (int t = 0; t < g.n; ++t)
            if (g.f[t].st == WAIT_TG) g.f[t].st = RUNNABLE;
        g.tg_arrived = 0;
        g.resumed = true;
        block(RUNNABLE);  // (run_group's order from here)
        return;
    }
    block(WAIT_TG);
}

void simd_collective(void * mine, void (*fn)(void * const *, void *), void * ud) {
    group & g = *G;
    fiber & me = g.f[g.cur];
    simdgroup & s = g.sg[me.pos.sgitg];
    if (s.arrived == 0) {
        for (int l = 0; l < 32; ++l) s.ptr[l] = nullptr;
        s.fn = fn;
        s.ud = ud;
    } else if (s.fn != fn) {
        std::fprintf(stderr, "lbrt: divergent simdgroup operations in simdgroup %u (lane %u)\n", me.pos.sgitg,
                     me.pos.tiisg);
        std::abort();
    }
    s.ptr[me.pos.tiisg] = mine;
    if (++s.arrived == s.live) {
        void * ptr[32];
        for (int l = 0; l < 32; ++l) ptr[l] = s.ptr[l];
        s.arrived = 0;
        fn(ptr, ud);
        for (int t = 0; t < g.n; ++t)
            if (g.f[t].st == WAIT_SG && g.f[t].pos.sgitg == me.pos.sgitg) g.f[t].st = RUNNABLE;
        g.resumed = true;
        block(RUNNABLE);  // (run_group's order from here)
        return;
    }
    block(WAIT_SG);
}

void run(const dispatch & d) {
    install_sigfpe();
    const unsigned long n_groups = (unsigned long) d.grid[0] * d.grid[1] * d.grid[2];
    if (n_groups == 0 || d.tptg[0] * d.tptg[1] * d.tptg[2] == 0) return;
    static const int n_env = [] {
        const char * v = std::getenv("LB_MTL_THREADS");
        return v ? std::atoi(v) : 0;
    }();
    int n_threads = n_env > 0 ? n_env : (int) std::thread::hardware_concurrency();
    if ((unsigned long) n_threads > n_groups) n_threads = (int) n_groups;
    std::atomic<unsigned long> next{ 0 };
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
}  // namespace

void register_table(kernel_table * t) {
    std::lock_guard<std::mutex> lk(tables_mu);
    t->next = tables;
    tables = t;
}

const kernel_entry * find_kernel(const char * name) {
    std::lock_guard<std::mutex> lk(tables_mu);
    for (const kernel_table * t = tables; t; t = t->next)
        for (int i = 0; i < t->n; ++i)
            if (std::strcmp(t->entries[i].name, name) == 0) return &t->entries[i];
    return nullptr;
}

}  // namespace lbrt
