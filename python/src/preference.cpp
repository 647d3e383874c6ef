// DPO (Rafailov et al. 2023, the sigmoid loss) and ORPO (Hong et al. 2024) in the training graph.
//
// The windows of a micro-batch alternate chosen, rejected (window 2i: pair i's prompt and chosen answer,
// 2i + 1: the same prompt and the rejected one); only the answers' tokens are labelled (patch 0027), so
// each sequence's logits rows are its answer's; under ORPO with its nll over the chosen prompt and answer (TRL's
// ORPOTrainer), a chosen window's prompt positions are labelled too and come first in its rows. A sequence's
// summed log-likelihood is -n x the mean
// cross-entropy of its rows, ggml_cross_entropy_loss over a view of them (stable log-sum-exp, a backward
// on every backend that trains), and the pair losses are a few scalar ops on those. What changes between micro-batches
// of the same rows (DPO's reference log-ratios) is an input tensor, so that llama keeps the graphs while the rows
// repeat (pref_reuse_loss, pref_set_inputs).
#include "preference.h"

#include "common.h"

#include <ggml-backend.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <numeric>
#include <string>

namespace lb {

// the mean next-token cross-entropy of logits rows [r0, r0 + n) (-1/n x the rows' summed log-likelihood)
static ggml_tensor * rows_ce(ggml_context * ctx, ggml_tensor * logits, ggml_tensor * labels, int64_t r0, int64_t n) {
    ggml_tensor * z = ggml_view_2d(ctx, logits, logits->ne[0], n, logits->nb[1], r0 * logits->nb[1]);
    ggml_tensor * y = ggml_view_2d(ctx, labels, labels->ne[0], n, labels->nb[1], r0 * labels->nb[1]);
    return ggml_cross_entropy_loss(ctx, z, y);
}

static ggml_tensor * add(ggml_context * ctx, ggml_tensor * sum, ggml_tensor * x) {
    return sum ? ggml_add(ctx, sum, x) : x;
}

// log(1 - exp(-ce)) of a mean cross-entropy ce > 0: log(1 - p) of the mean token log-probability, ORPO's odds
static ggml_tensor * log1m_exp_neg(ggml_context * ctx, ggml_tensor * ce) {
    return ggml_log(ctx, ggml_scale(ctx, ggml_expm1(ctx, ggml_scale(ctx, ce, -1.0f)), -1.0f));
}

// GRPO (issue 85): sum_r coef_r x log softmax(z_r / T)[y_r] over the labelled rows r. The coefficients are the
// derivative of TRL's per-token loss at this step's log-probabilities (grpo.py), so that the graph's gradient is
// TRL's; the log-probabilities are an output (pref_read). softmax, then the target's probability picked from the
// flat [1, V x rows] view by ggml_get_rows (GET_ROWS_BACK in the backward pass), then its log: every backend that
// trains has these ops and their backward passes. A sampled token's probability is far above F32's underflow.
static ggml_tensor * grpo_build_loss(ggml_context * ctx, ggml_tensor * logits, PrefLoss & p) {
    const int64_t n_vocab = logits->ne[0], n = logits->ne[1];
    GGML_ASSERT(n == (int64_t) p.target.size() && n_vocab == p.n_vocab &&
                n_vocab * n < INT32_MAX);  // opt_step checked it
    ggml_tensor * z = p.beta == 1.0f ? logits : ggml_scale(ctx, logits, 1.0f / p.beta);
    ggml_tensor * probs = ggml_reshape_2d(ctx, ggml_soft_max(ctx, z), 1, n_vocab * n);
    p.idx_in = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n);
    ggml_set_name(p.idx_in, "grpo_targets");
    ggml_set_input(p.idx_in);
    p.coef_in = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 1, n);
    ggml_set_name(p.coef_in, "grpo_coef");
    ggml_set_input(p.coef_in);
    p.token_lp = ggml_log(ctx, ggml_get_rows(ctx, probs, p.idx_in));
    ggml_set_name(p.token_lp, "grpo_logp");
    ggml_set_output(p.token_lp);  // read back after the eval (pref_read)
    p.built_rows.assign(1, (int32_t) n);
    ggml_tensor * loss = ggml_sum(ctx, ggml_mul(ctx, p.token_lp, p.coef_in));
    ggml_set_name(loss, "loss_grpo");
    return loss;
}

ggml_tensor * pref_build_loss(ggml_context * ctx, ggml_tensor * logits, ggml_tensor * labels, const int32_t * seq_rows,
                              int32_t n_seq, void * userdata) {
    PrefLoss & p = *(PrefLoss *) userdata;
    if (p.method == PrefLoss::GRPO) return grpo_build_loss(ctx, logits, p);
    // opt_step checked these (an even number of windows, each with a labelled answer token, a ref per pair,
    // ORPO's labelled prompt positions fewer than the chosen window's labelled positions)
    GGML_ASSERT(n_seq > 0 && n_seq % 2 == 0);
    GGML_ASSERT(p.method != PrefLoss::DPO || (int32_t) p.ref.size() == n_seq / 2);
    GGML_ASSERT(p.prompt.empty() || (int32_t) p.prompt.size() == n_seq / 2);
    p.ce.clear();
    p.ce_prompt.clear();
    p.rows.clear();
    p.rows_prompt.clear();
    int64_t r0 = 0;
    for (int32_t s = 0; s < n_seq; ++s) {
        // a chosen window's labelled prompt positions come first (ORPO's nll over the prompt and the answer)
        const int32_t n_prompt = s % 2 == 0 && !p.prompt.empty() ? p.prompt[s / 2] : 0;
        GGML_ASSERT(seq_rows[s] > n_prompt && n_prompt >= 0);
        ggml_tensor * cp = nullptr;
        if (n_prompt > 0) {
            cp = rows_ce(ctx, logits, labels, r0, n_prompt);
            ggml_format_name(cp, "pref_ce_prompt_%d", s);
            ggml_set_output(cp);
        }
        ggml_tensor * ce = rows_ce(ctx, logits, labels, r0 + n_prompt, seq_rows[s] - n_prompt);
        ggml_format_name(ce, "pref_ce_%d", s);
        ggml_set_output(ce);  // read back after the eval (pref_read)
        p.ce.push_back(ce);
        p.ce_prompt.push_back(cp);
        p.rows.push_back(seq_rows[s] - n_prompt);
        p.rows_prompt.push_back(n_prompt);
        r0 += seq_rows[s];
    }
    GGML_ASSERT(r0 == logits->ne[1]);
    const int32_t n_pairs = n_seq / 2;
    p.built_rows.assign(seq_rows, seq_rows + n_seq);
    p.built_prompt = p.prompt;
    p.ref_in = nullptr;
    if (p.method == PrefLoss::DPO) {
        p.ref_in = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, n_pairs);
        ggml_set_name(p.ref_in, "pref_ref");
        ggml_set_input(p.ref_in);
    }
    const float b = p.beta;
    ggml_tensor * pairs = nullptr;  // the sum over pairs of the pair term
    ggml_tensor * nll = nullptr;    // ORPO: the chosen windows' labelled tokens' summed cross-entropy
    int64_t n_chosen = 0;
    for (int32_t i = 0; i < n_pairs; ++i) {
        ggml_tensor *cc = p.ce[2 * i], *cr = p.ce[2 * i + 1];
        const float nc = (float) p.rows[2 * i], nr = (float) p.rows[2 * i + 1];
        if (p.method == PrefLoss::DPO) {
            // z = beta ((log pi(c) - log pi(r)) - ref), log pi(c) = -nc cc; -log sigmoid(z) = softplus(-z)
            ggml_tensor * u = ggml_sub(ctx, ggml_scale(ctx, cr, b * nr), ggml_scale(ctx, cc, b * nc));
            ggml_tensor * ref = ggml_view_1d(ctx, p.ref_in, 1, i * sizeof(float));
            pairs = add(ctx, pairs, ggml_softplus(ctx, ggml_sub(ctx, ggml_scale(ctx, ref, b), u)));
        } else {
            // the mean token log-probs mc = -cc, mr = -cr; log odds ratio (mc - mr) - (log(1 - e^mc) - log(1 - e^mr))
            ggml_tensor * lor =
                ggml_add(ctx, ggml_sub(ctx, cr, cc), ggml_sub(ctx, log1m_exp_neg(ctx, cr), log1m_exp_neg(ctx, cc)));
            pairs = add(ctx, pairs, ggml_softplus(ctx, ggml_scale(ctx, lor, -1.0f)));  // -log sigmoid(lor)
            nll = add(ctx, nll, ggml_scale(ctx, cc, nc));
            if (ggml_tensor * cp = p.ce_prompt[2 * i])
                nll = ggml_add(ctx, nll, ggml_scale(ctx, cp, (float) p.rows_prompt[2 * i]));
            n_chosen += p.rows[2 * i] + p.rows_prompt[2 * i];
        }
    }
    // DPO: the mean over pairs; ORPO: the chosen tokens' mean nll + lambda x the mean pair term
    ggml_tensor * loss = ggml_scale(ctx, pairs, (p.method == PrefLoss::DPO ? 1.0f : b) / n_pairs);
    if (p.method == PrefLoss::ORPO) loss = ggml_add(ctx, loss, ggml_scale(ctx, nll, 1.0f / (float) n_chosen));
    ggml_set_name(loss, p.method == PrefLoss::DPO ? "loss_dpo" : "loss_orpo");
    return loss;
}

bool pref_reuse_loss(const int32_t * seq_rows, int32_t n_seq, void * userdata) {
    const PrefLoss & p = *(const PrefLoss *) userdata;
    if (p.method == PrefLoss::GRPO)  // its graph depends on the number of rows alone
        return p.built_rows.size() == 1 && p.built_rows[0] == std::accumulate(seq_rows, seq_rows + n_seq, 0);
    return p.built_rows.size() == (size_t) n_seq && std::equal(seq_rows, seq_rows + n_seq, p.built_rows.begin()) &&
           p.built_prompt == p.prompt;
}

void pref_set_inputs(void * userdata) {
    const PrefLoss & p = *(const PrefLoss *) userdata;
    if (p.method == PrefLoss::GRPO) {
        const int64_t n = (int64_t) p.target.size();
        GGML_ASSERT(ggml_nelements(p.idx_in) == n && p.coef.size() == (size_t) n);  // opt_step checked it
        std::vector<int32_t> idx(n);
        for (int64_t r = 0; r < n; ++r) idx[r] = (int32_t) (r * p.n_vocab + p.target[r]);
        ggml_backend_tensor_set(p.idx_in, idx.data(), 0, ggml_nbytes(p.idx_in));
        ggml_backend_tensor_set(p.coef_in, p.coef.data(), 0, ggml_nbytes(p.coef_in));
        return;
    }
    if (p.ref_in) {
        GGML_ASSERT(p.ref.size() == (size_t) ggml_nelements(p.ref_in));  // opt_step checked it
        ggml_backend_tensor_set(p.ref_in, p.ref.data(), 0, ggml_nbytes(p.ref_in));
    }
}

// GRPO's checks of a step: labels (the completions' tokens), a finite coefficient per labelled position
static void grpo_check_step(PrefLoss & p, const int32_t * labels, int64_t n, const double * coefs, int64_t n_coefs,
                            const int32_t * prompt_rows, const std::vector<int32_t> & docs) {
    if (!labels) raise_value("GRPO needs labels: each window's completion tokens, -1 elsewhere");
    if (prompt_rows) raise_value("prompt_rows are for ORPO's nll over the chosen prompt and answer");
    (void) docs;  // packed (a completion a document): the labelled positions in window order all the same
    p.target.clear();
    for (int64_t k = 0; k < n; ++k)
        if (labels[k] >= 0) p.target.push_back(labels[k]);
    const int64_t rows = (int64_t) p.target.size();
    if (!coefs || n_coefs != rows)
        raise_value("GRPO needs refs: float64 (" + std::to_string(rows) +
                    ",), a coefficient per labelled position (window-major), the derivative of the loss in its "
                    "log-probability");
    if (p.n_vocab * rows >= INT32_MAX)
        raise_value("GRPO: " + std::to_string(rows) + " labelled positions x " + std::to_string(p.n_vocab) +
                    " logits exceed 2^31 values in one eval; use smaller micro-batches");
    p.coef.resize(rows);
    for (int64_t r = 0; r < rows; ++r) {
        if (!std::isfinite(coefs[r])) raise_value("refs[" + std::to_string(r) + "] is not finite");
        p.coef[r] = (float) coefs[r];
    }
}

// a preference loss's checks of a step (opt_step), before anything runs: every window has a labelled position (an
// answer token); DPO's reference log-ratio per pair; ORPO's labelled prompt positions per pair, fewer than its chosen
// window's (a packed context: its documents in place of the windows, docs each position's, an even number of them)
void pref_check_step(PrefLoss & pref, const int32_t * labels, int64_t n_rows, int64_t n_win, const double * refs,
                     int64_t n_refs, const int32_t * prompt_rows, int64_t n_prompt, const std::vector<int32_t> & docs) {
    if (pref.method == PrefLoss::GRPO) {
        grpo_check_step(pref, labels, n_rows * n_win, refs, n_refs, prompt_rows, docs);
        return;
    }
    if (!labels) raise_value("a preference loss needs labels: each window's answer tokens, -1 elsewhere");
    const std::string what = docs.empty() ? "window " : "document ";
    const int64_t n_seq = docs.empty() ? n_rows : docs.back() + 1;
    if (n_seq % 2 != 0)
        raise_value("a packed preference step takes documents that alternate chosen, rejected: an even number; got " +
                    std::to_string(n_seq));
    std::vector<int64_t> labelled(n_seq, 0);
    for (int64_t k = 0; k < n_rows * n_win; ++k) labelled[docs.empty() ? k / n_win : docs[k]] += labels[k] >= 0;
    for (int64_t s = 0; s < n_seq; ++s) {
        if (labelled[s] == 0)
            raise_value(what + std::to_string(s) +
                        " has no labelled position: a preference pair's answer needs at least one token in its window");
    }
    pref.ref.clear();
    if (pref.method == PrefLoss::DPO) {
        if (!refs || n_refs != n_seq / 2)
            raise_value("DPO needs refs: float64 (" + std::to_string(n_seq / 2) +
                        ",), each pair's reference log-ratio log p_ref(chosen) - log p_ref(rejected)");
        for (int64_t i = 0; i < n_seq / 2; ++i) {
            if (!std::isfinite(refs[i])) raise_value("refs[" + std::to_string(i) + "] is not finite");
            pref.ref.push_back((float) refs[i]);
        }
    }
    pref.prompt.clear();
    if (prompt_rows) {
        if (pref.method != PrefLoss::ORPO)
            raise_value("prompt_rows are for ORPO's nll over the chosen prompt and answer (opt_init with loss 'orpo')");
        if (n_prompt != n_seq / 2)
            raise_value("prompt_rows must be int32 (" + std::to_string(n_seq / 2) +
                        ",): per pair, the labelled positions of its chosen window's prompt; got " +
                        std::to_string(n_prompt));
        for (int64_t i = 0; i < n_seq / 2; ++i) {
            const int32_t n = prompt_rows[i];
            if (n < 0 || n >= labelled[2 * i])
                raise_value("prompt_rows[" + std::to_string(i) + "] = " + std::to_string(n) + " must be in [0, " +
                            std::to_string(labelled[2 * i]) +
                            "): its chosen window's labelled positions less the answer's (at least one)");
            pref.prompt.push_back(n);
        }
    }
}

void pref_read(PrefLoss & p) {
    if (p.method == PrefLoss::GRPO) {
        std::vector<float> lp(p.target.size());
        ggml_backend_tensor_get(p.token_lp, lp.data(), 0, ggml_nbytes(p.token_lp));
        p.logps.assign(lp.begin(), lp.end());
        return;
    }
    p.logps.resize(p.ce.size());
    p.logps_prompt.assign(p.ce.size(), 0.0);
    for (size_t s = 0; s < p.ce.size(); ++s) {
        float ce = 0.0f;
        ggml_backend_tensor_get(p.ce[s], &ce, 0, sizeof(ce));
        p.logps[s] = -(double) p.rows[s] * ce;
        if (p.ce_prompt[s]) {
            ggml_backend_tensor_get(p.ce_prompt[s], &ce, 0, sizeof(ce));
            p.logps_prompt[s] = -(double) p.rows_prompt[s] * ce;
        }
    }
}

}  // namespace lb
