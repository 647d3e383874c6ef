// Graph: a ggml compute graph built node by node from Python (llamabind.ops), allocated with
// ggml_gallocr on one backend device, and run many times with new inputs. Backward graphs use
// ggml_build_backward_expand as upstream's test-backend-ops does.
//
// Python validates every op before it reaches ggml (ggml asserts abort the process); this file
// checks what would otherwise corrupt memory here: node ids, byte counts, build state.
#include "graph.h"
#include "ops.h"

#include <nanobind/stl/array.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <set>
#include <thread>

namespace lb {

static std::mutex backends_mutex;
static std::map<std::string, std::unique_ptr<SharedBackend>> backends;

SharedBackend & shared_backend(const std::string & name) {
    auto & m = backends_mutex;
    std::lock_guard<std::mutex> lock(m);
    auto it = backends.find(name);
    if (it != backends.end()) return *it->second;
    ggml_backend_dev_t dev = ggml_backend_dev_by_name(name.c_str());
    if (!dev) raise_value("no ggml backend device named '" + name + "' in this build (see llamabind.ops.devices())");
    ggml_backend_t be = ggml_backend_dev_init(dev, nullptr);
    if (!be) throw LlamaError("could not initialize the ggml backend device '" + name + "'");
    auto sb = std::make_unique<SharedBackend>();
    sb->max_threads = (int) std::max(1u, std::thread::hardware_concurrency());
    sb->backend = be;
    sb->dev = dev;
    sb->set_n_threads = (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(
        ggml_backend_dev_backend_reg(dev), "ggml_backend_set_n_threads");
    sb->host = ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU;
    if (sb->host) {  // a threadpool kept for the process (ggml_graph_compute would make one per call)
        ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
        using new_t = ggml_threadpool_t (*)(ggml_threadpool_params *);
        using set_t = void (*)(ggml_backend_t, ggml_threadpool_t);
        auto tp_new = (new_t) ggml_backend_reg_get_proc_address(reg, "ggml_threadpool_new");
        auto tp_set = (set_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_cpu_set_threadpool");
        if (tp_new && tp_set) {
            ggml_threadpool_params tpp = ggml_threadpool_params_default(sb->max_threads);
            if (ggml_threadpool_t tp = tp_new(&tpp)) tp_set(be, tp);
        }
    }
    sb->tag = ggml_backend_buft_alloc_buffer(ggml_backend_dev_buffer_type(dev), 64);
    if (!sb->tag) throw LlamaError("could not allocate a buffer on the ggml backend device '" + name + "'");
    auto & ref = *sb;
    backends[name] = std::move(sb);
    return ref;
}

static void graph_init(Graph * self, const std::string & device, size_t max_nodes) {
    new (self) Graph();
    self->be = &shared_backend(device);
    if (max_nodes < 16 || max_nodes > (1u << 20)) raise_value("max_nodes must be in [16, 2**20]");
    // room for the user's tensors plus the backward pass (grads, accumulators) and two graphs
    ggml_init_params ip = { ggml_tensor_overhead() * max_nodes * 4 +
                                2 * ggml_graph_overhead_custom(max_nodes * 4, true),
                            nullptr, /*no_alloc =*/true };
    self->ctx = ggml_init(ip);
    if (!self->ctx) throw LlamaError("ggml_init failed");
    const int hw = (int) std::max(1u, std::thread::hardware_concurrency());
    self->n_threads = hw;
}

static int graph_input(Graph & g, int type, std::array<int64_t, 4> ne) {
    g.check_building();
    if (type < 0 || type >= GGML_TYPE_COUNT || ggml_type_size((ggml_type) type) == 0)
        raise_value("invalid ggml type " + std::to_string(type));
    for (int64_t n : ne) {
        if (n < 1) raise_value("input dimensions must be >= 1");
    }
    if (ne[0] % ggml_blck_size((ggml_type) type) != 0)
        raise_value("the last axis must be a multiple of the type's block size");
    ggml_tensor * t = ggml_new_tensor_4d(g.ctx, (ggml_type) type, ne[0], ne[1], ne[2], ne[3]);
    ggml_set_input(t);
    return g.add(t);
}

static int graph_op(Graph & g, const std::string & name, const std::vector<int64_t> & srcs,
                    const std::vector<int64_t> & ints, const std::vector<double> & floats) {
    g.check_building();
    std::vector<ggml_tensor *> s;
    for (int64_t id : srcs) s.push_back(id < 0 ? nullptr : g.node(id));
    ggml_tensor * t = build_op(g.ctx, name, s, ints, floats);
    return g.add(t);
}

// (type, ne[4], contiguous) of a node. Contiguous in the strict sense that every stride is the
// packed one, size-1 axes included: ggml_is_contiguous skips the strides of size-1 axes, but the
// CPU binary kernels assert nb00 == sizeof(src0_t) and ggml_scale asserts ggml_is_padded_1d, so a
// transposed (n, 1) view that passes ggml_is_contiguous aborts there. Such views get a cont too.
static nb::tuple graph_info(Graph & g, int64_t id) {
    ggml_tensor * t = g.node(id);
    const bool packed = (size_t) t->nb[0] == ggml_type_size(t->type) &&
                        (size_t) t->nb[1] == ggml_row_size(t->type, t->ne[0]) && t->nb[2] == t->nb[1] * t->ne[1] &&
                        t->nb[3] == t->nb[2] * t->ne[2];
    return nb::make_tuple((int) t->type, std::array<int64_t, 4>{ t->ne[0], t->ne[1], t->ne[2], t->ne[3] }, packed);
}

static std::string op_desc(ggml_tensor * t) {
    std::string s = ggml_op_desc(t);
    s += " (";
    for (int i = 0; i < GGML_MAX_SRC && t->src[i]; ++i) {
        if (i) s += ", ";
        s += ggml_type_name(t->src[i]->type);
    }
    return s + " -> " + ggml_type_name(t->type) + ")";
}

// ggml_build_backward_expand / ggml_compute_backward abort on graphs they cannot differentiate.
// Walk the forward graph as they do (which nodes need gradients) and raise instead.
static void check_backward(ggml_cgraph * gf) {
    std::set<const ggml_tensor *> needs;
    bool any_param = false, any_loss = false;
    for (int i = 0; i < ggml_graph_n_nodes(gf); ++i) {
        ggml_tensor * n = ggml_graph_node(gf, i);
        any_param = any_param || (n->flags & GGML_TENSOR_FLAG_PARAM);
        any_loss = any_loss || (n->flags & GGML_TENSOR_FLAG_LOSS);
        if (n->type == GGML_TYPE_I32) continue;  // ggml skips integer nodes
        bool need = (n->flags & GGML_TENSOR_FLAG_PARAM) != 0;
        bool src_needs[GGML_MAX_SRC] = { false };
        for (int j = 0; j < GGML_MAX_SRC; ++j) {
            const ggml_tensor * src = n->src[j];
            if (!src || !needs.count(src)) continue;
            const bool ignored =
                (j == 0 && n->op == GGML_OP_IM2COL) ||
                (j == 1 && (n->op == GGML_OP_CPY || n->op == GGML_OP_GET_ROWS || n->op == GGML_OP_ROPE));
            if (ignored) continue;
            // BF16 only where ggml's backward keeps the gradients F32 (patches 0068-0069: a cast, a split SwiGLU
            // over BF16 activations, a BF16 activation times an F32 factor); the kernels are CUDA's
            const bool bf16_ok =
                src->type == GGML_TYPE_BF16 &&
                (n->op == GGML_OP_CPY ||
                 (n->op == GGML_OP_GLU && ggml_get_glu_op(n) == GGML_GLU_OP_SWIGLU && n->src[1] != nullptr) ||
                 (n->op == GGML_OP_MUL && j == 0 && n->src[1]->type == GGML_TYPE_F32 && !needs.count(n->src[1])));
            if (src->type != GGML_TYPE_F32 && src->type != GGML_TYPE_F16 && !bf16_ok) {
                raise_type("no gradient through a " + std::string(ggml_type_name(src->type)) + " tensor (" +
                           ggml_op_desc(n) + ")");
            }
            src_needs[j] = need = true;
        }
        if (!need || (n->flags & GGML_TENSOR_FLAG_PARAM)) {
            if (need) needs.insert(n);
            continue;
        }
        needs.insert(n);
        bool ok;
        switch (n->op) {
            case GGML_OP_DUP:
            case GGML_OP_ADD:
            case GGML_OP_ADD1:
            case GGML_OP_ACC:
            case GGML_OP_SUB:
            case GGML_OP_MUL:
            case GGML_OP_DIV:
            case GGML_OP_SQR:
            case GGML_OP_SQRT:
            case GGML_OP_LOG:
            case GGML_OP_SIN:
            case GGML_OP_COS:
            case GGML_OP_SUM:
            case GGML_OP_SUM_ROWS:
            case GGML_OP_MEAN:
            case GGML_OP_REPEAT:
            case GGML_OP_REPEAT_BACK:
            case GGML_OP_RMS_NORM:
            case GGML_OP_NORM:  // patch 0015
            case GGML_OP_SCALE:
            case GGML_OP_CPY:
            case GGML_OP_CONT:
            case GGML_OP_RESHAPE:
            case GGML_OP_VIEW:
            case GGML_OP_PERMUTE:
            case GGML_OP_TRANSPOSE:
            case GGML_OP_GET_ROWS:
            case GGML_OP_IM2COL:
            case GGML_OP_POOL_2D: ok = true; break;
            case GGML_OP_MUL_MAT: {  // src0 broadcast over src1's batches: only along ne[2] (ggml's rule)
                const ggml_tensor *a = n->src[0], *b = n->src[1];
                ok = (a->ne[2] == b->ne[2] && a->ne[3] == b->ne[3]) || (b->ne[3] == 1 && b->ne[2] % a->ne[2] == 0);
                break;
            }
            case GGML_OP_SOFT_MAX: ok = !src_needs[1]; break;            // no gradient for the mask
            case GGML_OP_CROSS_ENTROPY_LOSS: ok = !src_needs[1]; break;  // nor for the labels
            case GGML_OP_ROPE: ok = !src_needs[2]; break;                // nor for freq factors
            case GGML_OP_FLASH_ATTN_EXT:  // ggml_flash_attn_ext_back: not for the mask, nor with sinks
                ok = !src_needs[3] && n->src[4] == nullptr;
                break;
            case GGML_OP_GLU:  // the split SwiGLU only (ggml_swiglu_split: ops.swiglu)
                ok = ggml_get_glu_op(n) == GGML_GLU_OP_SWIGLU && n->src[1] != nullptr;
                break;
            case GGML_OP_UNARY: {
                const ggml_unary_op u = ggml_get_unary_op(n);
                ok = u == GGML_UNARY_OP_ABS || u == GGML_UNARY_OP_SGN || u == GGML_UNARY_OP_NEG ||
                     u == GGML_UNARY_OP_STEP || u == GGML_UNARY_OP_RELU || u == GGML_UNARY_OP_SILU ||
                     u == GGML_UNARY_OP_EXP || u == GGML_UNARY_OP_EXPM1 || u == GGML_UNARY_OP_SOFTPLUS ||
                     u == GGML_UNARY_OP_TANH || u == GGML_UNARY_OP_SIGMOID || u == GGML_UNARY_OP_GELU;  // 0015
                break;
            }
            default: ok = false;
        }
        if (!ok) raise_type("ggml has no backward pass for " + op_desc(n) + " in this configuration");
    }
    if (!any_param) raise_value("the loss does not depend on any of the inputs to differentiate");
    if (!any_loss) raise_value("the loss must be computed by an op, not be an input itself");
}

// Finish the graph: outputs, optional loss + params for gradients, backend support, allocation.
static void graph_build(Graph & g, const std::vector<int64_t> & inputs, const std::vector<int64_t> & outputs,
                        int64_t loss, const std::vector<int64_t> & params, bool external) {
    g.check_building();
    if (outputs.empty() && loss < 0) raise_value("a graph needs at least one output");
    const size_t size = g.nodes.size() * 4 + 64;
    g.gf = ggml_new_graph_custom(g.ctx, size, loss >= 0);
    if (loss >= 0) {  // params first: flagged tensors become graph nodes, not leafs
        for (int64_t id : params) {
            ggml_tensor * p = g.node(id);
            if (p->type != GGML_TYPE_F32) raise_type("gradients need float32 inputs");
            if (!(p->flags & GGML_TENSOR_FLAG_INPUT) || p->op != GGML_OP_NONE)
                raise_value("gradients are taken with respect to graph inputs");
        }
        ggml_tensor * l = g.node(loss);
        if (l->type != GGML_TYPE_F32 || !ggml_is_scalar(l)) raise_value("the loss must be a float32 scalar");
        for (int64_t id : params) ggml_set_param(g.node(id));
        ggml_set_loss(l);
        ggml_set_output(l);
    }
    for (int64_t id : outputs) {
        ggml_tensor * t = g.node(id);
        ggml_set_output(t);
        ggml_build_forward_expand(g.gf, t);
    }
    if (loss >= 0) {
        ggml_build_forward_expand(g.gf, g.node(loss));
        check_backward(g.gf);
        g.gb = ggml_new_graph_custom(g.ctx, size, true);
        ggml_graph_cpy(g.gf, g.gb);
        ggml_build_backward_expand(g.ctx, g.gb, nullptr);
        for (int64_t id : params) {
            ggml_tensor * gr = ggml_graph_get_grad(g.gb, g.node(id));
            if (!gr) continue;
            if (!ggml_is_contiguous(gr)) {  // e.g. through a transpose: materialize it
                gr = ggml_cont(g.ctx, gr);
                ggml_build_forward_expand(g.gb, gr);
            }
            ggml_set_output(gr);
            g.grad_out[g.node(id)] = gr;
        }
    }
    ggml_cgraph * run = g.gb ? g.gb : g.gf;
    // Every node must be supported by the device; report the first that is not.
    for (int i = 0; i < ggml_graph_n_nodes(run); ++i) {
        ggml_tensor * t = ggml_graph_node(run, i);
        if (!ggml_backend_supports_op(g.be->backend, t)) {
            raise_type("the op " + op_desc(t) + " is not supported on backend device '" +
                       std::string(ggml_backend_dev_name(g.be->dev)) + "'");
        }
    }
    bind_slots(g, inputs, outputs, params, external && !g.gb);
    g.galloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(g.be->backend));
    if (!ggml_gallocr_alloc_graph(g.galloc, run))
        throw LlamaError("could not allocate the graph's buffers on the device");
    g.built = true;
}

static nb::dict type_table() {
    nb::dict d;
    for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
        if (ggml_type_size((ggml_type) t) == 0) continue;  // removed types
        const char * name = ggml_type_name((ggml_type) t);
        if (!name) continue;
        d[name] = nb::make_tuple(t, ggml_blck_size((ggml_type) t), ggml_type_size((ggml_type) t),
                                 ggml_is_quantized((ggml_type) t));
    }
    return d;
}

void register_graph(nb::module_ & m) {
    auto cls = nb::class_<Graph>(m, "Graph", "A ggml compute graph on one backend device (see llamabind.ops).");
    cls.def("__init__", &graph_init, nb::arg("device"), nb::arg("max_nodes") = 256)
        .def("input", &graph_input, nb::arg("type"), nb::arg("ne"),
             "New input tensor (ggml type id, ne[4]); its node id.")
        .def("op", &graph_op, nb::arg("name"), nb::arg("srcs"), nb::arg("ints"), nb::arg("floats"),
             "Apply ggml op `name` (see ops.cpp) to nodes; its node id. Shapes must be validated by the caller.")
        .def("info", &graph_info, nb::arg("id"), "(ggml type id, ne[4], is_contiguous) of a node.")
        .def("build", &graph_build, nb::arg("inputs"), nb::arg("outputs"), nb::arg("loss") = -1,
             nb::arg("params") = std::vector<int64_t>{}, nb::arg("external") = true,
             "Fix what run() takes (inputs) and gives (outputs; with a loss, the params' gradients), check "
             "backend support, allocate (ggml_gallocr). external: bind inputs/outputs to the caller's memory "
             "at each run where possible (forward graphs).")
        .def_prop_ro("device", [](const Graph & g) { return std::string(ggml_backend_dev_name(g.be->dev)); })
        .def_prop_ro("n_nodes", [](const Graph & g) { return g.nodes.size(); });
    register_graph_run(m, cls);
    m.def(
        "free_device_buffers",
        [] {
            std::lock_guard<std::mutex> lock(backends_mutex);
            for (auto & [name, be] : backends) be->drain();
        },
        "Free the memory that dropped DeviceArrays left for reuse (up to 512 MiB per device).");
    m.def("ggml_types", &type_table, "ggml type name -> (id, block size, bytes per block, is_quantized).");
}

}  // namespace lb
