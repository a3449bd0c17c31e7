/* Paged attention of short queries on a CPU (decode: one query token; speculative verification: a few),
 * reading the fp32 KV cache in place, block by block (kernels/cpu_attention.py builds and calls it).
 *
 * Why: the torch path (kernels/reference.py) first gathers every sequence's blocks into one contiguous
 * [n, L, Hkv, D] copy per layer, then runs a padded SDPA over it, so each decode step writes the whole
 * batch's context once and reads it twice. Here each (sequence, KV head) task reads its keys once and
 * its values once, for every query row of that head at the same time (the G query heads sharing it x
 * the sequence's query tokens):
 *
 *   1. scores: each key row is loaded once and dotted with every query row (pre-scaled), into a
 *      [rows, len] scratch;
 *   2. softmax of each row over the keys it may see (causal: query token j sits at position
 *      len - q_len + j), exponentials vectorized over the keys; keys past its position get 0;
 *   3. values: each value row is loaded once and added to every query row's accumulator.
 *
 * Two passes over the scores instead of an online softmax: a decode row's scores are a few KB, and
 * no accumulator is rescaled per block. The head size is a compile-time constant in the common cases
 * (64, 128: the dot products and the accumulation unroll into whole vector registers); any other size
 * runs the same code with a runtime size.
 *
 * Layouts (kernels/reference.py): query [T, Hq, D] (rows and heads strided, D contiguous), caches
 * [num_blocks, block_size, Hkv, D] contiguous, block_tables int32 [S, max_blocks], out like query.
 * Per task i of n: seqs[i] (its block-table row), starts[i] (its first query row), q_lens[i], seq_lens[i]
 * (context including this step's tokens).
 *
 * Plain C (no torch headers), so that -march=native code never meets ATen's inline functions; OpenMP
 * resolves to torch's own libgomp, already loaded in the process, so the tasks share its threads.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* e^x for x <= 0 (every argument here is a score minus the row's max), branch-free so that the loop
 * over a row's scores vectorizes: Cody-Waite reduction by ln 2 and Cephes' expf polynomial (about
 * 1 ulp), the power of two put in the exponent bits. Arguments below -87 give e^-87, not 0: never
 * a denormal. */
static inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float shifter = 12582912.0f; /* 1.5 * 2^23: adding and subtracting it rounds to an integer */
  const float n = (x * 1.44269504088896341f + shifter) - shifter;
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

/* A row of the next block on its way to the cache while this block is computed: blocks sit anywhere in
 * the cache, so no hardware prefetcher guesses them; one row per token keeps the requests in flight
 * few and steady (a whole block at once measured slower). */
static inline void prefetch_row(const float* p, int64_t width) {
  for (int64_t x = 0; x < width; x += 16) __builtin_prefetch(p + x);
}

/* Scratch of one thread, grown as tasks need it. */
typedef struct {
  int64_t q_cap, s_cap;
  float *qs, *acc, *s;
} Scratch;

static int reserve(Scratch* w, int64_t rows, int64_t d, int64_t len) {
  if (rows * d > w->q_cap) {
    free(w->qs), free(w->acc);
    w->q_cap = rows * d;
    w->qs = malloc(sizeof(float) * w->q_cap), w->acc = malloc(sizeof(float) * w->q_cap);
  }
  if (rows * len > w->s_cap) {
    free(w->s);
    w->s_cap = rows * len;
    w->s = malloc(sizeof(float) * w->s_cap);
  }
  return w->qs && w->acc && w->s ? 0 : -1;
}

/* One (sequence, KV head) task; `d` is a literal at the calls that matter, so it unrolls. */
static inline __attribute__((always_inline)) void attend(
    const float* q, int64_t q_s0, int64_t q_s1, const float* kc, const float* vc, int64_t block_size,
    int64_t tok_stride, int64_t blk_stride, int64_t h0, int64_t nh, int64_t g, const int32_t* table, int64_t start,
    int64_t qlen, int64_t len, float scale, float* o, int64_t o_s0, int64_t o_s1, const int64_t d, Scratch* w) {
  const int64_t hrows = g * qlen, rows = nh * hrows; /* row r: query head h0 * g + r / qlen, token r % qlen */
  float* restrict qs = w->qs;
  float* restrict acc = w->acc;
  float* restrict s = w->s;
  for (int64_t r = 0; r < rows; ++r) {
    const float* qr = q + (start + r % qlen) * q_s0 + (h0 * g + r / qlen) * q_s1;
#pragma omp simd
    for (int64_t x = 0; x < d; ++x) qs[r * d + x] = qr[x] * scale;
  }
  const int64_t nblk = (len + block_size - 1) / block_size;
  for (int64_t b = 0; b < nblk; ++b) { /* 1. scores */
    const int64_t tok0 = b * block_size;
    const int64_t ntok = len - tok0 < block_size ? len - tok0 : block_size;
    const float* kb = kc + (int64_t)table[b] * blk_stride + h0 * d;
    const float* next = b + 1 < nblk ? kc + (int64_t)table[b + 1] * blk_stride + h0 * d : NULL;
    for (int64_t t = 0; t < ntok; ++t) {
      if (next) prefetch_row(next + t * tok_stride, nh * d);
      for (int64_t hh = 0; hh < nh; ++hh) {
      const float* restrict k = kb + t * tok_stride + hh * d;
      for (int64_t r = hh * hrows; r < (hh + 1) * hrows; ++r) {
        const float* restrict qr = qs + r * d;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t x = 0; x < d; ++x) dot += qr[x] * k[x];
        s[r * len + tok0 + t] = dot;
      }
    }
    }
  }
  for (int64_t r = 0; r < rows; ++r) { /* 2. softmax over the keys row r sees */
    float* restrict sr = s + r * len;
    const int64_t seen = len - qlen + r % qlen + 1;
    float mx = -3.4e38f;
#pragma omp simd reduction(max : mx)
    for (int64_t t = 0; t < seen; ++t) mx = sr[t] > mx ? sr[t] : mx;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < seen; ++t) {
      sr[t] = exp_nonpositive(sr[t] - mx);
      sum += sr[t];
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t t = 0; t < seen; ++t) sr[t] *= inv;
    for (int64_t t = seen; t < len; ++t) sr[t] = 0.0f;
  }
  memset(acc, 0, sizeof(float) * rows * d);
  for (int64_t b = 0; b < nblk; ++b) { /* 3. values */
    const int64_t tok0 = b * block_size;
    const int64_t ntok = len - tok0 < block_size ? len - tok0 : block_size;
    const float* vb = vc + (int64_t)table[b] * blk_stride + h0 * d;
    const float* next = b + 1 < nblk ? vc + (int64_t)table[b + 1] * blk_stride + h0 * d : NULL;
    for (int64_t t = 0; t < ntok; ++t) {
      if (next) prefetch_row(next + t * tok_stride, nh * d);
      for (int64_t hh = 0; hh < nh; ++hh) {
      const float* restrict v = vb + t * tok_stride + hh * d;
      for (int64_t r = hh * hrows; r < (hh + 1) * hrows; ++r) {
        const float p = s[r * len + tok0 + t];
        float* restrict ar = acc + r * d;
#pragma omp simd
        for (int64_t x = 0; x < d; ++x) ar[x] += p * v[x];
      }
    }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = o + (start + r % qlen) * o_s0 + (h0 * g + r / qlen) * o_s1;
#pragma omp simd
    for (int64_t x = 0; x < d; ++x) dst[x] = acc[r * d + x];
  }
}

int omni_paged_short_attention(const float* q, int64_t q_s0, int64_t q_s1, const float* kc, const float* vc,
                               int64_t block_size, int64_t hkv, int64_t d, int64_t hq, const int32_t* bt,
                               int64_t bt_s0, int64_t n, const int64_t* seqs, const int64_t* starts,
                               const int64_t* q_lens, const int64_t* seq_lens, float scale, float* o, int64_t o_s0,
                               int64_t o_s1, int num_threads) {
  const int64_t g = hq / hkv, tok_stride = hkv * d, blk_stride = block_size * hkv * d;
  /* A task is a sequence with all its KV heads (each token's keys of all heads are one contiguous read),
   * split by head when there are too few sequences to keep every thread busy. */
  const int64_t split = n >= 2 * num_threads ? 1 : hkv, nh = hkv / split;
  int failed = 0;
#pragma omp parallel num_threads(num_threads)
  {
    Scratch w = {0, 0, NULL, NULL, NULL};
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < n * split; ++task) {
      const int64_t i = task / split, h0 = (task % split) * nh;
      if (reserve(&w, nh * g * q_lens[i], d, seq_lens[i]) != 0) {
#pragma omp atomic write
        failed = 1;
        continue;
      }
      const int32_t* table = bt + seqs[i] * bt_s0;
#define OMNI_ATTEND(D) attend(q, q_s0, q_s1, kc, vc, block_size, tok_stride, blk_stride, h0, nh, g, table, starts[i], \
                              q_lens[i], seq_lens[i], scale, o, o_s0, o_s1, D, &w)
      if (d == 64)
        OMNI_ATTEND(64);
      else if (d == 128)
        OMNI_ATTEND(128);
      else
        OMNI_ATTEND(d);
#undef OMNI_ATTEND
    }
    free(w.qs), free(w.acc), free(w.s);
  }
  return failed ? -1 : 0;
}
