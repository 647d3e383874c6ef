// The logits of a prompt's last token, for comparing a model on MTL0 with the CPU (issue 57; tests only):
//   lb-logits MODEL N_GPU_LAYERS PROMPT > logits.bin   (n_vocab float32, little-endian, on stdout)
#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

int main(int argc, char ** argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s MODEL N_GPU_LAYERS PROMPT\n", argv[0]);
        return 2;
    }
    ggml_backend_load_all();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = atoi(argv[2]);
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) return 1;
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const char * prompt = argv[3];
    const int n = -llama_tokenize(vocab, prompt, (int) strlen(prompt), nullptr, 0, true, true);
    std::vector<llama_token> toks(n);
    llama_tokenize(vocab, prompt, (int) strlen(prompt), toks.data(), n, true, true);
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 512;
    cp.n_batch = 512;
    cp.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx || llama_decode(ctx, llama_batch_get_one(toks.data(), n)) != 0) return 1;
    const float * logits = llama_get_logits_ith(ctx, -1);
    fwrite(logits, sizeof(float), llama_vocab_n_tokens(vocab), stdout);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
