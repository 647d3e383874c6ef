// ggml-metal-context.h's C API on the CPU (issue 57; tests only): what ggml-metal-context.m does with
// command buffers, here in order on the calling thread: a graph is encoded by upstream's
// ggml-metal-ops.cpp into device.cpp's encoder, which runs each dispatch as it is encoded. The decision
// the .m makes from the device (concurrent dispatch or not: patch 0003) is its code, extracted at build
// time (extract_objc.py -> emu_from_objc_ctx.inc).
#include "ggml-metal-context.h"

#include "ggml-backend-impl.h"
#include "ggml-impl.h"
#include "ggml-metal-common.h"
#include "ggml-metal-fusion.h"
#include "ggml-metal-ops.h"

#include <cstdlib>
#include <cstring>

bool lb_device_supports_family(ggml_metal_device_t dev, int family);

struct ggml_metal {
    char name[128];
    ggml_metal_device_t dev;
    ggml_metal_library_t lib;
    ggml_metal_event_t ev_cpy;
    bool use_concurrency;
    bool use_graph_optimize;
    int debug_graph;
    struct ggml_metal_fusion_info * finfo;
    ggml_abort_callback abort_callback;
    void * abort_callback_data;
};

#include "emu_from_objc_ctx.inc"  // lb_use_concurrency(props_dev)

ggml_metal_t ggml_metal_init(ggml_metal_device_t dev) {
    auto * res = new ggml_metal();
    res->dev = dev;
    res->lib = ggml_metal_device_get_library(dev);
    res->ev_cpy = ggml_metal_device_event_init(dev);
    const struct ggml_metal_device_props * props_dev = ggml_metal_device_get_props(dev);
    snprintf(res->name, sizeof(res->name), "%s", props_dev->name);
    res->use_concurrency = lb_use_concurrency(props_dev);
    const char * val = getenv("GGML_METAL_GRAPH_DEBUG");
    res->debug_graph = val ? atoi(val) : 0;
    res->use_graph_optimize = getenv("GGML_METAL_GRAPH_OPTIMIZE_DISABLE") == nullptr;
    res->finfo = ggml_metal_device_get_fusion_info(dev);
    GGML_LOG_INFO("%s: use concurrency    = %s\n", __func__, res->use_concurrency ? "true" : "false");
    return res;
}

void ggml_metal_free(ggml_metal_t ctx) {
    ggml_metal_device_event_free(ctx->dev, ctx->ev_cpy);
    delete ctx;
}

const char * ggml_metal_get_name(ggml_metal_t ctx) {
    return ctx->name;
}
void ggml_metal_synchronize(ggml_metal_t) {}

void ggml_metal_set_tensor_async(ggml_metal_t, struct ggml_tensor * tensor, const void * data, size_t offset,
                                 size_t size) {
    memcpy((char *) tensor->data + offset, data, size);
}
void ggml_metal_get_tensor_async(ggml_metal_t, const struct ggml_tensor * tensor, void * data, size_t offset,
                                 size_t size) {
    memcpy(data, (const char *) tensor->data + offset, size);
}
bool ggml_metal_cpy_tensor_async(ggml_metal_t, ggml_metal_t, const struct ggml_tensor * src, struct ggml_tensor * dst) {
    memcpy(dst->data, src->data, ggml_nbytes(src));
    return true;
}

enum ggml_status ggml_metal_graph_compute(ggml_metal_t ctx, struct ggml_cgraph * gf) {
    if (gf->n_nodes == 0) return GGML_STATUS_SUCCESS;
    // (device.cpp's encoder takes the device for the command buffer)
    ggml_metal_op_t ctx_op = ggml_metal_op_init(ctx->dev, (ggml_metal_cmd_buf_t) ctx->dev, gf, ctx->finfo, 0,
                                                gf->n_nodes, ctx->use_concurrency, false, ctx->debug_graph);
    for (int idx = 0; idx < ggml_metal_op_n_nodes(ctx_op); ++idx) {
        if (ctx->abort_callback && ctx->abort_callback(ctx->abort_callback_data)) {
            ggml_metal_op_free(ctx_op);
            return GGML_STATUS_ABORTED;
        }
        const int res = ggml_metal_op_encode(ctx_op, idx);
        if (res == 0) break;
        idx += res - 1;
    }
    ggml_metal_op_free(ctx_op);
    return GGML_STATUS_SUCCESS;
}

void ggml_metal_graph_optimize(ggml_metal_t ctx, struct ggml_cgraph * gf) {
    if (ctx->use_graph_optimize) ggml_graph_optimize(gf);
}

void ggml_metal_event_record(ggml_metal_t, ggml_metal_event_t) {}
void ggml_metal_event_wait(ggml_metal_t, ggml_metal_event_t) {}
ggml_metal_event_t ggml_metal_get_ev_cpy(ggml_metal_t ctx) {
    return ctx->ev_cpy;
}
void ggml_metal_set_n_cb(ggml_metal_t, int) {}
void ggml_metal_set_abort_callback(ggml_metal_t ctx, ggml_abort_callback abort_callback, void * user_data) {
    ctx->abort_callback = abort_callback;
    ctx->abort_callback_data = user_data;
}
bool ggml_metal_supports_family(ggml_metal_t ctx, int family) {
    return lb_device_supports_family(ctx->dev, 1001 + family - 1);  // MTLGPUFamilyApple1 + family - 1
}
void ggml_metal_capture_next_compute(ggml_metal_t) {}
