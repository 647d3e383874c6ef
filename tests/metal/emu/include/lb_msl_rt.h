// The runtime under the Metal kernels run on the CPU (issue 57; tests only): what a kernel, the generated
// thunks and the emulated device layer share. A dispatch runs its threadgroups on a few OS threads; the
// threads of a threadgroup are fibers of one OS thread, switched at threadgroup barriers and simdgroup
// operations only (a simdgroup's 32 lanes are threads tiisg 0-31 of simdgroup sgitg, numbered as Metal
// numbers them: x fastest).
#pragma once

#include <cstddef>
#include <type_traits>

namespace lbrt {

// the current thread's barriers and simdgroup operations (msl: threadgroup_barrier, simd_*)
void threadgroup_barrier();
// a kernel body's threadgroup array (gen_kernels.py), filled as host-set threadgroup memory once per threadgroup
void tg_local(void * p, std::size_t n);
// The hardware fault patch 0004 works around, modelled: simd_max over half values is -INF on RDNA when a
// lane holds -INF. device.cpp sets it from the profile (on for the AMD one, an RDNA GPU) or
// LB_MTL_FAULT_HALF_SIMD_MAX=1/0: at the pin only the Apple profile is offered the kernel it hits.
void set_half_simd_max_fault(bool on);
bool half_simd_max_fault();
// Runs fn(lanes, ud) once every active lane of the caller's simdgroup has called, with lanes[i] = the
// `mine` of lane i (nullptr for lanes that have returned); then all of them go on.
void simd_collective(void * mine, void (*fn)(void * const * lanes, void * ud), void * ud);

enum { MAX_BUFFERS = 32, MAX_TGMEM = 8, MAX_FC = 4096 };

struct dispatch;
typedef void (*thunk_fn)(const dispatch & d);
typedef void (*set_fc_fn)(const long long * fc);

// one dispatch of one kernel: what the encoder has set
struct dispatch {
    thunk_fn thunk;              // calls the kernel for the current thread
    set_fc_fn set_fc;            // sets its source's function constants on the calling OS thread
    const long long * fc;        // function-constant values by index (MAX_FC)
    void * buffers[MAX_BUFFERS]; // [[buffer(i)]]: the bound buffer's address plus offset, or the set bytes
    unsigned long tgmem_size[MAX_TGMEM];
    unsigned grid[3];            // threadgroups per grid
    unsigned tptg[3];            // threads per threadgroup
    const char * name;           // the pipeline's name (for messages)
};

// the current thread's position (valid inside a thunk)
struct thread_pos {
    unsigned tgpig[3], tpitg[3];
    unsigned tiitg, sgitg, tiisg;
    void * tgmem[MAX_TGMEM];
};
const thread_pos & pos();

// runs every threadgroup of d; returns once all have finished. Aborts with a message on a deadlock (the
// threads of a group blocked at different barriers: divergent barriers or simdgroup operations).
void run(const dispatch & d);

// a kernel argument bound by index: converts to the parameter's pointer or reference type
struct arg {
    void * p;
    template <typename T> operator T &() const {
        if constexpr (std::is_pointer_v<T>) return *(T *) const_cast<void **>(&p);
        else return *reinterpret_cast<T *>(p);
    }
};
// an attribute value (uint3, ushort3, uint2, uint, ushort, ...)
struct attr {
    unsigned v[3];
    template <typename T> operator T() const {
        if constexpr (requires_lanes<T>(0) == 3) return T(v[0], v[1], v[2]);
        else if constexpr (requires_lanes<T>(0) == 2) return T(v[0], v[1]);
        else return T(v[0]);
    }
    template <typename T> static constexpr int requires_lanes(long) { return 1; }
    template <typename T, int L = T::lanes> static constexpr int requires_lanes(int) { return L; }
};

// what a compiled kernel source registers: its kernels by host name
struct kernel_entry {
    const char * name;
    thunk_fn thunk;
    set_fc_fn set_fc;
    const char * source;  // the kernel file (e.g. "norm.metal")
};
struct kernel_table {
    const kernel_entry * entries;
    int n;
    const kernel_table * next;
};
void register_table(kernel_table * t);
const kernel_entry * find_kernel(const char * name);

}  // namespace lbrt
