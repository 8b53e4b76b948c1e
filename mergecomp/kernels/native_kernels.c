/* Fused CPU kernels of the quantising compressors (signSGD family, 1-bit SGD, QSGD, TernGrad)
 * and of DGC's momentum correction and the sparsifiers' threshold selection.
 *
 * Why C: each pass over a gradient costs a good fraction of a clone(), and the
 * torch/numpy versions of these compressors take 6 to 12
 * passes (sign test, packing, random bits, product, offset, rounding, conversion, clamp,
 * unpacking, scaling).  Each kernel here reads its input once and writes its output
 * once, working through the data in chunks that stay in the L1 cache.
 *
 * Every kernel computes exactly what the torch path of its caller computes, in the same
 * IEEE operations and order, so both paths give the same bits (the tests compare them);
 * hence -ffp-contract=off (no fused multiply-add) and no -ffast-math.  The one exception is
 * 1-bit SGD's two means, which are sums: they are accumulated here in a different order
 * (fp32 lanes flushed into double every 4096 elements), like any two reductions.
 *
 * Wire layout shared with packing.py (this folder): n codes of b bits form one
 * bit stream, most significant bit first (byte 0 holds code 0 in its top b bits when b
 * divides 8), zero-padded to ceil(n*b/8) bytes.
 *
 * Only plain C types cross the boundary (the Python side passes data pointers through
 * ctypes), so this file needs no Python or torch headers.
 */
#include <stddef.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#if defined(_WIN32)
#define MC_EXPORT __declspec(dllexport)
#else
#define MC_EXPORT __attribute__((visibility("default")))
#endif

/* The hot loops are compiled twice on x86-64 Linux (glibc picks one at load time): for
 * AVX2, twice as wide, and for the baseline SSE2 every x86-64 has, so the built library
 * can be moved between machines of a cluster.  The AVX2 target has no fused multiply-add,
 * and -ffp-contract=off forbids it anyway: both versions give the same bits. */
#if defined(__x86_64__) && defined(__GLIBC__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define MC_HOT __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef MC_HOT
#define MC_HOT
#endif
/* Helpers are inlined into each clone, so they too are compiled for its target. */
#if defined(__GNUC__)
#define MC_INLINE static inline __attribute__((always_inline))
#else
#define MC_INLINE static inline
#endif

/* Raised whenever a signature or a result changes, so a stale build is never loaded. */
MC_EXPORT int mc_abi_version(void) { return 5; }

/* Elements per chunk: a multiple of 8 (chunks start on a byte of any b-bit stream) whose
 * codes and random words fit in the L1 cache next to the input. */
#define CHUNK 2048

/* BIT_REVERSE[b]: the bits of byte b in the opposite order (movemask puts the first
 * element in the lowest bit; the wire wants it in the highest). */
#define R2(n) n, n + 2 * 64, n + 1 * 64, n + 3 * 64
#define R4(n) R2(n), R2(n + 2 * 16), R2(n + 1 * 16), R2(n + 3 * 16)
#define R6(n) R4(n), R4(n + 2 * 4), R4(n + 1 * 4), R4(n + 3 * 4)
static const uint8_t BIT_REVERSE[256] = {R6(0), R6(2), R6(1), R6(3)};

/* ---------------------------------------------------------------- sign bits, 1 bit each */

/* Sign bit of element i of an array of `width`-byte little-endian IEEE floats. */
MC_INLINE unsigned sign_of(const uint8_t *bytes, int64_t i, int width) {
    return bytes[i * width + width - 1] >> 7;
}

/* Bytes [first, last) of the packed signs, one element at a time. */
MC_INLINE void pack_signs_scalar(const uint8_t *bytes, int64_t n, int width, int64_t first, uint8_t *out) {
    for (int64_t byte = first; byte * 8 < n; byte++) {
        unsigned packed = 0;
        for (int j = 0; j < 8; j++) {
            int64_t i = byte * 8 + j;
            packed |= (i < n ? sign_of(bytes, i, width) : 0u) << (7 - j);
        }
        out[byte] = (uint8_t)packed;
    }
}

#if defined(__SSE2__)
/* Sign bits of 16 consecutive 4-byte elements, element j in bit j: two saturating narrowings
 * keep each sign, then one movemask. */
MC_INLINE unsigned signs16_of_4byte(const uint8_t *p) {
    __m128i a = _mm_loadu_si128((const __m128i *)p), b = _mm_loadu_si128((const __m128i *)(p + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(p + 32)), d = _mm_loadu_si128((const __m128i *)(p + 48));
    __m128i narrow = _mm_packs_epi16(_mm_packs_epi32(a, b), _mm_packs_epi32(c, d));
    return (unsigned)_mm_movemask_epi8(narrow);
}

MC_INLINE unsigned signs16_of_2byte(const uint8_t *p) {
    __m128i a = _mm_loadu_si128((const __m128i *)p), b = _mm_loadu_si128((const __m128i *)(p + 16));
    return (unsigned)_mm_movemask_epi8(_mm_packs_epi16(a, b));
}
#endif

/* out[0 .. ceil(n/8)) <- the sign bits of n floats of `width` bytes (2, 4 or 8), first
 * element in the top bit: signSGD's wire format (bit set = negative or -0.0). */
MC_EXPORT MC_HOT void mc_pack_signs(const void *data, int64_t n, int width, uint8_t *out) {
    const uint8_t *bytes = (const uint8_t *)data;
    int64_t done = 0;
#if defined(__SSE2__)
    if (width == 4 || width == 2) {
        for (; done + 16 <= n; done += 16) {
            unsigned mask = width == 4 ? signs16_of_4byte(bytes + done * 4) : signs16_of_2byte(bytes + done * 2);
            out[done / 8] = BIT_REVERSE[mask & 0xFF];
            out[done / 8 + 1] = BIT_REVERSE[mask >> 8];
        }
    }
#endif
    pack_signs_scalar(bytes, n, width, done / 8, out);
}

/* 1-bit SGD's encoder in one pass over n fp32 values: the packed sign bits (as
 * mc_pack_signs), stats[0] = sum of x, stats[1] = sum of |x| (fp32 lanes, added into
 * double every 4096 elements) and the number of set sign bits. */
MC_EXPORT MC_HOT void mc_onebit_encode(const float *x, int64_t n, uint8_t *out, double *stats, int64_t *num_negative) {
    const uint8_t *bytes = (const uint8_t *)x;
    double total = 0.0, absolute = 0.0;
    int64_t negative = 0, done = 0;
#if defined(__SSE2__)
    while (done + 16 <= n) {
        int64_t stop = done + 4096 < n ? done + 4096 : n;
        /* 16 independent lanes, so no addition waits on another and the loop vectorises */
        float sum[16] = {0}, sum_abs[16] = {0};
        uint32_t signs[16] = {0};
        for (; done + 16 <= stop; done += 16) {
            unsigned mask = signs16_of_4byte(bytes + done * 4);
            out[done / 8] = BIT_REVERSE[mask & 0xFF];
            out[done / 8 + 1] = BIT_REVERSE[mask >> 8];
            for (int k = 0; k < 16; k++) {
                uint32_t word;
                memcpy(&word, x + done + k, 4);
                signs[k] += word >> 31;
                sum[k] += x[done + k];
                sum_abs[k] += fabsf(x[done + k]);
            }
        }
        for (int k = 0; k < 16; k++) {
            negative += signs[k];
            total += sum[k];
            absolute += sum_abs[k];
        }
    }
#endif
    pack_signs_scalar(bytes, n, 4, done / 8, out);
    for (int64_t i = done; i < n; i++) {
        float magnitude;
        uint32_t bits;
        memcpy(&bits, x + i, 4);
        negative += bits >> 31;
        bits &= 0x7FFFFFFFu;
        memcpy(&magnitude, &bits, 4);
        total += x[i];
        absolute += magnitude;
    }
    stats[0] = total;
    stats[1] = absolute;
    *num_negative = negative;
}

/* out <- values[bit] for each of the n bits of `packed` (first bit = top bit of byte 0):
 * the decoder of every 1-bit format (+-1 signs, a scaled sign, 1-bit SGD's two means).
 * `values` holds two elements of `width` bytes (2, 4 or 8), copied bit for bit. */
MC_EXPORT MC_HOT void mc_decode_bits(const uint8_t *packed, int64_t n, const void *values, int width, void *out) {
    uint8_t table[256 * 8 * 8]; /* byte value -> its 8 output elements */
    const size_t row = (size_t)8 * (size_t)width;
    for (int byte = 0; byte < 256; byte++)
        for (int j = 0; j < 8; j++)
            memcpy(table + byte * row + j * width, (const uint8_t *)values + ((byte >> (7 - j)) & 1) * width, width);
    uint8_t *target = (uint8_t *)out;
    const int64_t full = n / 8;
    switch (width) { /* a constant row size lets the copies compile to vector moves */
    case 2:
        for (int64_t b = 0; b < full; b++) memcpy(target + b * 16, table + packed[b] * 16, 16);
        break;
    case 4:
        for (int64_t b = 0; b < full; b++) memcpy(target + b * 32, table + packed[b] * 32, 32);
        break;
    default:
        for (int64_t b = 0; b < full; b++) memcpy(target + b * row, table + packed[b] * row, row);
    }
    if (n > full * 8)
        memcpy(target + full * row, table + packed[full] * row, (size_t)(n - full * 8) * width);
}

/* ------------------------------------------------------------------ b-bit code streams */

/* out <- `count` codes of `bits` bits (1..8) as a most-significant-first bit stream; count
 * is a multiple of 8 except for the last chunk, whose final byte is zero-padded. */
MC_INLINE void pack_codes(const uint8_t *codes, int64_t count, int bits, uint8_t *out) {
    if (bits == 8) {
        memcpy(out, codes, count);
    } else if (bits == 4) {
        int64_t pairs = count / 2;
        for (int64_t k = 0; k < pairs; k++) out[k] = (uint8_t)(codes[2 * k] << 4 | codes[2 * k + 1]);
        if (count & 1) out[pairs] = (uint8_t)(codes[count - 1] << 4);
    } else if (bits == 2) {
        int64_t quads = count / 4;
        for (int64_t k = 0; k < quads; k++)
            out[k] = (uint8_t)(codes[4 * k] << 6 | codes[4 * k + 1] << 4 | codes[4 * k + 2] << 2 | codes[4 * k + 3]);
        if (count & 3) {
            unsigned last = 0;
            for (int64_t i = quads * 4; i < count; i++) last |= (unsigned)codes[i] << (6 - 2 * (i - quads * 4));
            out[quads] = (uint8_t)last;
        }
    } else {
        uint32_t pending = 0; /* the low `held` bits are not yet written */
        int held = 0;
        int64_t written = 0;
        for (int64_t i = 0; i < count; i++) {
            pending = pending << bits | codes[i];
            held += bits;
            while (held >= 8) {
                held -= 8;
                out[written++] = (uint8_t)(pending >> held);
            }
        }
        if (held) out[written] = (uint8_t)(pending << (8 - held));
    }
}

/* codes <- `count` codes of `bits` bits read from the stream at `packed` (byte aligned). */
MC_INLINE void unpack_codes(const uint8_t *packed, int64_t count, int bits, uint8_t *codes) {
    if (bits == 8) {
        memcpy(codes, packed, count);
    } else if (bits == 4) {
        const int64_t whole = count / 2;
        for (int64_t k = 0; k < whole; k++) {
            codes[2 * k] = packed[k] >> 4;
            codes[2 * k + 1] = packed[k] & 0xF;
        }
        if (count & 1) codes[count - 1] = packed[whole] >> 4;
    } else if (bits == 2) {
        const int64_t whole = count / 4;
        for (int64_t k = 0; k < whole; k++) {
            codes[4 * k] = packed[k] >> 6;
            codes[4 * k + 1] = packed[k] >> 4 & 0x3;
            codes[4 * k + 2] = packed[k] >> 2 & 0x3;
            codes[4 * k + 3] = packed[k] & 0x3;
        }
        for (int64_t i = whole * 4; i < count; i++) codes[i] = packed[whole] >> (6 - 2 * (i - whole * 4)) & 0x3;
    } else {
        const unsigned mask = (1u << bits) - 1;
        uint32_t pending = 0;
        int held = 0;
        int64_t read = 0;
        for (int64_t i = 0; i < count; i++) {
            while (held < bits) {
                pending = pending << 8 | packed[read++];
                held += 8;
            }
            held -= bits;
            codes[i] = (uint8_t)(pending >> held & mask);
        }
    }
}

/* --------------------------------------------------------------- stochastic quantisation */

/* 16-bit random lanes for elements [first, first + count) of a call keyed by `key`: word w
 * is the counter key + w through the last four steps of Wellons' lowbias32 (multiply,
 * xor-shift 16, multiply, xor-shift 16), and element i takes half i % 2 of word i / 2 as
 * it lies in memory, exactly as quantize.random_int16 views its int32 words as int16.
 * `first` is even. */
MC_INLINE void random_lanes(uint32_t key, int64_t first, int64_t count, int16_t *lanes) {
    uint32_t words[CHUNK / 2];
    const int64_t num_words = (count + 1) / 2;
    const uint32_t start = key + (uint32_t)(first / 2);
    for (int64_t w = 0; w < num_words; w++) {
        uint32_t h = start + (uint32_t)w;
        h *= 0x7FEB352Du;
        h ^= h >> 16;
        h *= 0x846CA68Bu;
        h ^= h >> 16;
        words[w] = h;
    }
    memcpy(lanes, words, (size_t)count * 2);
}

/* Per-bucket scale of TernGrad: peaks[b] = max |x| over bucket b (a NaN anywhere makes it
 * NaN).  |x| compared as the integer bits of the magnitude, which order like the floats
 * (NaN above inf); the maximum of a set does not depend on the order, so this is the bit
 * for bit value of torch's two reductions (a bucket of zeros gives +0.0). */
MC_EXPORT MC_HOT void mc_bucket_peaks(const float *x, int64_t n, int64_t bucket, float *peaks) {
    for (int64_t start = 0, b = 0; start < n; start += bucket, b++) {
        const int64_t stop = start + bucket < n ? start + bucket : n;
        int32_t peak = 0;
        for (int64_t i = start; i < stop; i++) {
            uint32_t bits;
            memcpy(&bits, x + i, 4);
            int32_t magnitude = (int32_t)(bits & 0x7FFFFFFFu);
            peak = magnitude > peak ? magnitude : peak;
        }
        memcpy(peaks + b, &peak, 4);
    }
}

/* ||x[start, stop)||_2 with the squares summed in double, where no fp32 value overflows
 * (3.4e38^2 < 1.8e308) or underflows to zero (1.4e-45^2 > 2.2e-308). */
MC_INLINE double norm_in_double(const float *x, int64_t start, int64_t stop) {
    double squares = 0.0;
    for (int64_t i = start; i < stop; i++) squares += (double)x[i] * (double)x[i];
    return sqrt(squares);
}

/* Per-bucket scale of QSGD: norms[b] = ||bucket b||_2 in fp32.  Squares are summed in 16
 * independent fp32 lanes (so the loop vectorises; the order differs from torch's, hence
 * the last bit can too) and the lanes in double.  A bucket whose fp32 result is not finite
 * or below 1e-15 (squares that overflow above ~1e19 or vanish below ~1e-19) is summed
 * again in double, like the torch path's rescue of such buckets. */
MC_EXPORT MC_HOT void mc_bucket_norms(const float *x, int64_t n, int64_t bucket, float *norms) {
    for (int64_t start = 0, b = 0; start < n; start += bucket, b++) {
        const int64_t stop = start + bucket < n ? start + bucket : n;
        float lanes[16] = {0};
        int64_t i = start;
        for (; i + 16 <= stop; i += 16)
            for (int k = 0; k < 16; k++) lanes[k] += x[i + k] * x[i + k];
        double squares = 0.0;
        for (int k = 0; k < 16; k++) squares += lanes[k];
        for (; i < stop; i++) squares += (double)x[i] * (double)x[i];
        float norm = (float)sqrt(squares);
        if (!(norm >= 1e-15f && norm <= 3.0e38f)) norm = (float)norm_in_double(x, start, stop);
        norms[b] = norm;
    }
}

/* QSGD's and TernGrad's encoder: code c = min(trunc(x*f_b + (offset + 0.5) + r*2^-16), 2*offset)
 * for each x of bucket b, r the element's signed 16-bit random lane; the n codes are
 * written packed in `bits` bits.  Each step is one fp32 operation, as in
 * quantize.stochastic_codes (mul, add, add, truncating conversion, clamp).  f_b*x lies in
 * [-offset, offset], so the sum is > -1 and truncates to a code >= 0. */
MC_EXPORT MC_HOT void mc_stochastic_codes(const float *x, int64_t n, int64_t bucket, const float *factors,
                                   int offset, uint32_t key, int bits, uint8_t *out) {
    uint8_t codes[CHUNK];
    int16_t lanes[CHUNK];
    const float shift = (float)offset + 0.5f;
    const int top = 2 * offset;
    for (int64_t first = 0; first < n; first += CHUNK) {
        const int64_t count = n - first < CHUNK ? n - first : CHUNK;
        random_lanes(key, first, count, lanes);
        for (int64_t i = 0; i < count;) {
            const int64_t b = (first + i) / bucket;
            const int64_t stop = (b + 1) * bucket - first < count ? (b + 1) * bucket - first : count;
            const float factor = factors[b];
            for (; i < stop; i++) {
                float level = x[first + i] * factor;
                level = level + shift;
                level = level + (float)lanes[i] * 0x1p-16f;
                int code = (int)level;
                codes[i] = (uint8_t)(code < top ? code : top);
            }
        }
        pack_codes(codes, count, bits, out + first * bits / 8);
    }
}

/* The decoder of mc_stochastic_codes: out = (float)(c - offset) * scales[b] for each code c
 * of bucket b (one rounding: the product). */
MC_EXPORT MC_HOT void mc_dequantize(const uint8_t *packed, int64_t n, int bits, int64_t bucket, const float *scales,
                             int offset, float *out) {
    uint8_t codes[CHUNK];
    for (int64_t first = 0; first < n; first += CHUNK) {
        const int64_t count = n - first < CHUNK ? n - first : CHUNK;
        unpack_codes(packed + first * bits / 8, count, bits, codes);
        for (int64_t i = 0; i < count;) {
            const int64_t b = (first + i) / bucket;
            const int64_t stop = (b + 1) * bucket - first < count ? (b + 1) * bucket - first : count;
            const float scale = scales[b];
            for (; i < stop; i++) out[first + i] = (float)((int)codes[i] - offset) * scale;
        }
    }
}

/* DGC's momentum correction (mergecomp/memories/dgc.py) in one pass instead of two, with
 * the block peaks of the new velocity that DGC's selection reads next (a third pass), so
 * the sampled threshold's candidates cost no further read of the whole group:
 *
 *   plain:     u' = fma(u, m, g)        v' = v + u'        (torch.add(g, u, alpha=m): torch's
 *                                                           vectorised CPU add with alpha is a
 *                                                           fused multiply-add)
 *   Nesterov:  u' = (u + g) * m         v' = (v + u') + g
 *
 * with g = gradient * scale, local gradient clipping's product (torch: tensor * scale; a
 * scale of 1 leaves every value as it is), so a clipped gradient costs no pass of its own.
 *
 * peaks[b] = max |v'| over block b of `bucket` elements, for the n / bucket whole blocks
 * only, compared as in mc_bucket_peaks (so a NaN makes its block's peak NaN).  The fma is
 * explicit (fmaf, exact wherever it runs); on x86-64 a copy compiled for AVX2 with FMA is
 * chosen at run time when the processor has both, as a libm fmaf per element is several
 * times slower than the memory traffic. */
MC_INLINE int32_t magnitude_bits(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    return (int32_t)(bits & 0x7FFFFFFFu);
}

#define DGC_ACCUMULATE_BODY                                                                  \
    const int64_t whole = bucket > 0 ? n / bucket : 0;                                      \
    int64_t i = 0;                                                                          \
    for (int64_t b = 0; b <= whole; b++) {                                                  \
        const int64_t stop = b < whole ? i + bucket : n;                                    \
        int32_t peak = 0;                                                                   \
        if (nesterov) {                                                                     \
            for (; i < stop; i++) {                                                         \
                const float gi = g[i] * scale;                                              \
                const float un = (u[i] + gi) * m;                                           \
                const float vn = (v[i] + un) + gi;                                          \
                u_out[i] = un;                                                              \
                v_out[i] = vn;                                                              \
                const int32_t mag = magnitude_bits(vn);                                     \
                peak = mag > peak ? mag : peak;                                             \
            }                                                                               \
        } else {                                                                            \
            for (; i < stop; i++) {                                                         \
                const float un = fmaf(u[i], m, g[i] * scale);                               \
                const float vn = v[i] + un;                                                 \
                u_out[i] = un;                                                              \
                v_out[i] = vn;                                                              \
                const int32_t mag = magnitude_bits(vn);                                     \
                peak = mag > peak ? mag : peak;                                             \
            }                                                                               \
        }                                                                                   \
        if (b < whole) memcpy(peaks + b, &peak, 4);                                         \
    }

#define DGC_ACCUMULATE_ARGS                                                                  \
    const float *restrict g, float scale, const float *restrict u, const float *restrict v, \
    int64_t n, float m, int nesterov, float *restrict u_out, float *restrict v_out, int64_t bucket,    \
    float *restrict peaks

static void dgc_accumulate_plain(DGC_ACCUMULATE_ARGS) { DGC_ACCUMULATE_BODY }

#if defined(__x86_64__) && defined(__GNUC__)
#define MC_HAS_FMA_COPY 1
__attribute__((target("avx2,fma"))) static void dgc_accumulate_fma(DGC_ACCUMULATE_ARGS) {
    DGC_ACCUMULATE_BODY
}
#endif

MC_EXPORT void mc_dgc_accumulate(const float *g, float scale, const float *u, const float *v, int64_t n, float m,
                                 int nesterov, float *u_out, float *v_out, int64_t bucket, float *peaks) {
#ifdef MC_HAS_FMA_COPY
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        dgc_accumulate_fma(g, scale, u, v, n, m, nesterov, u_out, v_out, bucket, peaks);
        return;
    }
#endif
    dgc_accumulate_plain(g, scale, u, v, n, m, nesterov, u_out, v_out, bucket, peaks);
}

/* The sparsifiers' threshold selection: the ascending indices i with |x[i]| >= t, reading
 * only the whole blocks of `bucket` elements whose peak passes (peaks[b] >= t) and testing
 * the tail after them element by element.  The torch path gathers the passing blocks, takes
 * |.|, compares and compacts: four passes over them and three temporaries; here one read.
 * A NaN never passes, and a NaN t selects nothing; a block whose peak is NaN (it holds a
 * NaN) is tested element by element, so its other elements pass as anywhere else: the
 * indices are exactly those of |x[i]| >= t, as the GPU's compaction finds them.
 *
 * Writes at most `capacity` indices into out and returns how many pass: a count above
 * capacity asks the caller for a larger out (the indices written are then a prefix).
 * Inside a block the store is unconditional (the count advances only on a hit), so the
 * loop has no branch; a block that might overflow out takes the checked loop instead. */
MC_EXPORT MC_HOT int64_t mc_select_at_least(const float *x, int64_t n, int64_t bucket, const float *peaks,
                                            float t, int64_t *out, int64_t capacity) {
    const int64_t whole = bucket > 0 ? n / bucket : 0;
    int64_t count = 0;
    for (int64_t b = 0; b <= whole; b++) {
        const int64_t start = b * bucket;
        const int64_t stop = b < whole ? start + bucket : n;
        if (b < whole && peaks[b] < t) continue;
        if (count + (stop - start) <= capacity) {
            for (int64_t i = start; i < stop; i++) {
                out[count] = i;
                count += fabsf(x[i]) >= t;
            }
        } else {
            for (int64_t i = start; i < stop; i++) {
                if (fabsf(x[i]) >= t) {
                    if (count < capacity) out[count] = i;
                    count++;
                }
            }
        }
    }
    return count;
}
