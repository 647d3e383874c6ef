// The native objects behind llamabind.Model, Context, LoraAdapter and ChatTemplates' results
// (model.cpp, context.cpp, lora.cpp, chat.cpp). Python owns them; closing is explicit (close(),
// context managers) or at garbage collection.
#pragma once

#include "common.h"

#include <chat.h>
#include <llama.h>

#include <atomic>
#include <map>
#include <memory>
#include <set>
#include <vector>

namespace lb {

struct Context;
struct Lora;
struct Sampler;
struct Projector;

struct Model {
    llama_model * model = nullptr;
    const llama_vocab * vocab = nullptr;
    std::string path;
    bool vocab_only = false;
    bool output_offloaded = false;     // the output layer (logits) is on a GPU/RPC device
    std::set<Context *> contexts;      // open contexts on this model; closed with it
    std::set<Lora *> loras;            // LoRA adapters loaded on it (llama.cpp frees them with the model)
    std::set<Projector *> projectors;  // multimodal projectors (mtmd.cpp), freed before the model
    std::atomic<int> in_use{ 0 };      // native calls running without the GIL (e.g. tokenize)

    ~Model() { release(); }
    void close();    // raises LlamaError if a context of this model is in use by another thread
    void release();  // frees contexts and weights; no checks (destructor)
    llama_model * get() const {
        if (!model) raise_value("the model is closed");
        return model;
    }
    const llama_vocab * get_vocab() const {
        get();
        return vocab;
    }
    int32_t n_vocab() const { return llama_vocab_n_tokens(get_vocab()); }
    void check_token(int64_t token, const char * what = "token") const {
        const int32_t n = n_vocab();
        if (token < 0 || token >= n) {
            raise_value(std::string(what) + " id " + std::to_string(token) +
                        " is out of range: expected 0 <= id < n_vocab (" + std::to_string(n) + ")");
        }
    }
};

// llama_batch storage reused across decode calls (llama_batch_init would allocate per token).
struct BatchBuf {
    std::vector<llama_token> token;
    std::vector<llama_pos> pos;
    std::vector<int32_t> n_seq_id;
    std::vector<llama_seq_id> seq;
    std::vector<llama_seq_id *> seq_id;
    std::vector<int8_t> logits;
};

struct Context {
    Model * owner = nullptr;
    llama_context * ctx = nullptr;
    ggml_threadpool * threadpool = nullptr;  // ours, attached to ctx (as llama-bench and common do)
    std::atomic<bool> busy{ false };
    bool has_logits = false;    // the last decode produced logits
    int32_t n_batch_last = 0;   // tokens in the last llama_decode (valid sample() positions)
    int views = 0;              // live zero-copy logits arrays (eval(copy=False)) into llama.cpp's buffer
    bool encoder_only = false;  // e.g. BERT: llama_encode, no KV cache
    std::vector<std::pair<Lora *, float>> loras;  // adapters applied (set_loras)
    std::shared_ptr<struct TrainState> train;     // llama_opt_* state once opt_init ran (train.cpp)
    bool packed = false;  // a training context of one window of packed documents (llama_opt_set_segments)
    std::shared_ptr<struct OpProfile> profile;           // per-node times of a training_profile context (train.cpp)
    std::map<llama_seq_id, Sampler *> backend_samplers;  // the chains llama_set_sampler attached, by sequence
    BatchBuf batch;
    // Media whose tokens outnumber their positions, per sequence in position order: an M-RoPE image
    // puts n_tokens embeddings (a grid) on n_pos positions, every KV cell at position p0, so neither
    // the next position nor the cells held follow from llama_memory_seq_pos_max (llama-server's
    // server_tokens::pos_next keeps the same record). Kept by mtmd.cpp's eval_media and context.cpp.
    struct MediaSpan {
        llama_pos p0, n_pos;
        int32_t n_tokens;
    };
    std::map<llama_seq_id, std::vector<MediaSpan>> media;

    ~Context() { release(); }
    void close();    // raises LlamaError while another thread is inside decode/sample on it
    void release();  // frees the llama_context; no checks (destructor)
    void check_no_views(const char * what) const;  // LlamaError while eval(copy=False) views live
    llama_context * get() const {
        if (!ctx) raise_value("the context is closed");
        return ctx;
    }
};

struct Lora {
    Model * owner = nullptr;
    llama_adapter_lora * adapter = nullptr;
    std::string path;
    ~Lora();       // forgets itself; the adapter is freed with the model (or by close())
    void close();  // frees the adapter (LlamaError while a context applies it)
};

// context.cpp: token ids as llama_token, each checked against the model's n_vocab (ValueError)
std::vector<llama_token> checked_tokens(const Context & self, const std::vector<int64_t> & tokens);

// memory.cpp: the next position of a sequence, and the KV cells it holds (they differ after
// M-RoPE media); forget_media drops the media record of positions [p0, p1) (-1: open end; seq -1: all)
llama_pos next_pos(Context & self, llama_seq_id seq);
void check_seq(llama_context * c, int64_t seq);  // ValueError outside [0, n_seq_max)
int64_t n_cells(Context & self, llama_seq_id seq);
void forget_media(Context & self, llama_seq_id seq, llama_pos p0, llama_pos p1);

// mtmd.cpp: free the model's projectors (before the model: libmtmd holds its vocab)
void free_projectors(Model & m);

// state.cpp: state_get/state_set/state_save_file/state_load_file on _core.Context
void add_state_methods(nb::class_<Context> & cls);
// memory.cpp: pos, n_cells, clear, seq_rm/add/cp/keep and the M-RoPE media record on Context
void add_memory_methods(nb::class_<Context> & cls);

// sampling.cpp: forget the sampler attached to this context (when the context is freed)
void forget_backend_sampler(Context & c);

// train.cpp: what llama_opt_* needs of a context (F32 KV cache, no flash attention, n_ctx ==
// n_batch == n_ubatch, a multiple of 256); raises ValueError otherwise
void training_context_params(llama_context_params & p, Context & c, bool profile, bool packed);

// lora.cpp: [(adapter, scale)] applied to a context (llama_set_adapters_lora)
void set_loras(Context & self, const std::vector<std::pair<Lora *, double>> & loras);

// The result of applying a chat template (common_chat_templates_apply): prompt, grammar, parser.
struct ChatParams {
    common_chat_params p;
    bool from_schema = false;  // the grammar came from a JSON schema (output format), not tools
};

// Held while native code uses a model without the GIL: close() then raises instead of freeing it.
struct ModelUse {
    Model & m;
    explicit ModelUse(Model & m_) : m(m_) { m.in_use.fetch_add(1); }
    ~ModelUse() { m.in_use.fetch_sub(1); }
};

// Held while native code works on a context: a second thread gets an exception, not a race.
struct BusyGuard {
    Context & c;
    explicit BusyGuard(Context & c_) : c(c_) {
        bool expected = false;
        if (!c.busy.compare_exchange_strong(expected, true)) {
            throw LlamaError("the context is in use by another thread; create one context per thread");
        }
    }
    ~BusyGuard() { c.busy.store(false); }
};

}  // namespace lb
