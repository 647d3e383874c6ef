// The serving core: upstream's tools/server `server_context` (slots sharing one llama_context and KV
// cache, continuous batching, prompt-prefix reuse, the OpenAI layer) and `server_routes` (its HTTP
// handlers), built from the same patched tree and driven from Python. llamabind.serve puts an ASGI
// server in front (HTTP parsing, API keys, body limits, SSE framing) and hands each request's method,
// path and body to ServerCore.request (run by ServerResponse.run); streamed responses are pulled
// chunk by chunk with ServerResponse.next. The scheduler loop runs on its own thread
// (server_context::start_loop); handlers run on the ASGI server's worker threads with the GIL released.
#include "common.h"
#include "rpc.h"

#include <mtmd-helper.h>
#include <server-context.h>
#include <server-http.h>

#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <atomic>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <thread>

namespace lb {

namespace {

// tools/server/server.cpp's ex_wrapper, except for the status: a handler throws synchronously only
// while it parses and checks the request (tasks report their failures as results), and upstream's
// parsers throw std::runtime_error and the JSON library's errors for a missing field or a value of the
// wrong type, so what a handler throws is the client's (400) unless memory ran out (500)
server_http_res_ptr call_handler(const server_http_context::handler_t & h, const server_http_req & req) {
    std::string message;
    error_type type = ERROR_TYPE_INVALID_REQUEST;
    try {
        return h(req);
    } catch (const std::bad_alloc & e) {
        type = ERROR_TYPE_SERVER;
        message = e.what();
    } catch (const std::exception & e) {
        message = e.what();
    } catch (...) {
        type = ERROR_TYPE_SERVER;
        message = "unknown error";
    }
    auto res = std::make_unique<server_http_res>();
    try {
        json err = format_error_response(message, type);
        res->status = json_value(err, "code", 500);
        res->data = safe_json_to_str({ { "error", err } });
    } catch (...) {
        res->status = 500;
        res->data = R"({"error":{"code":500,"message":"internal error","type":"server_error"}})";
    }
    return res;
}

// One request and its response: server_http_req holds a reference to its should_stop callable, and
// a streamed response reads the request while it streams, so both live here until close().
struct Response {
    std::atomic<bool> stopped{ false };
    std::function<bool()> should_stop;
    std::unique_ptr<server_http_req> req;
    server_http_res_ptr res;
    std::atomic<bool> busy{ false };  // a next() in flight (on a worker thread)
    bool last = false;                // the stream's last chunk was returned

    server_http_context::handler_t * handler = nullptr;  // set by ServerCore.request, cleared by run()

    int status() const { return res ? res->status : 500; }

    // Run the route's handler: a non-streamed answer is complete when this returns (or close() was
    // called: llama.cpp polls should_stop once a second while it waits).
    void run() {
        if (!handler) raise_value("ServerResponse.run: already run");
        auto * h = handler;
        handler = nullptr;
        bool expected = false;
        if (!busy.compare_exchange_strong(expected, true)) raise_value("ServerResponse.run: busy");
        {
            nb::gil_scoped_release nogil;
            res = call_handler(*h, *req);
        }
        busy = false;
    }

    // Streams: the next chunk of the body (bytes; may be empty), or None after the last one.
    std::optional<nb::bytes> next() {
        if (!res) return std::nullopt;
        if (!res->is_stream() || last) {
            finish();
            return std::nullopt;
        }
        bool expected = false;
        if (!busy.compare_exchange_strong(expected, true))
            raise_value("ServerResponse.next: already running on another thread");
        std::string chunk;
        bool more = false;
        {
            nb::gil_scoped_release nogil;
            try {
                more = !stopped.load() && res->next(chunk);
            } catch (const std::exception &) {
                more = false;
            }
        }
        busy = false;
        if (!more && (chunk.empty() || stopped.load())) {
            finish();
            return std::nullopt;
        }
        last = !more;  // the last chunk: the next call returns None
        return nb::bytes(chunk.data(), chunk.size());
    }

    // The client went away (or the body was read): cancel the request's tasks, free its slot.
    void close() {
        stopped = true;
        if (busy.load()) return;  // the worker's next() sees `stopped` and returns; it finishes then
        finish();
    }

    // Claims `busy` before it lets the GIL go, so no next() can start on the response it frees.
    void finish() {
        bool expected = false;
        if (!res || !busy.compare_exchange_strong(expected, true)) return;
        {
            nb::gil_scoped_release nogil;  // ~server_response_reader posts the cancel task (takes locks)
            res->on_complete();
            res.reset();
            req.reset();
        }
        busy = false;
    }

    ~Response() {
        stopped = true;
        if (res) {
            res->on_complete();
            res.reset();
        }
    }
};

// The HTTP handlers upstream's llama-server registers (tools/server/server.cpp), by method and path.
using Handler = server_http_context::handler_t;

struct ServerCore {
    common_params params;
    server_context ctx;
    std::unique_ptr<server_routes> routes;
    std::map<std::string, Handler *> handlers;  // "POST /v1/chat/completions" -> handler
    std::thread loop;
    bool loaded = false;
    std::atomic<bool> stopped{ false };

    explicit ServerCore(const nb::dict & options) {
        // server_context's constructor sent libmtmd's logs to common's logger (silent here): to Python logging
        mtmd_helper_log_set(log_to_python, nullptr);
        set_params(options);
        routes = std::make_unique<server_routes>(params, ctx);
        auto & r = *routes;
        const std::pair<const char *, Handler *> table[] = {
            { "GET /health", &r.get_health },
            { "GET /v1/health", &r.get_health },
            { "GET /metrics", &r.get_metrics },
            { "GET /props", &r.get_props },
            { "GET /models", &r.get_models },
            { "GET /v1/models", &r.get_models },
            { "GET /slots", &r.get_slots },
            { "POST /completion", &r.post_completions },
            { "POST /completions", &r.post_completions },
            { "POST /v1/completions", &r.post_completions_oai },
            { "POST /chat/completions", &r.post_chat_completions },
            { "POST /v1/chat/completions", &r.post_chat_completions },
            { "POST /v1/responses", &r.post_responses_oai },
            { "POST /v1/messages", &r.post_anthropic_messages },
            { "POST /v1/messages/count_tokens", &r.post_anthropic_count_tokens },
            { "POST /infill", &r.post_infill },
            { "POST /embedding", &r.post_embeddings },
            { "POST /embeddings", &r.post_embeddings },
            { "POST /v1/embeddings", &r.post_embeddings_oai },
            { "POST /rerank", &r.post_rerank },
            { "POST /v1/rerank", &r.post_rerank },
            { "POST /tokenize", &r.post_tokenize },
            { "POST /detokenize", &r.post_detokenize },
            { "POST /apply-template", &r.post_apply_template },
            { "POST /v1/chat/completions/input_tokens", &r.post_chat_completions_tok },
            { "GET /lora-adapters", &r.get_lora_adapters },
            { "POST /lora-adapters", &r.post_lora_adapters },
        };
        for (const auto & [key, h] : table) handlers[key] = h;
    }

    void set_params(const nb::dict & o) {
        auto has = [&](const char * k) {
            return o.contains(k) && !o[k].is_none();
        };
        auto i32 = [&](const char * k, int32_t & dst) {
            if (has(k)) dst = nb::cast<int32_t>(o[k]);
        };
        if (!has("model")) raise_value("ServerCore: options need 'model' (a GGUF path)");
        params.model.path = nb::cast<std::string>(o["model"]);
        i32("n_ctx", params.n_ctx);
        i32("n_batch", params.n_batch);
        i32("n_ubatch", params.n_ubatch);
        i32("n_parallel", params.n_parallel);
        i32("n_gpu_layers", params.n_gpu_layers);
        if (has("op_offload")) params.no_op_offload = !nb::cast<bool>(o["op_offload"]);
        if (has("pooling")) params.pooling_type = (enum llama_pooling_type) nb::cast<int>(o["pooling"]);
        if (has("kv_unified")) params.kv_unified = nb::cast<bool>(o["kv_unified"]);
        if (has("type_k")) params.cache_type_k = (ggml_type) nb::cast<int>(o["type_k"]);  // checked in Python
        if (has("type_v")) params.cache_type_v = (ggml_type) nb::cast<int>(o["type_v"]);
        if (has("embedding")) params.embedding = nb::cast<bool>(o["embedding"]);
        if (has("chat_template")) params.chat_template = nb::cast<std::string>(o["chat_template"]);
        if (has("alias")) params.model_alias = { nb::cast<std::string>(o["alias"]) };
        if (has("mmproj")) params.mmproj.path = nb::cast<std::string>(o["mmproj"]);
        if (has("mmproj_use_gpu")) params.mmproj_use_gpu = nb::cast<bool>(o["mmproj_use_gpu"]);
        i32("image_min_tokens", params.image_min_tokens);
        i32("image_max_tokens", params.image_max_tokens);
        if (has("media_path")) params.media_path = nb::cast<std::string>(o["media_path"]);
        if (has("context_shift")) params.ctx_shift = nb::cast<bool>(o["context_shift"]);
        if (has("model_draft")) {  // llama-server's -md with --spec-type draft-simple
            params.speculative.draft.mparams.path = nb::cast<std::string>(o["model_draft"]);
            params.speculative.types = { COMMON_SPECULATIVE_TYPE_DRAFT_SIMPLE };
            i32("draft_max", params.speculative.draft.n_max);
            i32("draft_min", params.speculative.draft.n_min);
            i32("n_gpu_layers_draft", params.speculative.draft.n_gpu_layers);
        }
        if (has("seed")) params.sampling.seed = nb::cast<uint32_t>(o["seed"]);
        if (has("flash_attn")) {
            const auto v = nb::cast<std::string>(o["flash_attn"]);
            params.flash_attn_type =
                v == "on"   ? LLAMA_FLASH_ATTN_TYPE_ENABLED :
                v == "off"  ? LLAMA_FLASH_ATTN_TYPE_DISABLED :
                v == "auto" ? LLAMA_FLASH_ATTN_TYPE_AUTO :
                              (raise_value("flash_attn must be 'on', 'off' or 'auto'"), LLAMA_FLASH_ATTN_TYPE_AUTO);
        }
        if (has("lora")) {
            for (auto item : nb::cast<nb::list>(o["lora"])) {
                common_adapter_lora_info info;
                info.path = nb::cast<std::string>(item[0]);
                info.scale = nb::cast<float>(item[1]);
                params.lora_adapters.push_back(info);
            }
        }
        // the local GPUs and the named RPC servers' devices, not those other models connected to (rpc.cpp)
        bool explicit_list = false;
        auto devices = offload_devices(
            has("rpc") ? nb::cast<std::vector<std::string>>(o["rpc"]) : std::vector<std::string>{}, explicit_list);
        if (explicit_list) {
            params.devices = devices;
            params.devices.push_back(nullptr);
        }
        // what common_params_parse does after parsing (arg.cpp): threads, llama_params_fit's padding
        const int32_t n_threads = has("n_threads") ? nb::cast<int32_t>(o["n_threads"]) : common_cpu_get_num_math();
        params.cpuparams.n_threads = n_threads;
        params.cpuparams_batch.n_threads = n_threads;
        params.speculative.draft.cpuparams.n_threads = n_threads;  // arg.cpp's postprocess_cpu_params
        params.speculative.draft.cpuparams_batch.n_threads = n_threads;
        while (params.tensor_buft_overrides.size() < llama_max_tensor_buft_overrides()) {
            params.tensor_buft_overrides.push_back({ nullptr, nullptr });
        }
        params.endpoint_metrics = true;
        params.endpoint_slots = true;
        params.fit_params = !has("n_ctx") || params.n_ctx == 0;  // llama-server fits only what is unset
        if (params.n_parallel < 1) raise_value("n_parallel must be >= 1");
        // embeddings need each prompt in one ubatch (llama-server does the same, server.cpp)
        if (params.embedding && params.n_batch > params.n_ubatch) params.n_batch = params.n_ubatch;
    }

    // The model is loaded on the scheduler's own thread, which then runs the loop: llama-server does
    // both on one thread, and ggml's CPU threads (an OpenMP team per calling thread) then serve one
    // thread only (loaded on the caller and decoded on another: 29 ms per token against 4.4, SmolLM2 here)
    void load() {
        if (loaded) raise_value("ServerCore.load: already loaded");
        std::promise<std::pair<bool, std::string>> started;
        auto result = started.get_future();
        std::pair<bool, std::string> outcome;
        {
            nb::gil_scoped_release nogil;
            loop = std::thread([this, &started] {
                clear_recent_errors();
                const bool ok = ctx.load_model(params);
                started.set_value({ ok, ok ? std::string() : take_recent_errors() });
                if (ok) ctx.start_loop();
            });
            outcome = result.get();
            if (!outcome.first) loop.join();
        }
        if (!outcome.first) {
            throw LlamaError("the server could not load the model " + params.model.path +
                             (outcome.second.empty() ? std::string() : ": " + outcome.second));
        }
        routes->update_meta(ctx);
        loaded = true;
    }

    // The request, not yet run (Response.run): Python can close() it from another thread meanwhile.
    std::unique_ptr<Response> request(const std::string & method, const std::string & path, nb::bytes body,
                                      const std::map<std::string, std::string> & query) {
        auto it = handlers.find(method + " " + path);
        if (it == handlers.end()) raise_value("no route " + method + " " + path);
        if (!loaded) raise_value("ServerCore.request: the model is not loaded");
        if (stopped) raise_value("ServerCore.request: the server is stopped");
        auto r = std::make_unique<Response>();
        Response * rp = r.get();
        r->handler = it->second;
        r->should_stop = [rp] {
            return rp->stopped.load();
        };
        std::string qs;
        for (const auto & [k, v] : query) qs += (qs.empty() ? "" : "&") + k + "=" + v;
        r->req = std::make_unique<server_http_req>(
            server_http_req{ query, {}, path, qs, std::string(body.c_str(), body.size()), {}, r->should_stop });
        return r;
    }

    void stop() {
        stopped = true;
        if (loop.joinable()) {
            nb::gil_scoped_release nogil;
            ctx.terminate();
            loop.join();
        }
    }

    ~ServerCore() {
        if (loop.joinable()) {
            ctx.terminate();
            loop.join();
        }
    }
};

}  // namespace

void register_server(nb::module_ & m) {
    nb::class_<Response>(m, "ServerResponse",
                         "One HTTP response of the serving core: status, content_type, headers and body, or a "
                         "stream of body chunks (next()). close() cancels an unfinished request (frees its slot).")
        .def_prop_ro("status", &Response::status, "HTTP status code (int).")
        .def_prop_ro("content_type", [](const Response & r) { return r.res ? r.res->content_type : std::string(); })
        .def_prop_ro("headers",
                     [](const Response & r) { return r.res ? r.res->headers : std::map<std::string, std::string>{}; })
        .def_prop_ro("is_stream", [](const Response & r) { return r.res && r.res->is_stream(); })
        .def_prop_ro(
            "body",
            [](const Response & r) {
                const std::string & d = r.res ? r.res->data : std::string();
                return nb::bytes(d.data(), d.size());
            },
            "The whole body (bytes) of a response that is not a stream.")
        .def("run", &Response::run,
             "Run the request (the route's handler; GIL released). A non-streamed response is complete when it "
             "returns; a streamed one has its status and headers, and next() gives its body.")
        .def("next", &Response::next,
             "The next chunk (bytes, SSE-framed by llama.cpp) of a streamed body, or None after the last. Blocks "
             "(GIL released) until the scheduler produces it; returns None once close() was called.")
        .def("close", &Response::close, "Cancel the request if unfinished (its slot is freed at the next step).");

    nb::class_<ServerCore>(
        m, "ServerCore",
        "llama.cpp's tools/server core (server_context + server_routes) over one model: n_parallel slots in "
        "one llama_context, continuous batching. options: a dict of common_params fields (model, n_ctx, "
        "n_batch, n_ubatch, n_parallel, n_gpu_layers, n_threads, embedding, kv_unified, chat_template, alias, "
        "seed, flash_attn, lora, pooling, op_offload, rpc).")
        .def(nb::init<const nb::dict &>(), nb::arg("options"))
        .def("load", &ServerCore::load,
             "Load the model (server_context::load_model) and start the scheduler thread. Raises LlamaError.")
        .def("request", &ServerCore::request, nb::arg("method"), nb::arg("path"), nb::arg("body"),
             nb::arg("query") = std::map<std::string, std::string>{},
             nb::keep_alive<0, 1>(),  // a response reads the server's queues: it keeps the server alive
             "A ServerResponse for the handler llama-server has for METHOD PATH and the request body (bytes); "
             "run() runs it. Raises ValueError for an unknown route.")
        .def("stop", &ServerCore::stop,
             "Stop the scheduler thread (server_context::terminate); later requests raise ValueError. Close the "
             "responses in flight first: a handler waiting on a stopped scheduler returns only once closed.")
        .def_prop_ro("routes",
                     [](const ServerCore & s) {
                         std::vector<std::string> out;
                         for (const auto & [k, _] : s.handlers) out.push_back(k);
                         return out;
                     })
        .def_prop_ro("n_parallel", [](const ServerCore & s) { return s.params.n_parallel; });
}

}  // namespace lb
