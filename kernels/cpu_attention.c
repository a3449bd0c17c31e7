/* Paged attention of short queries on a CPU (decode: one query token; speculative verification: a few),
 * reading the fp32 KV cache in place, block by block (kernels/cpu_attention.py builds and calls it).
 *
 * Why: the torch path (kernels/reference.py) first gathers every sequence's blocks into one contiguous
 * [n, L, Hkv, D] copy per layer, then runs a padded SDPA over it, so each decode step writes the whole
 * batch's context once and reads it twice. Here each (sequence, KV head) task streams its blocks once:
 * for every query row of that head (the G query heads sharing it x the sequence's query tokens) it
 * takes the block's scores, rescales its running max / sum / accumulator once per block (online
 * softmax, as flash attention does) and adds the block's values.
 *
 * Layouts (kernels/reference.py): query [T, Hq, D] (rows and heads strided, D contiguous), caches
 * [num_blocks, block_size, Hkv, D] contiguous, block_tables int32 [S, max_blocks], out like query.
 * Per task i of n: seqs[i] (its block-table row), starts[i] (its first query row), q_lens[i], seq_lens[i]
 * (context including this step's tokens); query token j sits at position seq_lens - q_lens + j and
 * attends keys 0..that position.
 *
 * Plain C (no torch headers), so that -march=native code never meets ATen's inline functions; OpenMP
 * resolves to torch's own libgomp, already loaded in the process, so the tasks share its threads.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* e^x for x <= 0 (every argument here is a score minus the running max), branch-free so that the loop
 * over a block's scores vectorizes: Cody-Waite reduction by ln 2 and Cephes' expf polynomial (about
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

int omni_paged_short_attention(const float* q, int64_t q_s0, int64_t q_s1, const float* kc, const float* vc,
                               int64_t block_size, int64_t hkv, int64_t d, int64_t hq, const int32_t* bt,
                               int64_t bt_s0, int64_t n, const int64_t* seqs, const int64_t* starts,
                               const int64_t* q_lens, const int64_t* seq_lens, float scale, float* o, int64_t o_s0,
                               int64_t o_s1, int num_threads) {
  const int64_t g = hq / hkv, tok_stride = hkv * d, blk_stride = block_size * hkv * d;
  int failed = 0;
#pragma omp parallel num_threads(num_threads)
  {
    int64_t cap = 0;
    float *m = NULL, *l = NULL, *acc = NULL, *s = NULL;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < n * hkv; ++task) {
      const int64_t i = task / hkv, h = task % hkv;
      const int64_t len = seq_lens[i], qlen = q_lens[i], rows = g * qlen;
      if (rows > cap) {
        free(m), free(l), free(acc), free(s);
        cap = rows;
        m = malloc(sizeof(float) * rows), l = malloc(sizeof(float) * rows);
        acc = malloc(sizeof(float) * rows * d), s = malloc(sizeof(float) * rows * block_size);
        if (!m || !l || !acc || !s) {
          cap = 0;
#pragma omp atomic write
          failed = 1;
          continue;
        }
      }
      for (int64_t r = 0; r < rows; ++r) m[r] = -3.4e38f, l[r] = 0.0f;
      memset(acc, 0, sizeof(float) * rows * d);
      const int32_t* table = bt + seqs[i] * bt_s0;
      const int64_t nblk = (len + block_size - 1) / block_size;
      for (int64_t b = 0; b < nblk; ++b) {
        const int64_t tok0 = b * block_size;
        const int64_t ntok = len - tok0 < block_size ? len - tok0 : block_size;
        const float* kb = kc + (int64_t)table[b] * blk_stride + h * d;
        const float* vb = vc + (int64_t)table[b] * blk_stride + h * d;
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t gi = r / qlen, qi = r % qlen;
          int64_t limit = len - qlen + qi - tok0 + 1; /* keys at positions <= this query token's */
          if (limit > ntok) limit = ntok;
          if (limit <= 0) continue;
          const float* qr = q + (starts[i] + qi) * q_s0 + (h * g + gi) * q_s1;
          float* sr = s + r * block_size;
          float bmax = -3.4e38f;
          for (int64_t t = 0; t < limit; ++t) {
            const float* k = kb + t * tok_stride;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t x = 0; x < d; ++x) dot += qr[x] * k[x];
            sr[t] = dot * scale;
            bmax = sr[t] > bmax ? sr[t] : bmax;
          }
          float* ar = acc + r * d;
          if (bmax > m[r]) { /* a new running max: what was summed so far shrinks by e^(old - new) */
            const float alpha = exp_nonpositive(m[r] - bmax);
            l[r] *= alpha;
#pragma omp simd
            for (int64_t x = 0; x < d; ++x) ar[x] *= alpha;
            m[r] = bmax;
          }
          const float mr = m[r];
          float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < limit; ++t) {
            sr[t] = exp_nonpositive(sr[t] - mr);
            sum += sr[t];
          }
          l[r] += sum;
          for (int64_t t = 0; t < limit; ++t) {
            const float p = sr[t];
            const float* v = vb + t * tok_stride;
#pragma omp simd
            for (int64_t x = 0; x < d; ++x) ar[x] += p * v[x];
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t gi = r / qlen, qi = r % qlen;
        float* dst = o + (starts[i] + qi) * o_s0 + (h * g + gi) * o_s1;
        const float inv = 1.0f / l[r];
        for (int64_t x = 0; x < d; ++x) dst[x] = acc[r * d + x] * inv;
      }
    }
    free(m), free(l), free(acc), free(s);
  }
  return failed ? -1 : 0;
}
