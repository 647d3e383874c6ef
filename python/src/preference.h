// Losses built by the caller in llama.cpp's training graph through llama_opt_params.build_loss (patch 0054):
// preference losses (issue 58), DPO's and ORPO's loss over a micro-batch of windows that alternate a pair's
// chosen and rejected answer, and GRPO's (issue 85): the sum over labelled positions of a coefficient times the
// position's log-probability (grpo.py computes the coefficients, the derivative of TRL's per-token loss).
// train.cpp owns one per training context made with such a loss.
#pragma once

#include <ggml.h>

#include <cstdint>
#include <string>
#include <vector>

namespace lb {

struct PrefLoss {
    enum Method { DPO, ORPO, GRPO } method = DPO;
    float beta = 0.1f;                // DPO's beta; ORPO's lambda; GRPO: the sampling temperature (log softmax(z / T))
    std::vector<float> coef;          // GRPO, per labelled position of the next eval (window-major): its coefficient
    std::vector<int32_t> target;      // GRPO, per labelled position of the next eval: its label
    ggml_tensor * coef_in = nullptr;  // GRPO: the built loss's inputs, coefficients and flat indices of the targets
    ggml_tensor * idx_in = nullptr;
    ggml_tensor * token_lp = nullptr;  // GRPO: the labelled positions' log-probabilities, [1, rows]
    int64_t n_vocab = 0;               // GRPO: the logits rows' width (a target's flat index must fit int32)
    std::vector<float> ref;       // DPO, per pair of the next eval: reference log-ratio log pi_ref(c) - log pi_ref(r)
    std::vector<int32_t> prompt;  // ORPO, per pair of the next eval: labelled prompt positions before the chosen answer
    std::vector<ggml_tensor *> ce;         // per sequence of the eval being built/run: its answer's mean cross-entropy
    std::vector<ggml_tensor *> ce_prompt;  // per sequence: its labelled prompt positions' mean cross-entropy, or null
    std::vector<int32_t> rows;             // per sequence: its answer's labelled positions
    std::vector<int32_t> rows_prompt;      // per sequence: its labelled prompt positions (before the answer's)
    std::vector<double> logps;             // per sequence of the last eval: summed log-likelihood of its answer (nats);
                                           // GRPO: per labelled position, its log-probability
    std::vector<double> logps_prompt;      // per sequence of the last eval: that of its labelled prompt positions
    ggml_tensor * ref_in = nullptr;        // DPO: the built loss's input of the pairs' reference log-ratios
    std::vector<int32_t> built_rows;       // the seq_rows and prompt rows the loss was built for
    std::vector<int32_t> built_prompt;
};

// llama_opt_params.build_loss with userdata a PrefLoss: the loss of the ubatch's sequences as pairs
ggml_tensor * pref_build_loss(ggml_context * ctx, ggml_tensor * logits, ggml_tensor * labels, const int32_t * seq_rows,
                              int32_t n_seq, void * userdata);

// llama_opt_params.reuse_loss: the loss built last serves these rows (the same rows and ORPO prompt rows)
bool pref_reuse_loss(const int32_t * seq_rows, int32_t n_seq, void * userdata);

// llama_opt_params.set_loss_inputs: the next eval's reference log-ratios into the loss's input
void pref_set_inputs(void * userdata);

// opt_step's checks of a step's preference inputs (labels (n_rows, n_win) row-major; refs n_refs float64, DPO;
// prompt_rows n_prompt int32, ORPO; docs: a packed step's document of each position, else empty), setting pref.ref
// and pref.prompt for the loss; ValueError (raise_value) naming what is wrong
void pref_check_step(PrefLoss & pref, const int32_t * labels, int64_t n_rows, int64_t n_win, const double * refs,
                     int64_t n_refs, const int32_t * prompt_rows, int64_t n_prompt, const std::vector<int32_t> & docs);

// after an eval: the per-sequence log-likelihoods into PrefLoss::logps (the graph's tensors still allocated)
void pref_read(PrefLoss & p);

}  // namespace lb
