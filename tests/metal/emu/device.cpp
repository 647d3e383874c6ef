// ggml-metal-device.h's C API implemented on the CPU (issue 57; tests only, never in a wheel): what
// ggml-metal-device.m does over Metal.framework, here over host memory and the kernels compiled by
// gen_kernels.py (rt.cpp runs a dispatch). The device is one of three profiles (LB_MTL_PROFILE):
//   apple  Apple M2 Max: unified memory, simdgroup matrices, bfloat, GPU family Apple7 + Metal3 + Mac2
//   amd    AMD Radeon Pro 5300M: discrete (no unified memory), no simdgroup matrices, Metal3 + Mac2
//   intel  Intel UHD Graphics 630: unified memory, Mac2 only (no Metal3, not Apple7)
// The decisions ggml-metal-device.m makes from the device (its props, ggml_metal_device_supports_op) are
// upstream's code, extracted from the patched .m at build time (extract_objc.py -> emu_from_objc.inc).
#include "ggml-metal-device.h"

#include "ggml-backend-impl.h"
#include "ggml-impl.h"
#include "ggml-metal-fusion.h"
#include "ggml-metal-common.h"
#include "ggml-metal-impl.h"
#include "ggml-metal-tuning.h"
#include "lb_msl_rt.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

// MTLGPUFamily values (Metal's MTLDevice.h) and the two ggml spells out itself
enum {
    MTLGPUFamilyApple6 = 1006,
    MTLGPUFamilyApple7 = 1007,
    MTLGPUFamilyMac2 = 2002,
    MTLGPUFamilyMetal3_GGML = 5001,
    MTLGPUFamilyMetal4_GGML = 5002,
};

struct lb_profile {
    const char * key;
    const char * name;
    bool unified_memory;
    std::vector<int> families;
    size_t max_tg_mem;
    enum ggml_metal_device_id id;
    bool half_simd_max_fault;  // RDNA's (patch 0004): lbrt::half_simd_max_fault()
};

static const lb_profile lb_profiles[] = {
    { "apple",
      "Apple M2 Max (emulated)",
      true,
      { 1001, 1002, 1003, 1004, 1005, MTLGPUFamilyApple6, MTLGPUFamilyApple7, 1008, MTLGPUFamilyMac2,
        MTLGPUFamilyMetal3_GGML },
      32768,
      GGML_METAL_DEVICE_M2_MAX,
      false },
    { "amd",
      "AMD Radeon Pro 5300M (emulated)",
      false,
      { MTLGPUFamilyMac2, MTLGPUFamilyMetal3_GGML },
      65536,
      GGML_METAL_DEVICE_GENERIC,
      true },
    { "intel",
      "Intel(R) UHD Graphics 630 (emulated)",
      true,
      { MTLGPUFamilyMac2 },
      65536,
      GGML_METAL_DEVICE_GENERIC,
      false },
};

static const lb_profile & lb_current_profile() {
    const char * v = getenv("LB_MTL_PROFILE");
    for (const auto & p : lb_profiles) {
        if (v && strcmp(v, p.key) == 0) return p;
    }
    if (v && *v) GGML_ABORT("LB_MTL_PROFILE=%s: not one of apple, amd, intel", v);
    return lb_profiles[0];
}

// --------------------------------------------------------------------------- function constants, pipelines

struct ggml_metal_cv {
    std::map<int, long long> v;
};
ggml_metal_cv_t ggml_metal_cv_init(void) {
    return new ggml_metal_cv();
}
void ggml_metal_cv_free(ggml_metal_cv_t cv) {
    delete cv;
}
void ggml_metal_cv_set_int16(ggml_metal_cv_t cv, int16_t value, int32_t idx) {
    cv->v[idx] = value;
}
void ggml_metal_cv_set_int32(ggml_metal_cv_t cv, int32_t value, int32_t idx) {
    cv->v[idx] = value;
}
void ggml_metal_cv_set_bool(ggml_metal_cv_t cv, bool value, int32_t idx) {
    cv->v[idx] = value;
}

struct ggml_metal_pipeline {
    const lbrt::kernel_entry * kernel = nullptr;
    std::vector<long long> fc = std::vector<long long>(lbrt::MAX_FC, 0);
};
ggml_metal_pipeline_t ggml_metal_pipeline_init(void) {
    return new ggml_metal_pipeline();
}
void ggml_metal_pipeline_free(ggml_metal_pipeline_t pipeline) {
    delete pipeline;
}
int ggml_metal_pipeline_max_theads_per_threadgroup(struct ggml_metal_pipeline_with_params) {
    return 1024;
}

// --------------------------------------------------------------------------- encoder
// A dispatch runs as it is encoded, in order. The fault patch 0003 works around is modelled: on a device
// without unified memory, memory barriers do not make one dispatch's writes visible to the next (AMD's
// L2 is not flushed), so a concurrent encoder there runs its dispatches at end_encoding in reverse order,
// the worst order barriers were meant to exclude: a dispatch reads its producer's output before it is
// written. A serial encoder (what 0003 chooses there) is unaffected.

struct ggml_metal_encoder {
    ggml_metal_pipeline_t pipeline = nullptr;
    lbrt::dispatch d{};
    std::vector<std::vector<unsigned char>> bytes = std::vector<std::vector<unsigned char>>(lbrt::MAX_BUFFERS);
    bool is_bytes[lbrt::MAX_BUFFERS] = {};
    bool stale_barriers = false;  // concurrent, without unified memory
    struct deferred {
        lbrt::dispatch d;
        std::vector<std::vector<unsigned char>> bytes;
    };
    std::vector<deferred> pending;
};

ggml_metal_encoder_t ggml_metal_encoder_init(ggml_metal_cmd_buf_t cmd_buf, bool concurrent) {
    auto * enc = new ggml_metal_encoder();
    // (context.cpp passes its device as the command buffer)
    auto * dev = static_cast<ggml_metal_device_t>(cmd_buf);
    enc->stale_barriers = concurrent && dev && !ggml_metal_device_get_props(dev)->has_unified_memory;
    return enc;
}

static void lb_run_pending(ggml_metal_encoder_t encoder) {
    for (auto it = encoder->pending.rbegin(); it != encoder->pending.rend(); ++it) lbrt::run(it->d);
    encoder->pending.clear();
}

void ggml_metal_encoder_free(ggml_metal_encoder_t encoder) {
    lb_run_pending(encoder);
    delete encoder;
}
void ggml_metal_encoder_debug_group_push(ggml_metal_encoder_t, const char *) {}
void ggml_metal_encoder_debug_group_pop(ggml_metal_encoder_t) {}

void ggml_metal_encoder_set_pipeline(ggml_metal_encoder_t encoder, struct ggml_metal_pipeline_with_params pipeline) {
    GGML_ASSERT(pipeline.pipeline && pipeline.pipeline->kernel);
    encoder->pipeline = pipeline.pipeline;
}
void ggml_metal_encoder_set_bytes(ggml_metal_encoder_t encoder, void * data, size_t size, int idx) {
    GGML_ASSERT(idx >= 0 && idx < lbrt::MAX_BUFFERS);
    auto & b = encoder->bytes[idx];
    b.assign((unsigned char *) data, (unsigned char *) data + size);
    b.resize(size + 16);  // (a zero-sized argument still gets an address)
    encoder->d.buffers[idx] = b.data();
    encoder->is_bytes[idx] = true;
}
void ggml_metal_encoder_set_buffer(ggml_metal_encoder_t encoder, struct ggml_metal_buffer_id buffer, int idx) {
    GGML_ASSERT(idx >= 0 && idx < lbrt::MAX_BUFFERS);
    encoder->d.buffers[idx] = (char *) buffer.metal + buffer.offs;
    encoder->is_bytes[idx] = false;
}
void ggml_metal_encoder_set_threadgroup_memory_size(ggml_metal_encoder_t encoder, size_t size, int idx) {
    GGML_ASSERT(idx >= 0 && idx < lbrt::MAX_TGMEM);
    encoder->d.tgmem_size[idx] = size;
}
void ggml_metal_encoder_dispatch_threadgroups(ggml_metal_encoder_t encoder, int tg0, int tg1, int tg2, int tptg0,
                                              int tptg1, int tptg2) {
    GGML_ASSERT(encoder->pipeline);
    GGML_ASSERT(tptg0 * tptg1 * tptg2 <= 1024 && "more threads per threadgroup than a Metal pipeline takes");
    lbrt::dispatch & d = encoder->d;
    d.thunk = encoder->pipeline->kernel->thunk;
    d.set_fc = encoder->pipeline->kernel->set_fc;
    d.fc = encoder->pipeline->fc.data();
    d.name = encoder->pipeline->kernel->name;
    d.grid[0] = tg0;
    d.grid[1] = tg1;
    d.grid[2] = tg2;
    d.tptg[0] = tptg0;
    d.tptg[1] = tptg1;
    d.tptg[2] = tptg2;
    if (!encoder->stale_barriers) {
        lbrt::run(d);
        return;
    }
    ggml_metal_encoder::deferred later{ d, {} };
    for (int i = 0; i < lbrt::MAX_BUFFERS; ++i) {
        if (!encoder->is_bytes[i]) continue;
        later.bytes.push_back(encoder->bytes[i]);
        later.d.buffers[i] = later.bytes.back().data();
    }
    encoder->pending.push_back(std::move(later));
}
void ggml_metal_encoder_memory_barrier(ggml_metal_encoder_t) {}
void ggml_metal_encoder_end_encoding(ggml_metal_encoder_t encoder) {
    lb_run_pending(encoder);
}

// --------------------------------------------------------------------------- library: the compiled kernels

struct ggml_metal_library {
    ggml_metal_device_t dev;
    ggml_metal_pipelines_t pipelines;
    std::mutex lock;
};

ggml_metal_library_t ggml_metal_library_init(ggml_metal_device_t dev) {
    auto * res = new ggml_metal_library();
    res->dev = dev;
    res->pipelines = ggml_metal_pipelines_init();
    return res;
}
ggml_metal_library_t ggml_metal_library_init_from_source(ggml_metal_device_t, const char *, bool) {
    return nullptr;  // no compiler for MSL source at run time
}
void ggml_metal_library_free(ggml_metal_library_t lib) {
    if (!lib) return;
    ggml_metal_pipelines_free(lib->pipelines);
    delete lib;
}
ggml_metal_device_t ggml_metal_library_get_device(ggml_metal_library_t lib) {
    return lib->dev;
}

struct ggml_metal_pipeline_with_params ggml_metal_library_get_pipeline(ggml_metal_library_t lib, const char * name) {
    std::lock_guard<std::mutex> lk(lib->lock);
    struct ggml_metal_pipeline_with_params res = {};
    res.pipeline = ggml_metal_pipelines_get(lib->pipelines, name);
    return res;
}

struct ggml_metal_pipeline_with_params ggml_metal_library_compile_pipeline(ggml_metal_library_t lib, const char * base,
                                                                           const char * name, ggml_metal_cv_t cv) {
    std::lock_guard<std::mutex> lk(lib->lock);
    struct ggml_metal_pipeline_with_params res = {};
    res.pipeline = ggml_metal_pipelines_get(lib->pipelines, name);
    if (res.pipeline) return res;
    const lbrt::kernel_entry * k = lbrt::find_kernel(base);
    if (!k) {
        GGML_LOG_ERROR("%s: kernel not found in any metal library: base = '%s', name = '%s'\n", __func__, base, name);
        return res;
    }
    ggml_metal_pipeline_t ppl = ggml_metal_pipeline_init();
    ppl->kernel = k;
    if (cv) {
        for (const auto & [idx, v] : cv->v) {
            GGML_ASSERT(idx >= 0 && idx < lbrt::MAX_FC);
            ppl->fc[idx] = v;
        }
    }
    ggml_metal_pipelines_add(lib->pipelines, name, ppl);
    res.pipeline = ppl;
    // the tests read which kernels ran: LB_MTL_TRACE on stderr, LB_MTL_TRACE_FILE appended to (kernel file, base)
    static const bool trace = getenv("LB_MTL_TRACE") != nullptr;
    if (trace) fprintf(stderr, "lb_mtl: pipeline %s (%s) %s\n", name, base, k->source);
    if (const char * path = getenv("LB_MTL_TRACE_FILE")) {
        if (FILE * f = fopen(path, "a")) {
            fprintf(f, "%s %s\n", k->source, base);
            fclose(f);
        }
    }
    return res;
}

// --------------------------------------------------------------------------- residency sets, events: no-ops

struct ggml_metal_rsets {
    int unused;
};
ggml_metal_rsets_t ggml_metal_rsets_init(ggml_metal_device_t) {
    return new ggml_metal_rsets();
}
void ggml_metal_rsets_free(ggml_metal_rsets_t rsets) {
    delete rsets;
}

struct ggml_metal_event {
    int unused;
};
void ggml_metal_event_encode_signal(ggml_metal_event_t, ggml_metal_cmd_buf_t) {}
void ggml_metal_event_encode_wait(ggml_metal_event_t, ggml_metal_cmd_buf_t) {}

// --------------------------------------------------------------------------- device

struct ggml_metal_device {
    const lb_profile * profile;
    ggml_metal_library_t library;
    ggml_metal_rsets_t rsets;
    struct ggml_metal_device_props props;
    struct ggml_metal_fusion_info * finfo;
    int queue;  // (the address of a non-null "queue")
};

static bool lb_supports_family(const ggml_metal_device * dev, int family) {
    for (int f : dev->profile->families)
        if (f == family) return true;
    return false;
}

#include "emu_from_objc.inc"  // lb_props_from_device(dev), ggml_metal_device_supports_op

// for the context (ggml_metal_supports_family)
bool lb_device_supports_family(ggml_metal_device_t dev, int family) {
    return lb_supports_family(dev, family);
}

const char * ggml_metal_device_id_token(enum ggml_metal_device_id id) {
    return id == GGML_METAL_DEVICE_M2_MAX ? "M2_MAX" : "GENERIC";
}

ggml_metal_device_t ggml_metal_device_init(int device, int n_devices) {
    auto * dev = new ggml_metal_device();
    dev->profile = &lb_current_profile();
    // the profile's GPU faults; LB_MTL_FAULT_HALF_SIMD_MAX=1/0 switches RDNA's on/off under any profile
    const char * fault = getenv("LB_MTL_FAULT_HALF_SIMD_MAX");
    lbrt::set_half_simd_max_fault(fault && *fault ? strcmp(fault, "0") != 0 : dev->profile->half_simd_max_fault);
    dev->props.device = device;
    dev->props.device_phys = 0;
    dev->props.device_virt = device;
    lb_props_from_device(dev);
    dev->props.device_id = dev->profile->id;
    dev->props.op_offload_min_batch_size =
        getenv("GGML_OP_OFFLOAD_MIN_BATCH") ? atoi(getenv("GGML_OP_OFFLOAD_MIN_BATCH")) : 32;
    dev->props.max_buffer_size = size_t(4) << 30;
    dev->props.max_working_set_size = size_t(8) << 30;
    dev->props.max_theadgroup_memory_size = dev->profile->max_tg_mem;
    dev->props.gpu_family = 0;
    const char * dbg = getenv("GGML_METAL_FUSION_DEBUG");
    dev->finfo = ggml_metal_fusion_info_init(getenv("GGML_METAL_FUSION_DISABLE") == nullptr, dbg ? atoi(dbg) : 0);
    snprintf(dev->props.name, sizeof(dev->props.name), "%s%d", "MTL", device);
    snprintf(dev->props.desc, sizeof(dev->props.desc), "%s", dev->profile->name);
    (void) n_devices;
    dev->rsets = ggml_metal_rsets_init(dev);
    dev->library = ggml_metal_library_init(dev);
    return dev;
}

void ggml_metal_device_free(ggml_metal_device_t dev) {
    ggml_metal_library_free(dev->library);
    ggml_metal_rsets_free(dev->rsets);
    ggml_metal_fusion_info_free(dev->finfo);
    delete dev;
}

void * ggml_metal_device_get_obj(ggml_metal_device_t dev) {
    return dev;
}
void * ggml_metal_device_get_queue(ggml_metal_device_t dev) {
    return &dev->queue;
}
ggml_metal_library_t ggml_metal_device_get_library(ggml_metal_device_t dev) {
    return dev->library;
}
void ggml_metal_device_rsets_add(ggml_metal_device_t, ggml_metal_rset_t) {}
void ggml_metal_device_rsets_rm(ggml_metal_device_t, ggml_metal_rset_t) {}
void ggml_metal_device_rsets_keep_alive(ggml_metal_device_t) {}
ggml_metal_event_t ggml_metal_device_event_init(ggml_metal_device_t) {
    return new ggml_metal_event();
}
void ggml_metal_device_event_free(ggml_metal_device_t, ggml_metal_event_t ev) {
    delete ev;
}
void ggml_metal_device_event_synchronize(ggml_metal_device_t, ggml_metal_event_t) {}
void ggml_metal_device_get_memory(ggml_metal_device_t dev, size_t * free, size_t * total) {
    *total = dev->props.max_working_set_size;
    *free = *total;
}
const struct ggml_metal_device_props * ggml_metal_device_get_props(ggml_metal_device_t dev) {
    return &dev->props;
}
struct ggml_metal_fusion_info * ggml_metal_device_get_fusion_info(ggml_metal_device_t dev) {
    return dev->finfo;
}

// --------------------------------------------------------------------------- buffers: host memory

struct ggml_metal_buffer {
    ggml_metal_device_t dev;
    void * data;
    size_t size;
    bool is_shared;
    bool owned;
};

ggml_metal_buffer_t ggml_metal_buffer_init(ggml_metal_device_t dev, size_t size, bool shared) {
    auto * res = new ggml_metal_buffer();
    res->dev = dev;
    res->size = size;
    res->is_shared = shared && dev->props.use_shared_buffers;
    res->owned = true;
    res->data = nullptr;
    if (posix_memalign(&res->data, 4096, size > 0 ? size : 1) != 0) {
        GGML_LOG_ERROR("%s: error: failed to allocate buffer, size = %8.2f MiB\n", __func__, size / 1024.0 / 1024.0);
        delete res;
        return nullptr;
    }
    return res;
}
ggml_metal_buffer_t ggml_metal_buffer_map(ggml_metal_device_t dev, void * ptr, size_t size, size_t) {
    auto * res = new ggml_metal_buffer();
    res->dev = dev;
    res->data = ptr;
    res->size = size;
    res->is_shared = true;
    res->owned = false;
    return res;
}
void ggml_metal_buffer_free(ggml_metal_buffer_t buf) {
    if (buf->owned) free(buf->data);
    delete buf;
}
void * ggml_metal_buffer_get_base(ggml_metal_buffer_t buf) {
    return buf->data;
}
bool ggml_metal_buffer_is_shared(ggml_metal_buffer_t buf) {
    return buf->is_shared;
}
void ggml_metal_buffer_memset_tensor(ggml_metal_buffer_t, struct ggml_tensor * tensor, uint8_t value, size_t offset,
                                     size_t size) {
    memset((char *) tensor->data + offset, value, size);
}
void ggml_metal_buffer_set_tensor(ggml_metal_buffer_t, struct ggml_tensor * tensor, const void * data, size_t offset,
                                  size_t size) {
    memcpy((char *) tensor->data + offset, data, size);
}
void ggml_metal_buffer_get_tensor(ggml_metal_buffer_t, const struct ggml_tensor * tensor, void * data, size_t offset,
                                  size_t size) {
    memcpy(data, (const char *) tensor->data + offset, size);
}
bool ggml_metal_buffer_cpy_tensor(ggml_metal_buffer_t, const struct ggml_tensor * src, struct ggml_tensor * dst) {
    memcpy(dst->data, src->data, ggml_nbytes(src));  // every buffer of this build is host memory
    return true;
}
void ggml_metal_buffer_clear(ggml_metal_buffer_t buf, uint8_t value) {
    memset(buf->data, value, buf->size);
}

struct ggml_metal_buffer_id ggml_metal_buffer_get_id(ggml_metal_buffer_t buf, const struct ggml_tensor * t) {
    struct ggml_metal_buffer_id res = { nullptr, 0 };
    const char * base = (const char *) buf->data;
    if ((const char *) t->data >= base && (const char *) t->data + ggml_nbytes(t) <= base + buf->size) {
        res.metal = buf->data;
        res.offs = (size_t) ((const char *) t->data - base);
    } else {
        GGML_LOG_ERROR("%s: error: tensor '%s' buffer is nil\n", __func__, t->name);
    }
    return res;
}
