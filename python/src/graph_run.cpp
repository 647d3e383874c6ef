// Running a built Graph (graph.h): inputs and outputs are bound to the caller's memory at each run.
// On the CPU backend a numpy array is used in place as the tensor's data (no copy in or out) when
// it is C-contiguous and 16-byte aligned; a DeviceBuffer on the graph's device is used in place on
// any backend; anything else is copied through a per-slot scratch buffer. DeviceBuffer is the
// memory behind llamabind.ops.DeviceArray, with DLPack export and import.
#include "graph.h"

#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <dlfcn.h>

#include <cstring>
#include <set>

namespace lb {

static bool writes_into_its_source(const ggml_tensor * v) {
    switch (v->op) {
        case GGML_OP_NONE:
        case GGML_OP_VIEW:
        case GGML_OP_RESHAPE:
        case GGML_OP_PERMUTE:
        case GGML_OP_TRANSPOSE: return false;
        default: return true;  // cpy, set_rows, *_inplace: the result is a view that ggml writes
    }
}

static void * placeholder(const Graph & g) {
    return ggml_backend_buffer_get_base(g.be->tag);
}

void bind_slots(Graph & g, const std::vector<int64_t> & inputs, const std::vector<int64_t> & outputs,
                const std::vector<int64_t> & params, bool external) {
    std::vector<ggml_tensor *> all;
    for (ggml_tensor * t = ggml_get_first_tensor(g.ctx); t; t = ggml_get_next_tensor(g.ctx, t)) all.push_back(t);
    auto views_of = [&](ggml_tensor * t, bool & written) {
        std::vector<ggml_tensor *> v;
        for (ggml_tensor * u : all) {
            if (u->view_src != t) continue;
            v.push_back(u);
            written = written || writes_into_its_source(u);
        }
        return v;
    };
    std::set<ggml_tensor *> seen;
    for (int64_t id : inputs) {
        Slot s;
        s.t = g.node(id);
        if (!(s.t->flags & GGML_TENSOR_FLAG_INPUT)) raise_value("node " + std::to_string(id) + " is not an input");
        bool written = false;
        s.views = views_of(s.t, written);
        s.external = external && !written && seen.insert(s.t).second;
        g.ins.push_back(std::move(s));
    }
    for (int64_t id : outputs) {
        Slot s;
        s.t = g.node(id);
        if (!(s.t->flags & GGML_TENSOR_FLAG_OUTPUT)) raise_value("node " + std::to_string(id) + " is not an output");
        if (!ggml_is_contiguous(s.t)) raise_value("outputs must be contiguous (use cont)");
        bool written = false;
        s.views = views_of(s.t, written);
        s.external = external && !written && s.t->view_src == nullptr && s.t->op != GGML_OP_NONE &&
                     !(s.t->flags & GGML_TENSOR_FLAG_INPUT) && seen.insert(s.t).second;
        g.outs.push_back(std::move(s));
    }
    for (int64_t id : params) g.params.push_back(g.node(id));
    for (auto * v : { &g.ins, &g.outs }) {
        for (Slot & s : *v) {
            if (s.external) s.t->data = placeholder(g);  // ggml_gallocr skips tensors that have data
        }
    }
}

static void bind(Slot & s, void * data, ggml_backend_buffer_t buf) {
    s.t->data = data;
    s.t->buffer = buf;
    for (ggml_tensor * v : s.views) {
        v->data = (char *) data + v->view_offs;
        v->buffer = buf;
    }
}

// A tensor standing for `n` raw bytes at `data` in `buf` (for ggml_backend_tensor_set/get/copy).
static ggml_tensor raw_tensor(void * data, size_t n, ggml_backend_buffer_t buf) {
    ggml_tensor t{};
    t.type = GGML_TYPE_I8;
    t.ne[0] = (int64_t) n;
    t.ne[1] = t.ne[2] = t.ne[3] = 1;
    t.nb[0] = 1;
    t.nb[1] = t.nb[2] = t.nb[3] = n;
    t.data = data;
    t.buffer = buf;
    return t;
}

// n bytes from one place in a device buffer to another (ggml_backend_tensor_copy; synchronous)
static void copy_bytes(void * dst, ggml_backend_buffer_t dst_buf, void * src, ggml_backend_buffer_t src_buf, size_t n) {
    ggml_tensor s = raw_tensor(src, n, src_buf);
    ggml_tensor d = raw_tensor(dst, n, dst_buf);
    ggml_backend_tensor_copy(&s, &d);
}

// What the caller gave for one slot: host bytes (a buffer-protocol object) or a DeviceBuffer.
struct Arg {
    DeviceBuffer * dev = nullptr;
    Py_buffer view{};
    bool has_view = false;
    nb::object owner;  // a contiguous copy made here, or the array behind a DeviceArray/Blocks
    bool made_contiguous = false;
    void * ptr() const { return dev ? dev->data : view.buf; }
    size_t size() const { return dev ? dev->size : (size_t) view.len; }
    ~Arg() {
        if (has_view) PyBuffer_Release(&view);
    }
};

// Arg storage without a heap allocation for the usual few arguments.
struct CallArgs {
    Arg small[4];
    std::unique_ptr<Arg[]> big;
    Arg * p;

    explicit CallArgs(size_t n) : p(small) {
        if (n > 4) {
            big.reset(new Arg[n]);
            p = big.get();
        }
    }
    Arg & operator[](size_t i) { return p[i]; }
};

static void take_arg(Arg & a, nb::handle h, const Graph & g, bool writable, const char * what, size_t i,
                     bool unwrap = true) {
    if (nb::isinstance<DeviceBuffer>(h)) {
        a.dev = nb::inst_ptr<DeviceBuffer>(h);
        if (a.dev->be != g.be) {
            raise_value(std::string(what) + " " + std::to_string(i) + " is on " +
                        ggml_backend_dev_name(a.dev->be->dev) + ", the graph on " + ggml_backend_dev_name(g.be->dev) +
                        " (move it with .numpy() or to_device)");
        }
        return;
    }
    const int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(h.ptr(), &a.view, flags) == 0) {
        a.has_view = true;
        return;
    }
    PyErr_Clear();
    for (const char * attr : { "_buf", "_lb_bytes" }) {  // llamabind.ops.DeviceArray, Blocks (one level)
        if (unwrap && nb::hasattr(h, attr)) {
            nb::object inner = h.attr(attr);
            take_arg(a, inner, g, writable, what, i, false);
            if (!a.owner.is_valid()) a.owner = inner;
            return;
        }
    }
    if (writable) raise_type(std::string(what) + " " + std::to_string(i) + " must be a writable C-contiguous array");
    static auto * contiguous = new nb::object(nb::module_::import_("numpy").attr("ascontiguousarray"));
    a.owner = (*contiguous)(h);
    a.made_contiguous = true;
    if (PyObject_GetBuffer(a.owner.ptr(), &a.view, PyBUF_C_CONTIGUOUS) != 0) {
        PyErr_Clear();
        raise_type(std::string(what) + " " + std::to_string(i) + " is not an array");
    }
    a.has_view = true;
}

static void check_size(const Arg & a, const ggml_tensor * t, const char * what, size_t i) {
    if (a.size() != ggml_nbytes(t)) {
        raise_value(std::string(what) + " " + std::to_string(i) + ": expected " + std::to_string(ggml_nbytes(t)) +
                    " bytes, got " + std::to_string(a.size()));
    }
}

static ggml_backend_buffer_t scratch(Graph & g, Slot & s) {
    if (!s.scratch) {
        s.scratch = ggml_backend_buft_alloc_buffer(ggml_backend_dev_buffer_type(g.be->dev), ggml_nbytes(s.t));
        if (!s.scratch) throw LlamaError("could not allocate a buffer on the device");
    }
    return s.scratch;
}

static bool in_place(const Graph & g, const Arg & a) {
    return a.dev || (g.be->host && ((uintptr_t) a.ptr() % 16) == 0);
}

// host or device memory of `a` <- tensor t (after compute). `async`: a GPU/RPC backend whose queue
// the copy joins (ggml_backend_tensor_get_async); the caller synchronizes it before reading `a`.
static void copy_out(const ggml_tensor * t, Arg & a, ggml_backend_t async) {
    if (!t->buffer) {  // a view of an input bound to host memory (CPU backend: all memory is host memory)
        std::memcpy(a.ptr(), t->data, a.size());
    } else if (a.dev) {  // device to device: after the queued work (the copy runs on its own stream)
        if (async) ggml_backend_synchronize(async);
        copy_bytes(a.dev->data, a.dev->buffer(), t->data, t->buffer, a.size());
    } else if (async) {
        ggml_backend_tensor_get_async(async, t, a.ptr(), 0, a.size());
    } else {
        ggml_backend_tensor_get(t, a.ptr(), 0, a.size());
    }
}

static void copy_in(ggml_tensor * t, const Arg & a, ggml_backend_t async) {
    if (!t->buffer && !t->data) return;  // an input no op uses
    if (a.dev) {                         // finished when it returns: the compute queued after it sees the bytes
        copy_bytes(t->data, t->buffer, a.dev->data, a.dev->buffer(), a.size());
    } else if (async) {
        ggml_backend_tensor_set_async(async, t, a.ptr(), 0, a.size());
    } else {
        ggml_backend_tensor_set(t, a.ptr(), 0, a.size());
    }
}

static void graph_run(Graph & g, nb::sequence inputs, nb::sequence outputs, nb::sequence grads, int n_threads) {
    if (!g.built) raise_value("build() the graph first");
    const size_t ni = nb::len(inputs), no = nb::len(outputs), ng = nb::len(grads);
    if (ni != g.ins.size() || no != g.outs.size() || (ng && ng != g.params.size())) {
        raise_value("run() takes " + std::to_string(g.ins.size()) + " inputs and " + std::to_string(g.outs.size()) +
                    " outputs; got " + std::to_string(ni) + " and " + std::to_string(no));
    }
    if (ng && !g.gb) raise_value("this graph has no backward pass");
    CallArgs in(ni), out(no), gr(ng);
    for (size_t i = 0; i < ni; ++i) {
        take_arg(in[i], inputs[i], g, false, "input", i);
        check_size(in[i], g.ins[i].t, "input", i);
    }
    for (size_t i = 0; i < no; ++i) {
        take_arg(out[i], outputs[i], g, true, "output", i);
        check_size(out[i], g.outs[i].t, "output", i);
    }
    for (size_t i = 0; i < ng; ++i) {
        take_arg(gr[i], grads[i], g, true, "gradient", i);
        check_size(gr[i], g.params[i], "gradient", i);
    }
    ggml_status st;
    {
        nb::gil_scoped_release release;
        std::lock_guard<std::mutex> lock_graph(g.run_mutex);
        std::lock_guard<std::mutex> lock(g.be->mutex);
        // GPU/RPC: copies in, the graph and copies out are queued and synchronized once at the end
        // (three to four synchronizations per call before); the caller's arrays outlive the call
        ggml_backend_t async = g.be->host ? nullptr : g.be->backend;
        size_t copied = 0;
        for (size_t i = 0; i < ni; ++i) {
            Slot & s = g.ins[i];
            if (in[i].made_contiguous) copied += in[i].size();
            if (s.external && in_place(g, in[i])) {
                bind(s, in[i].ptr(), in[i].dev ? in[i].dev->buffer() : nullptr);
                continue;
            }
            if (s.external) {
                ggml_backend_buffer_t b = scratch(g, s);
                bind(s, ggml_backend_buffer_get_base(b), b);
            }
            copy_in(s.t, in[i], async);
            copied += in[i].size();
        }
        for (size_t i = 0; i < no; ++i) {
            Slot & s = g.outs[i];
            if (!s.external) continue;
            if (in_place(g, out[i])) {
                bind(s, out[i].ptr(), out[i].dev ? out[i].dev->buffer() : nullptr);
            } else {
                ggml_backend_buffer_t b = scratch(g, s);
                bind(s, ggml_backend_buffer_get_base(b), b);
            }
        }
        if (g.be->set_n_threads) {
            g.be->set_n_threads(g.be->backend, std::min(n_threads > 0 ? n_threads : g.n_threads, g.be->max_threads));
        }
        if (g.gb) ggml_graph_reset(g.gb);  // loss grad = 1, other grads = 0
        st = ggml_backend_graph_compute_async(g.be->backend, g.gb ? g.gb : g.gf);
        if (st == GGML_STATUS_SUCCESS) {
            for (size_t i = 0; i < no; ++i) {
                if (g.outs[i].external && in_place(g, out[i])) continue;
                copy_out(g.outs[i].t, out[i], async);
                copied += out[i].size();
            }
            for (size_t i = 0; i < ng; ++i) {
                auto it = g.grad_out.find(g.params[i]);
                if (it == g.grad_out.end()) {  // the loss does not depend on this input
                    std::memset(gr[i].ptr(), 0, gr[i].size());
                } else {
                    copy_out(it->second, gr[i], async);
                }
            }
        }
        ggml_backend_synchronize(g.be->backend);
        g.bytes_copied = copied;
        for (auto * v : { &g.ins, &g.outs }) {  // no pointer into the caller's memory stays behind
            for (Slot & s : *v) {
                if (s.external) bind(s, placeholder(g), nullptr);
            }
        }
    }
    if (st != GGML_STATUS_SUCCESS)
        throw LlamaError(std::string("ggml_backend_graph_compute failed: ") + ggml_status_to_string(st));
}

// ---- DeviceBuffer

static constexpr size_t POOL_MAX_BYTES = size_t(512) << 20;  // per device

ggml_backend_buffer_t SharedBackend::take(size_t size) {
    {
        std::lock_guard<std::mutex> lock(pool_mutex);
        auto it = pool.find(size);
        if (it != pool.end()) {
            ggml_backend_buffer_t b = it->second;
            pool.erase(it);
            pool_bytes -= size;
            return b;
        }
    }
    ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(dev);
    ggml_backend_buffer_t b = ggml_backend_buft_alloc_buffer(buft, std::max<size_t>(size, 1));
    if (!b && pool_bytes) {  // out of memory: what the pool holds first
        drain();
        b = ggml_backend_buft_alloc_buffer(buft, std::max<size_t>(size, 1));
    }
    return b;
}

void SharedBackend::give(ggml_backend_buffer_t buf, size_t size) {
    {
        std::lock_guard<std::mutex> lock(pool_mutex);
        if (pool_bytes + size <= POOL_MAX_BYTES) {
            pool.emplace(size, buf);
            pool_bytes += size;
            return;
        }
    }
    ggml_backend_buffer_free(buf);
}

void SharedBackend::drain() {
    std::lock_guard<std::mutex> lock(pool_mutex);
    for (auto & [size, b] : pool) ggml_backend_buffer_free(b);
    pool.clear();
    pool_bytes = 0;
}

static void device_buffer_init(DeviceBuffer * self, const std::string & device, size_t nbytes) {
    new (self) DeviceBuffer();
    self->be = &shared_backend(device);
    self->buf = self->be->take(nbytes);
    if (!self->buf) throw LlamaError("could not allocate " + std::to_string(nbytes) + " bytes on " + device);
    self->data = ggml_backend_buffer_get_base(self->buf);
    self->size = nbytes;
}

using HostBytes = nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

static void device_buffer_upload(DeviceBuffer & b,
                                 nb::ndarray<nb::ro, uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> src) {
    if (src.size() != b.size)
        raise_value("upload: expected " + std::to_string(b.size) + " bytes, got " + std::to_string(src.size()));
    ggml_tensor t = raw_tensor(b.data, b.size, b.buffer());
    nb::gil_scoped_release release;
    if (b.size) ggml_backend_tensor_set(&t, src.data(), 0, b.size);
}

static void device_buffer_download(DeviceBuffer & b, HostBytes dst) {
    if (dst.size() != b.size)
        raise_value("download: expected " + std::to_string(b.size) + " bytes, got " + std::to_string(dst.size()));
    ggml_tensor t = raw_tensor(b.data, b.size, b.buffer());
    nb::gil_scoped_release release;
    if (b.size) ggml_backend_tensor_get(&t, dst.data(), 0, b.size);
}

std::pair<int, int> dlpack_device(ggml_backend_dev_t dev) {
    if (ggml_backend_buft_is_host(ggml_backend_dev_buffer_type(dev))) return { nb::device::cpu::value, 0 };
    const std::string reg = ggml_backend_reg_name(ggml_backend_dev_backend_reg(dev));
    const std::string name = ggml_backend_dev_name(dev);
    if (reg == "CUDA" && name.size() > 4) return { nb::device::cuda::value, std::stoi(name.substr(4)) };
    return { 0, 0 };
}

static nb::object device_buffer_dlpack(nb::handle self, std::vector<size_t> shape, int code, int bits) {
    DeviceBuffer & b = nb::cast<DeviceBuffer &>(self);
    auto [type, id] = dlpack_device(b.be->dev);
    if (!type) {
        raise_type(std::string("DLPack has no device type for ") + ggml_backend_dev_name(b.be->dev) +
                   " (CPU and CUDA arrays only): use .numpy()");
    }
    size_t n = (size_t) bits / 8;
    for (size_t d : shape) n *= d;
    if (n != b.size) raise_value("dlpack: the shape and dtype do not match the buffer's size");
    nb::dlpack::dtype dt{ (uint8_t) code, (uint8_t) bits, 1 };
    nb::ndarray<nb::array_api> arr(b.data, shape.size(), shape.data(), self, nullptr, dt, type, id);
    return nb::cast(arr);
}

// Memory of another library's array (DLPack, any framework) on a CPU or CUDA device, without a copy.
static nb::tuple device_buffer_from_dlpack(nb::ndarray<nb::c_contig> arr) {
    std::string device;
    if (arr.device_type() == nb::device::cpu::value) {
        device = "CPU";
    } else if (arr.device_type() == nb::device::cuda::value) {
        device = "CUDA" + std::to_string(arr.device_id());
        // the producer's kernels may still run on its stream; ggml's streams do not wait for them
        using sync_t = int (*)();
        static auto sync = (sync_t) dlsym(RTLD_DEFAULT, "cudaDeviceSynchronize");
        if (sync) sync();
    } else {
        raise_type("from_dlpack: only CPU and CUDA arrays can be imported (DLPack device type " +
                   std::to_string(arr.device_type()) + ")");
    }
    auto * b = new DeviceBuffer();
    nb::object owner = nb::cast(b, nb::rv_policy::take_ownership);
    b->be = &shared_backend(device);
    b->data = arr.data();
    b->size = arr.nbytes();
    b->keep = nb::cast(arr);
    std::vector<size_t> shape(arr.ndim());
    for (size_t i = 0; i < arr.ndim(); ++i) shape[i] = arr.shape(i);
    return nb::make_tuple(owner, shape, (int) arr.dtype().code, (int) arr.dtype().bits);
}

void register_graph_run(nb::module_ & m, nb::class_<Graph> & cls) {
    cls.def("run", &graph_run, nb::arg("inputs"), nb::arg("outputs"), nb::arg("grads") = nb::tuple(),
            nb::arg("n_threads") = 0,
            "Run the graph (GIL released; ggml_backend_graph_compute). inputs/outputs/grads: arrays "
            "(buffer protocol, outputs and grads writable) or DeviceBuffers, in build() order. CPU: "
            "n_threads (0 = all cores).");
    cls.def_prop_ro(
        "bytes_copied", [](const Graph & g) { return g.bytes_copied; },
        "Bytes the last run copied between the caller's arrays and the graph (0: all used in place).");
    nb::class_<DeviceBuffer>(m, "DeviceBuffer", "Bytes on a ggml backend device (llamabind.ops.DeviceArray's memory).")
        .def("__init__", &device_buffer_init, nb::arg("device"), nb::arg("nbytes"))
        .def("upload", &device_buffer_upload, nb::arg("data"), "Copy host bytes in (ggml_backend_tensor_set).")
        .def("download", &device_buffer_download, nb::arg("out"), "Copy the bytes out (ggml_backend_tensor_get).")
        .def("dlpack", &device_buffer_dlpack, nb::arg("shape"), nb::arg("code"), nb::arg("bits"),
             "An array object exporting the memory by DLPack (__dlpack__), numpy-order shape.")
        .def_static("from_dlpack", &device_buffer_from_dlpack, nb::arg("array").noconvert(),
                    "(DeviceBuffer, shape, DLPack dtype code, bits) of a DLPack array, sharing its memory.")
        .def_prop_ro("device", [](const DeviceBuffer & b) { return std::string(ggml_backend_dev_name(b.be->dev)); })
        .def_prop_ro("nbytes", [](const DeviceBuffer & b) { return b.size; })
        .def_prop_ro("owned", [](const DeviceBuffer & b) { return b.buf != nullptr; });
}

}  // namespace lb
