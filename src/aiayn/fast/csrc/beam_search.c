/* The whole beam search over the compiled decoder step (see decoder_step.py,
 * `NativeStates.search`).
 *
 * Why: with the decoder's step one C call (decoder_step.c), a small model's beam step at
 * batch 1 was mostly the search's own Python and PyTorch operators around that call:
 * picking each sentence's k best of its k * k candidates, setting finished hypotheses
 * aside, the early-termination test and the reordering took ~0.27 of the 0.45 ms of a
 * step of the recipe's model (measured: docs/performance.md, "A step at batch 1"). Here
 * that loop runs in C, with the semantics search.py's `beam_search` writes down and
 * implements (OpenNMT-py's beam: a candidate ending in EOS leaves the beam and its slot
 * stays empty for one step; GNMT's length penalty; a sentence ends with no live
 * hypothesis, at its cap, or when no live one can beat the k-th best finished one), so
 * that the two give the same hypotheses: the same float32 sums of log-probabilities, the
 * same double-precision length penalty (libm's pow, as Python's float power), the same
 * order among finished hypotheses of equal score (the one finished first stays first,
 * as Python's stable sort). Candidates of exactly equal score are taken lowest first,
 * where torch.topk's choice among ties is unspecified.
 *
 * Each sentence keeps only its k best finished hypotheses: the termination test reads
 * the k-th best, and the caller asks for at most k.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decoder_step.h"

/* GNMT's lp(Y) = ((5 + |Y|) / 6) ** alpha, as search.length_penalty computes it. */
static double length_penalty(int64_t length, double alpha) {
    return pow((5.0 + (double)length) / 6.0, alpha);
}

/* Insert a finished hypothesis into a sentence's list of at most k, best score first, after
 * every one of equal score (Python's stable sort by score): dropped if it is not among the k
 * best. */
static void add_finished(int64_t *count, int64_t *len, int64_t *tokens, double *score,
                         double *log_prob, int k, int64_t max_len, const int64_t *seq,
                         int64_t n, double s, double lp) {
    int64_t c = *count, p = c;
    while (p > 0 && score[p - 1] < s) p--;
    if (p >= k) return;
    int64_t last = c < k ? c : k - 1; /* entries p..last-1 move down one place */
    for (int64_t i = last; i > p; i--) {
        score[i] = score[i - 1];
        log_prob[i] = log_prob[i - 1];
        len[i] = len[i - 1];
        memcpy(tokens + i * max_len, tokens + (i - 1) * max_len, (size_t)len[i] * 8);
    }
    score[p] = s;
    log_prob[p] = lp;
    len[p] = n;
    memcpy(tokens + p * max_len, seq, (size_t)n * 8);
    *count = c < k ? c + 1 : k;
}

/* Beam search for A sentences over the step of `m0`, whose layers' mem_k and mem_v hold
 * the A sentences' encoder keys and values ((A, h, S, d_k) and (A, h, S, d_v) per layer;
 * moved in place as sentences finish). mask: (A, S) bytes, 1 = a real source position.
 * caps: (A,) output caps, each <= max_len and < the decoder's max_positions. beam: k.
 * excl / excl_short: the tokens never generated, and those plus EOS (used while fewer than
 * min_len tokens are out); at least k tokens of the vocabulary are outside each.
 * block_bytes: the int8 output layer's block rule (decoder_step.py, `_out_block`).
 * Writes each sentence's k best finished hypotheses (fewer if fewer finished), best first:
 * count (A,), len (A, k), tokens (A, k, max_len) without BOS and EOS, score (A, k) the
 * length-normalised score, log_prob (A, k). Returns 0, or -1 if memory ran out. */
int aiayn_beam_search(const aiayn_decoder *m0, int64_t A, int64_t S, const uint8_t *mask,
                      const int64_t *caps, int k, double alpha, int64_t min_len, int64_t bos,
                      int64_t eos, const int64_t *excl, int n_excl, const int64_t *excl_short,
                      int n_excl_short, int64_t block_bytes, int64_t max_len,
                      int64_t *out_count, int64_t *out_len, int64_t *out_tokens,
                      double *out_score, double *out_log_prob) {
    aiayn_decoder m = *m0; /* its out_block is set per step */
    const int64_t L = m.layers, H = m.h, V = m.vocab;
    const int64_t ld = L * H * (2 * m.d_k + m.d_v);
    const int64_t R = A * k; /* rows at most */
    const int64_t kv_k = H * S * m.d_k, kv_v = H * S * m.d_v;
    int status = -1;
    int64_t n_tables = 0, work_size = 0;
    float *work = NULL;
    float **tables = calloc((size_t)(max_len > 0 ? max_len : 1), sizeof(float *));
    int64_t *addresses = calloc((size_t)(max_len > 0 ? max_len : 1), 8);
    int64_t *path = malloc((size_t)(R * max_len) * 8);
    int64_t *hist = malloc((size_t)(2 * R * max_len) * 8);
    int64_t *last = malloc((size_t)R * 8), *reorder = malloc((size_t)R * 8);
    int64_t *top_idx = malloc((size_t)(R * k) * 8), *sel_row = malloc((size_t)R * 8);
    int64_t *sel_tok = malloc((size_t)R * 8), *sent = malloc((size_t)A * 8);
    float *scores = malloc((size_t)R * 4), *top_val = malloc((size_t)(R * k) * 4);
    float *live = malloc((size_t)R * 4), *cand = malloc((size_t)(k * k) * 4);
    uint8_t *smask = malloc((size_t)(A * S)), *row_mask = malloc((size_t)(R * S));
    char *keep = malloc((size_t)A);
    if (!tables || !addresses || !path || !hist || !last || !reorder || !top_idx || !sel_row ||
        !sel_tok || !sent || !scores || !top_val || !live || !cand || !smask || !row_mask ||
        !keep)
        goto out;
    memcpy(smask, mask, (size_t)(A * S));
    for (int64_t a = 0; a < A; a++) {
        sent[a] = a;
        last[a] = bos;
        scores[a] = 0.0f;
        out_count[a] = 0;
    }
    int64_t *cur = hist, *nxt = hist + R * max_len; /* each row's tokens so far, and next */
    int64_t na = A, slots = 1;
    for (int64_t t = 0; na > 0; t++) {
        const int64_t rows = na * slots;
        for (int64_t r = 0; r < rows; r++) /* the source mask, one row per hypothesis */
            memcpy(row_mask + r * S, smask + (r / slots) * S, (size_t)S);
        int64_t block = block_bytes / (4 * rows) / 64 * 64;
        m.out_block = block < 64 ? 64 : block > V ? V : block;
        const int64_t need = aiayn_decoder_workspace(&m, rows, t, slots, S);
        if (need > work_size) {
            free(work);
            work_size = 2 * need;
            if (!(work = malloc((size_t)work_size * 4))) goto out;
        }
        if (!(tables[t] = malloc((size_t)(rows * ld) * 4))) goto out;
        n_tables = t + 1;
        addresses[t] = (int64_t)(intptr_t)tables[t];
        const int short_ = t < min_len;
        aiayn_decoder_step(&m, last, rows, t, tables[t], addresses, path, max_len,
                           t > 0 ? reorder : NULL, row_mask, S, slots, S, NULL, k,
                           short_ ? excl_short : excl, short_ ? n_excl_short : n_excl,
                           top_val, top_idx, work);

        /* each sentence's k best of its slots x k candidates; finished ones set aside */
        const int64_t n = t + 1; /* |Y| of every candidate, EOS included */
        int64_t kept = 0;
        for (int64_t a = 0; a < na; a++) {
            const int64_t nc = slots * k, s = sent[a], cap = caps[s];
            for (int64_t c = 0; c < nc; c++)
                cand[c] = scores[a * slots + c / k] + top_val[(a * slots) * k + c];
            float best_live = -INFINITY;
            for (int j = 0; j < k; j++) {
                int64_t c_best = -1;
                for (int64_t c = 0; c < nc; c++) /* the best left, lowest first among ties */
                    if (cand[c] == cand[c] && (c_best < 0 || cand[c] > cand[c_best])) c_best = c;
                const int64_t row = a * slots + (c_best < 0 ? 0 : c_best / k), o = a * k + j;
                const float v = c_best < 0 ? -INFINITY : cand[c_best];
                const int64_t token = c_best < 0 ? eos : top_idx[(a * slots) * k + c_best];
                if (c_best >= 0) cand[c_best] = NAN; /* taken */
                sel_row[o] = row;
                sel_tok[o] = token;
                int64_t *seq = nxt + o * max_len;
                memcpy(seq, cur + row * max_len, (size_t)t * 8);
                seq[t] = token;
                live[o] = v;
                if (v == -INFINITY) continue;
                if (token == eos || n >= cap) { /* an EOS is dropped; at the cap it ends as is */
                    add_finished(out_count + s, out_len + s * k, out_tokens + s * k * max_len,
                                 out_score + s * k, out_log_prob + s * k, k, max_len, seq,
                                 token == eos ? t : n, (double)v / length_penalty(n, alpha),
                                 (double)v);
                    live[o] = -INFINITY;
                } else if (v > best_live) {
                    best_live = v;
                }
            }
            int done = n >= cap || best_live == -INFINITY;
            if (!done && out_count[s] >= k) /* can a live one still beat the k-th finished? */
                done = (double)best_live / length_penalty(cap, alpha) <= out_score[s * k + k - 1];
            keep[a] = !done;
            kept += !done;
        }
        if (kept == 0) break;
        /* the kept sentences' rows, in order; what is stored per sentence follows them */
        int64_t b = 0;
        for (int64_t a = 0; a < na; a++) {
            if (!keep[a]) continue;
            for (int j = 0; j < k; j++) {
                const int64_t from = a * k + j, to = b * k + j;
                reorder[to] = sel_row[from];
                last[to] = sel_tok[from];
                scores[to] = live[from];
                if (to != from) memcpy(nxt + to * max_len, nxt + from * max_len, (size_t)n * 8);
            }
            if (b != a) {
                sent[b] = sent[a];
                memcpy(smask + b * S, smask + a * S, (size_t)S);
                for (int64_t l = 0; l < L; l++) {
                    float *mk = (float *)m.layer[l].mem_k, *mv = (float *)m.layer[l].mem_v;
                    memcpy(mk + b * kv_k, mk + a * kv_k, (size_t)kv_k * 4);
                    memcpy(mv + b * kv_v, mv + a * kv_v, (size_t)kv_v * 4);
                }
            }
            b++;
        }
        na = kept;
        slots = k;
        int64_t *swap = cur;
        cur = nxt;
        nxt = swap;
    }
    status = 0;
out:
    for (int64_t i = 0; i < n_tables; i++) free(tables[i]);
    free(tables);
    free(addresses);
    free(path);
    free(hist);
    free(last);
    free(reorder);
    free(top_idx);
    free(sel_row);
    free(sel_tok);
    free(sent);
    free(scores);
    free(top_val);
    free(live);
    free(cand);
    free(smask);
    free(row_mask);
    free(keep);
    free(work);
    return status;
}
