/* BPE-dropout (Provilkov et al., 2020) for training on small corpora (see data.BPEDropout).
 *
 * Each word starts as its characters (a word whose prepared segmentation cannot be
 * rebuilt from characters, e.g. one holding <unk>, starts as its prepared pieces, a fixed
 * point of the merges) and is merged as in the paper's Algorithm 1: at every step each
 * adjacent pair whose concatenation is a piece is removed from the candidates with
 * probability p, the best-scored remaining one is merged (the leftmost on a tie, as
 * sentencepiece's BPE encoder does), and the word is done when no candidate remains. A
 * pair removed at one step is a candidate again at the next. At p = 0 this is
 * sentencepiece's deterministic segmentation. (Sentencepiece's own sampling instead
 * discards a popped pair until a merge changes one of its symbols: a stronger dropout,
 * more pieces a sentence at the same p; measured: docs/results.md, "How the recipe was
 * chosen".)
 *
 * Draw j of word w is SplitMix64(SplitMix64(seed + w * golden) + j * golden) >> 11, a
 * 53-bit integer, one per candidate pair and step, left to right; the pair is removed when
 * the draw is below `threshold` (p * 2^53). So a word's segmentation depends on (seed, w)
 * only: not on the process, the thread or the other words. data._bpe_dropout_words is the
 * same algorithm in Python (the fallback without a compiler; tests compare the two).
 */
#include <stdint.h>
#include <string.h>

#define BPE_GOLDEN 0x9E3779B97F4A7C15ull

static inline uint64_t bpe_splitmix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Index of `key` in the ascending `keys`, or -1. */
static inline int64_t bpe_find(const int64_t *keys, int64_t n, int64_t key) {
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (keys[mid] < key) lo = mid + 1;
        else hi = mid;
    }
    return lo < n && keys[lo] == key ? lo : -1;
}

/* Every word: word w's starting symbols are sym[off[w]:off[w+1]]; its pieces are
 * written to out[off[w]:] (never more than it started with) and their number to count[w].
 * The merges: pair (a, b) as key a * v + b, ascending, gives the piece merged[k] of
 * score score[k]. */
void aiayn_bpe_dropout(const int32_t *sym, const int64_t *off, int64_t n_words,
                       const int64_t *keys, const int32_t *merged, const double *score,
                       int64_t n_merges, int64_t v, uint64_t seed, uint64_t threshold,
                       int32_t *out, int64_t *count) {
    for (int64_t w = 0; w < n_words; w++) {
        int64_t n = off[w + 1] - off[w];
        int32_t *s = out + off[w];
        memcpy(s, sym + off[w], (size_t)n * sizeof(int32_t));
        uint64_t stream = bpe_splitmix64(seed + (uint64_t)w * BPE_GOLDEN), j = 0;
        for (;;) {
            int64_t best = -1, best_k = -1;
            double best_score = 0.0;
            for (int64_t i = 0; i + 1 < n; i++) {
                int64_t k = bpe_find(keys, n_merges, (int64_t)s[i] * v + s[i + 1]);
                if (k < 0) continue;
                if (threshold > 0) {
                    j++;
                    if ((bpe_splitmix64(stream + j * BPE_GOLDEN) >> 11) < threshold) continue;
                }
                if (best < 0 || score[k] > best_score) {
                    best = i, best_k = k, best_score = score[k];
                }
            }
            if (best < 0) break;
            s[best] = merged[best_k];
            memmove(s + best + 1, s + best + 2, (size_t)(n - best - 2) * sizeof(int32_t));
            n--;
        }
        count[w] = n;
    }
}
