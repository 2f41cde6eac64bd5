/* A packed GGUF layer's product in float32 (see lmtrace/model/gguf/nibbles.py): y = x W^T where W
   is held as 4-bit codes c with, per group of 32 along the input and per output column, a scale S
   and a zero Z, the weight being (c - 8) * S + Z, summed over the layer's pieces (each piece reads
   the same input), or as one piece of 8-bit codes, the weight c * S + Z (types whose integers need
   5 to 8 bits: Q8_0, Q5_0, Q5_1, Q5_K..., and Q6_K with a scale per 16). Columns go in panels of 64: a chunk of a panel's weights
   is made in float32, fma(c - 8, S, Z) or fma(c, S, Z) (one rounding: gguf's own dequantized value
   for a one-piece type), into a buffer, and every input row multiplies it. Each output element is a
   chain of fused multiply-adds along each chunk of 128 input positions in order, the chunks' sums
   added in order, so it is the same whatever the rows of the call, the threads sharing it, or how
   its rows and columns are blocked. Built by lmtrace.model.fused.build with the other kernels. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#include "kernels.h"
#ifdef _OPENMP
#include <omp.h> /* torch's own OpenMP runtime where torch is loaded first: its threads, no others */
#endif

#define PANEL 64 /* output columns made together */
#define CHUNK 128 /* input positions of a panel in the buffer at once (32 KB) */

/* c - 8 of position j of a run, for the 8 columns of a word vector: the nibble moved to the top,
   then shifted back with its sign */
#define CODE(v, j) _mm256_srai_epi32(_mm256_slli_epi32((v), 28 - 4 * (j)), 28)

/* the codes of a panel's run of 8 positions starting at input position k of piece p */
static inline const uint32_t* run_codes(const lmt_int4* a, long panel, int p, long k) {
    const long k_all = a->pieces * a->in;
    return a->codes + ((panel * k_all + p * a->in + k) / 8) * PANEL;
}

/* the panel's weights at input positions k0 .. k0 + n of piece p, as w[k][64] */
static void weights(const lmt_int4* a, long panel, int p, long k0, long n, float* w) {
    const long groups = a->pieces * a->in / 32, group0 = panel * groups + (p * a->in + k0) / 32;
    for (long k8 = 0; k8 < n; k8 += 8) {
        const uint32_t* codes = run_codes(a, panel, p, k0 + k8);
        const float* s = a->scales + (group0 + k8 / 32) * PANEL;
        const float* z = a->zeros + (group0 + k8 / 32) * PANEL;
#if defined(__AVX2__) && defined(__FMA__)
        for (int b = 0; b < 8; b++) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(codes + b * 8));
            const __m256 sb = _mm256_loadu_ps(s + b * 8), zb = _mm256_loadu_ps(z + b * 8);
            float* at = w + k8 * PANEL + b * 8;
#define STORE(j) _mm256_storeu_ps(at + (j) * PANEL, _mm256_fmadd_ps(_mm256_cvtepi32_ps(CODE(v, j)), sb, zb))
            STORE(0); STORE(1); STORE(2); STORE(3); STORE(4); STORE(5); STORE(6); STORE(7);
#undef STORE
        }
#else
        for (int j = 0; j < 8; j++)
            for (int col = 0; col < PANEL; col++) {
                const int c = (int)((codes[col] >> (4 * j)) & 15) ^ 8; /* c - 8 + 8 */
                w[(k8 + j) * PANEL + col] = fmaf((float)(c - 8), s[col], z[col]);
            }
#endif
    }
}

/* 8-bit codes: the panel's 64 codes at input position k (one piece) */
static inline const int8_t* byte_codes(const lmt_int4* a, long panel, long k) {
    return (const int8_t*)a->codes + (panel * a->in + k) * PANEL;
}

/* weights() for 8-bit codes: fma(c, S, Z) */
static void weights8(const lmt_int4* a, long panel, long k0, long n, float* w) {
    const long groups = a->in / a->group, group0 = panel * groups + k0 / a->group;
    for (long k = 0; k < n; k++) {
        const int8_t* codes = byte_codes(a, panel, k0 + k);
        const float* s = a->scales + (group0 + k / a->group) * PANEL;
        const float* z = a->zeros + (group0 + k / a->group) * PANEL;
#if defined(__AVX2__) && defined(__FMA__)
        for (int b = 0; b < 8; b++) {
            const __m256 c = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(codes + b * 8))));
            _mm256_storeu_ps(w + k * PANEL + b * 8,
                             _mm256_fmadd_ps(c, _mm256_loadu_ps(s + b * 8), _mm256_loadu_ps(z + b * 8)));
        }
#else
        for (int col = 0; col < PANEL; col++) w[k * PANEL + col] = fmaf((float)codes[col], s[col], z[col]);
#endif
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* R rows (1 to 6) from m, columns j0 .. j0 + 16 of the panel: y (or, for the first chunk, 0) +
   x[:, k0 .. k0 + n] w, the chunk's products summed apart first; with R = 6 twelve sums, two weight
   vectors and a broadcast fill the 16 vector registers */
static inline __attribute__((always_inline)) void row_block(const lmt_int4* a, const float* w, long n,
                                                            const float* x, float* y, long out, int first,
                                                            const int R) {
    __m256 acc[6][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (long k = 0; k < n; k++) {
        const __m256 w0 = _mm256_loadu_ps(w + k * PANEL), w1 = _mm256_loadu_ps(w + k * PANEL + 8);
        for (int r = 0; r < R; r++) {
            const __m256 xk = _mm256_broadcast_ss(x + r * a->in + k);
            acc[r][0] = _mm256_fmadd_ps(w0, xk, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(w1, xk, acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++) {
            float* at = y + r * out + h * 8;
            _mm256_storeu_ps(at, first ? acc[r][h] : _mm256_add_ps(_mm256_loadu_ps(at), acc[r][h]));
        }
}

/* every row of the call times 16 columns of the chunk's weights (kept in the first cache while the
   rows go by), in blocks of 6 rows where they fill the registers (7: 4 and 3), else 4, then the last 1 to 3 */
static void columns16(const lmt_int4* a, const float* w, long n, long k0, long col, int first) {
    const long out = a->panels * PANEL;
    long m = 0;
    while (m < a->rows) {
        const long left = a->rows - m;
        const int R = left >= 6 && left != 7 ? 6 : left >= 4 ? 4 : (int)left;
        const float* x = a->x + m * a->in + k0;
        float* y = a->y + m * out + col;
        switch (R) {
            case 6: row_block(a, w, n, x, y, out, first, 6); break;
            case 4: row_block(a, w, n, x, y, out, first, 4); break;
            case 3: row_block(a, w, n, x, y, out, first, 3); break;
            case 2: row_block(a, w, n, x, y, out, first, 2); break;
            default: row_block(a, w, n, x, y, out, first, 1);
        }
        m += R;
    }
}

/* the scales and zeros of group `group` of the panels, for the 32 columns of half a panel */
static inline void half_scales(const lmt_int4* a, long group, int half, __m256* s, __m256* z) {
    for (int q = 0; q < 4; q++) {
        s[q] = _mm256_loadu_ps(a->scales + group * PANEL + half * 32 + q * 8);
        z[q] = _mm256_loadu_ps(a->zeros + group * PANEL + half * 32 + q * 8);
    }
}

/* y[0 .. 32] = acc (the first chunk) or y + acc */
static inline void store_half(const __m256* acc, float* y, int first) {
    for (int q = 0; q < 4; q++)
        _mm256_storeu_ps(y + q * 8, first ? acc[q] : _mm256_add_ps(_mm256_loadu_ps(y + q * 8), acc[q]));
}

/* one row, the panel's 64 columns, each weight made in registers as weights() makes it (the same
   value), half a panel at a time: for calls of fewer than 4 rows, where a buffer would be written
   and read for one row's use */
static void direct(const lmt_int4* a, long panel, int p, long k0, long n, const float* x, float* y, int first) {
    const long groups = a->pieces * a->in / 32, group0 = panel * groups + (p * a->in + k0) / 32;
    for (int half = 0; half < 2; half++) {
        __m256 acc[4];
        for (int q = 0; q < 4; q++) acc[q] = _mm256_setzero_ps();
        for (long g = 0; g < n / 32; g++) {
            __m256 s[4], z[4];
            half_scales(a, group0 + g, half, s, z);
            for (long k8 = g * 32; k8 < g * 32 + 32; k8 += 8) {
                const uint32_t* codes = run_codes(a, panel, p, k0 + k8) + half * 32;
                __m256i v[4];
                for (int q = 0; q < 4; q++) v[q] = _mm256_loadu_si256((const __m256i*)(codes + q * 8));
#define STEP(j)                                                                                          \
    {                                                                                                    \
        const __m256 xk = _mm256_broadcast_ss(x + k8 + (j));                                             \
        for (int q = 0; q < 4; q++)                                                                      \
            acc[q] = _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_cvtepi32_ps(CODE(v[q], j)), s[q], z[q]), xk, acc[q]); \
    }
                STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5) STEP(6) STEP(7)
#undef STEP
            }
        }
        store_half(acc, y + half * 32, first);
    }
}

/* direct() for 8-bit codes: each weight made in registers as weights8() makes it */
static void direct8(const lmt_int4* a, long panel, long k0, long n, const float* x, float* y, int first) {
    const long group = a->group, groups = a->in / group, group0 = panel * groups + k0 / group;
    for (int half = 0; half < 2; half++) {
        __m256 acc[4];
        for (int q = 0; q < 4; q++) acc[q] = _mm256_setzero_ps();
        for (long g = 0; g < n / group; g++) {
            __m256 s[4], z[4];
            half_scales(a, group0 + g, half, s, z);
            for (long k = g * group; k < g * group + group; k++) {
                const int8_t* codes = byte_codes(a, panel, k0 + k) + half * 32;
                const __m256 xk = _mm256_broadcast_ss(x + k);
                for (int q = 0; q < 4; q++) {
                    const __m128i c8 = _mm_loadl_epi64((const __m128i*)(codes + q * 8));
                    const __m256 w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c8)), s[q], z[q]);
                    acc[q] = _mm256_fmadd_ps(w, xk, acc[q]);
                }
            }
        }
        store_half(acc, y + half * 32, first);
    }
}

#else
/* one row, the panel's 64 columns */
static void one_row(const float* w, long n, const float* x, float* y, int first) {
    for (int j = 0; j < PANEL; j++) {
        float acc = 0.0f;
        for (long k = 0; k < n; k++) acc = fmaf(w[k * PANEL + j], x[k], acc);
        y[j] = first ? acc : y[j] + acc;
    }
}
#endif

static void panels(const lmt_int4* a, long start, long end) {
    float* w = (float*)aligned_alloc(64, sizeof(float) * CHUNK * PANEL);
    const long out = a->panels * PANEL;
    for (long panel = start; panel < end; panel++)
        for (int p = 0; p < a->pieces; p++)
            for (long k0 = 0; k0 < a->in; k0 += CHUNK) {
                const long n = a->in - k0 < CHUNK ? a->in - k0 : CHUNK;
                const int first = p == 0 && k0 == 0;
                long m = 0;
#if defined(__AVX2__) && defined(__FMA__)
                if (a->rows < 4) {
                    for (; m < a->rows; m++) {
                        const float* x = a->x + m * a->in + k0;
                        float* y = a->y + m * out + panel * PANEL;
                        if (a->bits == 8)
                            direct8(a, panel, k0, n, x, y, first);
                        else
                            direct(a, panel, p, k0, n, x, y, first);
                    }
                    continue;
                }
#endif
                if (a->bits == 8)
                    weights8(a, panel, k0, n, w);
                else
                    weights(a, panel, p, k0, n, w);
#if defined(__AVX2__) && defined(__FMA__)
                for (int j = 0; j < PANEL; j += 16) columns16(a, w + j, n, k0, panel * PANEL + j, first);
#else
                for (; m < a->rows; m++) one_row(w, n, a->x + m * a->in + k0, a->y + m * out + panel * PANEL, first);
#endif
            }
    free(w);
}

#ifndef _OPENMP /* threads started per call */
typedef struct {
    const lmt_int4* a;
    long start, end;
} part;

static void* run(void* p) {
    const part* q = (const part*)p;
    panels(q->a, q->start, q->end);
    return NULL;
}
#endif

/* whether the threads are OpenMP's (torch's pool: cheap to wake) or started for each call */
int lmt_int4_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* the product on `threads` threads, each taking a run of panels: OpenMP's where the library was
   built with it, else the calling one and threads - 1 started for the call */
void lmt_int4_mm(const lmt_int4* a, int threads) {
    if (threads > 64) threads = 64;
    if (threads > a->panels) threads = (int)a->panels;
    if (threads <= 1) {
        panels(a, 0, a->panels);
        return;
    }
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
    {
        const long count = omp_get_num_threads(), t = omp_get_thread_num();
        const long step = (a->panels + count - 1) / count;
        const long start = t * step < a->panels ? t * step : a->panels;
        panels(a, start, start + step < a->panels ? start + step : a->panels);
    }
#else
    pthread_t started[64];
    part parts[64];
    int running = 0;
    const long step = (a->panels + threads - 1) / threads;
    for (int t = 0; t < threads; t++) {
        const long start = t * step < a->panels ? t * step : a->panels;
        parts[t] = (part){a, start, start + step < a->panels ? start + step : a->panels};
    }
    for (int t = 1; t < threads; t++) {
        if (pthread_create(&started[running], NULL, run, &parts[t]) == 0)
            running++;
        else
            panels(a, parts[t].start, parts[t].end); /* no thread to be had: this one does the part */
    }
    panels(a, parts[0].start, parts[0].end);
    for (int t = 0; t < running; t++) pthread_join(started[t], NULL);
#endif
}
