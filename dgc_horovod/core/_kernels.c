/* The C engine of DGC: the steps of dgc_horovod/core/engine.py on host memory, one call per
 * bucket, bit for bit what the reference engine (engine.OpsEngine) gives. Its Python side is
 * dgc_horovod/core/c_engine.py, which hands over raw addresses (numpy's ctypes.data, torch's
 * data_ptr()), so the core stays free of any framework import.
 *
 * Entry points (pointers are addresses as Python ints; every array is contiguous):
 *   configure(constants)  the format's and the rule's constants, by name (a dict built by
 *       c_engine.py from wire.py and sparsify.py at import): nothing of them is written here.
 *   compress(rows, nrows, scales, u, v, nflat, m, mode, masking, delta16, fp16,
 *            payload, nwords, sel, vals, usent, nentries, threads)
 *       a bucket's steps 1-6 (engine.py's docstring) for nrows segments of the flat float32
 *       buffers u (0 with momentum 0) and v of nflat elements; rows: int64, NR fields per
 *       segment (R_* below: the Step's sizes, and the outputs count, finite, the float16 counts
 *       and dropped), scales: float64 clipping factors. Writes every word of payload[nwords]
 *       and every entry of sel (int64) / vals / usent (float32, usent 0 without masking).
 *   decode(words, total, numel, ranks, out, scale, inv) -> 0, 1 (non-finite) or -1 (malformed)
 *       OpsEngine.decode: the ranks' payloads checked as wire.read_payload checks them, out
 *       zeroed, every rank's entries added in rank order, the sent positions times (float)inv.
 *   split_bucket(words, total, ranks, members, spans) -> entries, or -1 (malformed)
 *       wire.split_bucket's walk: (member, start, words) per payload into int64 spans.
 *   BLOCK  (module constant) engine.BLOCK as compiled here; c_engine.py refuses another.
 *
 * Built with -O3 -ffp-contract=off: every product and sum is rounded to float32 on its own, as
 * the contract says (accumulate.momentum_correction). Work is spread over a persistent pool of
 * threads; results do not depend on the number of threads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define X86 1
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))
/* engine.BLOCK: the segments start at multiples of it and the update records the largest
 * magnitude of every block. A compile-time constant so that the block loops vectorise. */
#define BLOCK 64

typedef int64_t i64;
typedef uint32_t u32;

/* ---- the constants of wire.py and sparsify.py (configure) ------------------------------- */
static struct {
    u32 MAGIC_V3, BUCKET_MAGIC, HEADER_WORDS, ESCAPE, FLAG_NONFINITE, INDEX_CODES, INDEX_INT32,
        INDEX_DELTA16, VALUE_CODES, VALUES_FP32, VALUES_FP16, MIX_M1, MIX_M2, GOLDEN, MIN_BITS;
} K;
static int configured;
#define CONSTANT(name) {#name, &K.name}
static const struct { const char *name; u32 *at; } CONSTANTS[] = {
    CONSTANT(MAGIC_V3), CONSTANT(BUCKET_MAGIC), CONSTANT(HEADER_WORDS), CONSTANT(ESCAPE),
    CONSTANT(FLAG_NONFINITE), CONSTANT(INDEX_CODES), CONSTANT(INDEX_INT32),
    CONSTANT(INDEX_DELTA16), CONSTANT(VALUE_CODES), CONSTANT(VALUES_FP32), CONSTANT(VALUES_FP16),
    CONSTANT(MIX_M1), CONSTANT(MIX_M2), CONSTANT(GOLDEN), CONSTANT(MIN_BITS)};
#define NCONSTANTS (sizeof CONSTANTS / sizeof CONSTANTS[0])
/* word 3 of a payload: flags | index encoding << 8 | value dtype << 16 (wire.py's docstring) */
#define WORD3(flags, icode, vcode) ((u32)(flags) | (u32)(icode) << 8 | (u32)(vcode) << 16)

/* ---- small rules -------------------------------------------------------------------------- */
ALWAYS_INLINE u32 bits_of(float x) { u32 b; memcpy(&b, &x, 4); return b; }
ALWAYS_INLINE float float_of(u32 b) { float x; memcpy(&x, &b, 4); return x; }
/* sparsify.magnitude_bits: |x| as its bits (non-negative floats order as their bits, NaN above
 * +inf) */
ALWAYS_INLINE u32 mag(float x) { return bits_of(x) & 0x7fffffffu; }

/* sparsify.mix32 (the lowbias32 hash) and sparsify.sample_positions' i-th position */
ALWAYS_INLINE u32 mix32(u32 x) {
    x ^= x >> 16; x *= K.MIX_M1; x ^= x >> 15; x *= K.MIX_M2; return x ^ (x >> 16);
}
ALWAYS_INLINE i64 sample_position(u32 base, i64 i, i64 n) {
    return (i64)(((uint64_t)mix32(base + (u32)i * K.GOLDEN) * (uint64_t)n) >> 32);
}

/* float32 -> float16 bits as NumPy's cast (precision.round_to_fp16, wire's float16 values):
 * round to nearest even, subnormals, ±inf from 65520 on, NaN keeps its top payload bits. */
static uint16_t to_half(u32 f) {
    const u32 sign = (f >> 16) & 0x8000u, a = f & 0x7fffffffu;
    if (a > 0x7f800000u) {                                   /* NaN, still a NaN */
        u32 h = 0x7c00u | ((a & 0x7fffffu) >> 13);
        return (uint16_t)(sign | (h == 0x7c00u ? 0x7c01u : h));
    }
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  /* rounds beyond 65504 */
    u32 q, rem, half;
    if (a >= 0x38800000u) {                                  /* a normal float16 */
        const u32 r = a - 0x38000000u;                       /* exponent bias 127 -> 15 */
        q = r >> 13; rem = r & 0x1fffu; half = 0x1000u;
    } else if (a >= 0x33000000u) {                           /* a float16 subnormal (or 2**-14) */
        const u32 e = a >> 23, m = (a & 0x7fffffu) | 0x800000u, sh = 126 - e;
        q = m >> sh; rem = m & ((1u << sh) - 1); half = 1u << (sh - 1);
    } else {
        return (uint16_t)sign;                               /* at most 2**-25: zero */
    }
    if (rem > half || (rem == half && (q & 1))) q++;        /* a carry makes the next binade */
    return (uint16_t)(sign | q);
}

/* float16 bits -> float32, exact */
static float from_half(u32 h) {
    const u32 sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 31) return float_of(sign | 0x7f800000u | (m << 13));
    if (e) return float_of(sign | ((e + 112) << 23) | (m << 13));
    if (!m) return float_of(sign);
    int sh = 0;                                              /* subnormal: normalise m */
    u32 mm = m;
    while (!(mm & 0x400u)) { mm <<= 1; sh++; }
    return float_of(sign | ((u32)(113 - sh) << 23) | ((mm & 0x3ffu) << 13));
}

/* The k-th largest (1-based) of a[0..n): quickselect, reorders a so that a[0..k-1) >= a[k-1] >=
 * a[k..n). */
static u32 kth_largest(u32 *a, i64 n, i64 k) {
    i64 lo = 0, hi = n - 1;
    const i64 want = k - 1;
    while (lo < hi) {
        const i64 mid = lo + (hi - lo) / 2;
        const u32 x = a[lo], y = a[mid], z = a[hi];
        const u32 p = x > y ? (y > z ? y : (x > z ? z : x)) : (x > z ? x : (y > z ? z : y));
        i64 i = lo, j = hi;
        while (i <= j) {                                     /* Hoare partition, descending */
            while (a[i] > p) i++;
            while (a[j] < p) j--;
            if (i <= j) { const u32 t = a[i]; a[i] = a[j]; a[j] = t; i++; j--; }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return a[want];
    }
    return a[want];
}

/* The k-th largest of a[0..n) for k much smaller than n: a min-heap of the k largest seen, in
 * a[0..k) (most values are below its root and cost one comparison); returns its root. */
static u32 top_heap(u32 *a, i64 n, i64 k) {
    for (i64 i = 1; i < k; i++)                               /* a[0..k) made a min-heap */
        for (i64 c = i; c > 0 && a[(c - 1) / 2] > a[c]; c = (c - 1) / 2) {
            const u32 t = a[c]; a[c] = a[(c - 1) / 2]; a[(c - 1) / 2] = t;
        }
    for (i64 i = k; i < n; i++) {
        const u32 x = a[i];
        if (x <= a[0]) continue;
        a[i] = a[0];                                          /* (a[k..n) keeps every value) */
        i64 p = 0;
        for (;;) {                                            /* x sifted down from the root */
            i64 c = 2 * p + 1;
            if (c >= k) break;
            if (c + 1 < k && a[c + 1] < a[c]) c++;
            if (a[c] >= x) break;
            a[p] = a[c];
            p = c;
        }
        a[p] = x;
    }
    return a[0];
}

/* Grow-only per-thread buffers (the pool's workers and every calling thread have their own):
 * slots 0-2 for a segment's selection (the candidates' positions and magnitudes, a copy of the
 * magnitudes to select in), slot 3 for the calling thread's buffers of a bucket. */
static void *scratch(int slot, size_t bytes) {
    static __thread void *buf[4];
    static __thread size_t cap[4];
    bytes = bytes ? bytes : 1;
    if (bytes > cap[slot]) {
        void *p = realloc(buf[slot], bytes);
        if (!p) return NULL;
        buf[slot] = p;
        cap[slot] = bytes;
    }
    return buf[slot];
}

/* ---- the passes over memory, each compiled twice: plain, and for AVX2 (chosen at run time) */

/* Step 1, check: whether g[lo..hi) holds no NaN/Inf */
ALWAYS_INLINE int finite_body(const float *restrict g, i64 lo, i64 hi) {
    u32 mx = 0;
    for (i64 i = lo; i < hi; i++) { const u32 b = mag(g[i]); mx = b > mx ? b : mx; }
    return mx < 0x7f800000u;
}

/* Step 2, accumulate (accumulate.momentum_correction), over the blocks [b0, b1) of a segment of
 * n elements, each product and sum rounded on its own; records each block's largest magnitude
 * of the new v in bmax[b] (which step 3 uses to skip the blocks that cannot reach a level).
 * mode 0: v ← v + s·g;  1: u ← m·u + s·g, v ← v + u;  2 (Nesterov): v ← (v + s·g) + m·u. */
ALWAYS_INLINE void update_body(const int mode, const float *restrict g, float *restrict u,
                               float *restrict v, i64 n, i64 b0, i64 b1, float m, float s,
                               u32 *restrict bmax) {
    for (i64 b = b0; b < b1; b++) {
        const i64 i0 = b * BLOCK, len = n - i0 < BLOCK ? n - i0 : BLOCK;
        const float *restrict gb = g + i0;
        float *restrict vb = v + i0;
        u32 mx = 0;
        /* (mode is a constant in each instantiation: each branch is a plain loop that the
         *  compiler vectorises) */
        if (mode == 0) {
            for (i64 i = 0; i < len; i++) {
                const float nv = vb[i] + s * gb[i];
                vb[i] = nv;
                const u32 a = mag(nv); mx = a > mx ? a : mx;
            }
        } else if (mode == 1) {
            float *restrict ub = u + i0;
            for (i64 i = 0; i < len; i++) {
                const float nu = m * ub[i] + s * gb[i], nv = vb[i] + nu;
                ub[i] = nu; vb[i] = nv;
                const u32 a = mag(nv); mx = a > mx ? a : mx;
            }
        } else {
            float *restrict ub = u + i0;
            for (i64 i = 0; i < len; i++) {
                const float sg = s * gb[i], nu = m * ub[i] + sg, nv = (vb[i] + sg) + m * nu;
                ub[i] = nu; vb[i] = nv;
                const u32 a = mag(nv); mx = a > mx ? a : mx;
            }
        }
        bmax[b] = mx;
    }
}

/* Step 3's candidates in one block: the positions i0 + i (i < len) with magnitude >= level,
 * ascending, appended to pos / bits from entry c on while c < cap; returns the new c. */
ALWAYS_INLINE i64 hits_body(const float *p, i64 len, u32 level, i64 i0, u32 *pos, u32 *bits,
                            i64 c, i64 cap) {
    for (i64 i = 0; i < len && c < cap; i++) {
        const u32 a = mag(p[i]);
        if (a >= level) { pos[c] = (u32)(i0 + i); bits[c] = a; c++; }
    }
    return c;
}

#define UPDATE_DISPATCH(mode, ...)                                                           \
    switch (mode) {                                                                          \
    case 0: update_body(0, __VA_ARGS__); break;                                              \
    case 1: update_body(1, __VA_ARGS__); break;                                              \
    default: update_body(2, __VA_ARGS__); break;                                             \
    }
#define PASSES(suffix, target)                                                               \
    target static int finite_##suffix(const float *g, i64 lo, i64 hi)                       \
    { return finite_body(g, lo, hi); }                                                       \
    target static void update_##suffix(int mode, const float *g, float *u, float *v, i64 n,  \
                                       i64 b0, i64 b1, float m, float s, u32 *bmax)          \
    { UPDATE_DISPATCH(mode, g, u, v, n, b0, b1, m, s, bmax) }
PASSES(plain, )

#ifdef X86
PASSES(avx2, __attribute__((target("avx2"))))
/* eight magnitudes compared at once; only the lanes that reach the level are visited, in
 * ascending order (so the output is the plain loop's) */
__attribute__((target("avx2"))) static i64 hits_avx2(const float *p, i64 len, u32 level,
                                                    i64 i0, u32 *pos, u32 *bits, i64 c, i64 cap) {
    const __m256i below = _mm256_set1_epi32((int)(level - 1));
    const __m256i absmask = _mm256_set1_epi32(0x7fffffff);
    i64 i = 0;
    for (; i + 8 <= len && c + 8 <= cap; i += 8) {
        const __m256i a = _mm256_and_si256(_mm256_castps_si256(_mm256_loadu_ps(p + i)), absmask);
        unsigned hit = (unsigned)_mm256_movemask_ps(
            _mm256_castsi256_ps(_mm256_cmpgt_epi32(a, below)));
        while (hit) {
            const int l = __builtin_ctz(hit);
            hit &= hit - 1;
            pos[c] = (u32)(i0 + i + l); bits[c] = mag(p[i + l]); c++;
        }
    }
    return hits_body(p + i, len - i, level, i0 + i, pos, bits, c, cap);
}
static i64 hits_plain(const float *p, i64 len, u32 level, i64 i0, u32 *pos, u32 *bits, i64 c,
                      i64 cap) { return hits_body(p, len, level, i0, pos, bits, c, cap); }
static int have_avx2(void) {
    static int known = -1;
    if (known < 0) { __builtin_cpu_init(); known = __builtin_cpu_supports("avx2"); }
    return known;
}
#define PICK(fn) (have_avx2() ? fn##_avx2 : fn##_plain)
#else
static i64 hits_plain(const float *p, i64 len, u32 level, i64 i0, u32 *pos, u32 *bits, i64 c,
                      i64 cap) { return hits_body(p, len, level, i0, pos, bits, c, cap); }
#define PICK(fn) fn##_plain
#endif

/* ---- a persistent pool of worker threads
 * parallel(fn, ctx, ntasks, threads) runs fn(ctx, 0..ntasks) on the calling thread and up to
 * threads-1 pool workers, which take task indices from a shared counter. Workers are started on
 * first use. Between regions a worker spins for a short while (SPIN pause instructions, about
 * 0.1 ms) and then sleeps on a condition variable: regions that follow each other closely (the
 * phases of one bucket, the buckets of one step) do not pay for waking a sleeping thread, which
 * on a virtual machine can cost tens of microseconds, and an idle pool uses no CPU. One region
 * at a time: a caller that finds the pool busy (another Python thread) runs its tasks inline.
 * After fork() the child starts with an empty pool. */
#define MAX_THREADS 64
#define SPIN 4096
/* P.gen is (region sequence number << 8) | workers wanted in that region: a worker reads both in
 * one load, so it cannot take one region's number with another region's count (a worker left
 * out of a region that ends while it looks, and a wider region started right after, must not
 * join the new region as if it were the old one and leave it twice). */
#define WANTED_MASK 0xffUL
typedef void (*task_fn)(void *ctx, i64 task);
static struct {
    pthread_mutex_t use, mu;
    pthread_cond_t go, done;
    int started, running;
    unsigned long gen, seen0[MAX_THREADS];
    task_fn fn; void *ctx; i64 ntasks, next;
    unsigned csr;               /* the caller's SSE control word (denormal flushing, rounding) */
} P = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
       PTHREAD_COND_INITIALIZER, 0, 0, 0, {0}, NULL, NULL, 0, 0, 0};

/* The floating-point mode of the thread that starts a region, for its workers: results must not
 * depend on which thread runs a task (torch.set_flush_denormal changes only its own thread). */
#define CSR_FLAGS 0x3fu          /* MXCSR's sticky exception flags: status, not mode */
ALWAYS_INLINE unsigned fp_mode(void) {
#ifdef X86
    return _mm_getcsr() & ~CSR_FLAGS;
#else
    return 0;
#endif
}
ALWAYS_INLINE void set_fp_mode(unsigned csr) {
#ifdef X86
    const unsigned now = _mm_getcsr();
    if ((now & ~CSR_FLAGS) != csr) _mm_setcsr((now & CSR_FLAGS) | csr);
#else
    (void)csr;
#endif
}
ALWAYS_INLINE void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void drain(void) {
    for (;;) {
        const i64 t = __atomic_fetch_add(&P.next, 1, __ATOMIC_RELAXED);
        if (t >= P.ntasks) return;
        P.fn(P.ctx, t);
    }
}

static void *pool_worker(void *arg) {
    const int id = (int)(intptr_t)arg;
    pthread_mutex_lock(&P.mu);
    unsigned long seen = P.seen0[id];
    pthread_mutex_unlock(&P.mu);
    for (;;) {
        unsigned long g = __atomic_load_n(&P.gen, __ATOMIC_ACQUIRE);
        for (int i = 0; g == seen && i < SPIN; i++) {
            cpu_relax();
            g = __atomic_load_n(&P.gen, __ATOMIC_ACQUIRE);
        }
        if (g == seen) {
            pthread_mutex_lock(&P.mu);
            while ((g = __atomic_load_n(&P.gen, __ATOMIC_ACQUIRE)) == seen)
                pthread_cond_wait(&P.go, &P.mu);
            pthread_mutex_unlock(&P.mu);
        }
        seen = g;
        if (id >= (int)(g & WANTED_MASK)) continue;    /* this region's own count */
        set_fp_mode(P.csr);
        drain();
        if (__atomic_sub_fetch(&P.running, 1, __ATOMIC_ACQ_REL) == 0) {
            pthread_mutex_lock(&P.mu);
            pthread_cond_signal(&P.done);
            pthread_mutex_unlock(&P.mu);
        }
    }
    return NULL;
}

static void pool_after_fork_child(void) {
    const pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
    const pthread_cond_t c = PTHREAD_COND_INITIALIZER;
    P.use = m; P.mu = m; P.go = c; P.done = c;
    P.started = P.running = 0;
}

static void parallel(task_fn fn, void *ctx, i64 ntasks, int threads) {
    i64 T = threads < ntasks ? threads : ntasks;
    if (T > MAX_THREADS) T = MAX_THREADS;
    if (T <= 1 || pthread_mutex_trylock(&P.use) != 0) {
        for (i64 t = 0; t < ntasks; t++) fn(ctx, t);
        return;
    }
    pthread_mutex_lock(&P.mu);
    while (P.started < T - 1) {
        pthread_t th;
        P.seen0[P.started] = P.gen;
        if (pthread_create(&th, NULL, pool_worker, (void *)(intptr_t)P.started) != 0) break;
        pthread_detach(th);
        P.started++;
    }
    const int W = (int)(T - 1 < P.started ? T - 1 : P.started);
    P.fn = fn; P.ctx = ctx; P.ntasks = ntasks; P.next = 0; P.csr = fp_mode();
    __atomic_store_n(&P.running, W, __ATOMIC_RELAXED);
    /* a new generation word carrying W: publishes the fields above */
    __atomic_store_n(&P.gen, (((P.gen >> 8) + 1) << 8) | (unsigned long)W, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&P.go);
    pthread_mutex_unlock(&P.mu);
    drain();
    for (int i = 0; __atomic_load_n(&P.running, __ATOMIC_ACQUIRE) > 0 && i < SPIN; i++)
        cpu_relax();
    if (__atomic_load_n(&P.running, __ATOMIC_ACQUIRE) > 0) {
        pthread_mutex_lock(&P.mu);
        while (__atomic_load_n(&P.running, __ATOMIC_ACQUIRE) > 0)
            pthread_cond_wait(&P.done, &P.mu);
        pthread_mutex_unlock(&P.mu);
    }
    pthread_mutex_unlock(&P.use);
}

/* ---- compress: one bucket
 * A row per segment (int64 fields): its gradient's address, its offset in the flat buffers, the
 * Plan (n, k, s, ks1, ks2, cap), the samples' base, where its payload starts and its words, its
 * payload's index section words, where its entries start; then the outputs. */
enum { R_G, R_OFF, R_N, R_K, R_S, R_KS1, R_KS2, R_CAP, R_BASE, R_PAY, R_WORDS, R_IW, R_START,
       R_COUNT, R_FINITE, R_OVER, R_FLUSH, R_DROP, NR };

/* Three regions of the pool per bucket. A segment of at most SMALL_BLOCKS blocks (262,144
 * elements: v is 1 MiB) is one task of the second, from its check to its payload, while it is in
 * cache. A larger one is checked in chunks of CHUNK elements in the first region (which also sorts
 * its samples by chunk), then (finite) updated in chunks in the second, each chunk taking the
 * samples that fall in it while it is in cache, then selected and encoded by one task in the
 * third. Largest first, so that the threads finish together. */
#define SMALL_BLOCKS 4096
#define CHUNK (1 << 16)
#define CHUNK_BLOCKS (CHUNK / BLOCK)

typedef struct { i64 row, chunk; } task_t;       /* chunk -1: the whole segment / its samples */
typedef struct { i64 n, row; } size_row;
typedef struct {
    i64 *rows; const double *scales;
    float *u, *v; float m; int mode, masking, delta16, fp16;
    int32_t *pay; i64 *sel; float *vals, *usent;
    u32 *bmax;                     /* the largest magnitude of each block of the flat buffers */
    u32 *smp; i64 *soff;           /* the sampled magnitudes, each segment's from soff[j] */
    u32 *spos, *sidx;              /* a large segment's samples by chunk: positions, numbers, */
    i64 *cstart, *coff;            /* chunk c's from cstart[coff[j] + c] */
    size_row *order;               /* the segments, largest first */
    task_t *tasks;                 /* a region's */
    char *bad;                     /* a NaN/Inf found in a large segment's gradient */
    int rc;
} bucket_t;

#define ROW(b, j) ((b)->rows + NR * (j))
ALWAYS_INLINE i64 blocks_of(const i64 *row) { return (row[R_N] + BLOCK - 1) / BLOCK; }
ALWAYS_INLINE i64 chunks_of(const i64 *row) { return (row[R_N] + CHUNK - 1) / CHUNK; }
ALWAYS_INLINE int is_large(const i64 *row) { return blocks_of(row) > SMALL_BLOCKS; }
#define MIN(a, b) ((a) < (b) ? (a) : (b))

/* Step 3, sample (small segments): the magnitudes at the s sampled positions */
static void sample_all(const bucket_t *b, i64 j) {
    const i64 *row = ROW(b, j);
    const float *v = b->v + row[R_OFF];
    const i64 n = row[R_N], s = row[R_S];
    const u32 base = (u32)row[R_BASE];
    u32 *smp = b->smp + b->soff[j];
    for (i64 i = 0; i < s; i++) smp[i] = mag(v[sample_position(base, i, n)]);
}

/* Step 3, sample (large segments), before the update: the sampled positions sorted by the chunk
 * they fall in (spos, with their sample numbers in sidx, chunk c's from cstart[c]) */
static void sort_samples(bucket_t *b, i64 j) {
    const i64 *row = ROW(b, j), n = row[R_N], s = row[R_S], chunks = chunks_of(row);
    const u32 base = (u32)row[R_BASE];
    u32 *raw = b->smp + b->soff[j];                /* (overwritten by the magnitudes later) */
    u32 *spos = b->spos + b->soff[j], *sidx = b->sidx + b->soff[j];
    i64 *cs = b->cstart + b->coff[j];
    memset(cs, 0, sizeof(i64) * (size_t)(chunks + 2));
    for (i64 i = 0; i < s; i++) {
        raw[i] = (u32)sample_position(base, i, n);
        cs[raw[i] / CHUNK + 2]++;
    }
    for (i64 c = 2; c <= chunks + 1; c++) cs[c] += cs[c - 1];
    for (i64 i = 0; i < s; i++) {                  /* cs[c + 1]: where chunk c's next goes */
        const i64 e = cs[raw[i] / CHUNK + 1]++;
        spos[e] = raw[i];
        sidx[e] = (u32)i;
    }
}

/* Step 3, candidates: the first cap positions, ascending, whose magnitude reaches the level,
 * into pos / bits; returns how many. Only the blocks whose recorded maximum reaches the level
 * are read (eight block maxima are compared at a time); the next LOOKAHEAD of them are
 * prefetched while one is read (they are scattered over v, not in cache for a large segment). */
static i64 candidates(const float *v, i64 n, const u32 *bmax, u32 level, u32 *pos, u32 *bits,
                      i64 cap) {
    enum { LOOKAHEAD = 16 };
    i64 (*const hits)(const float *, i64, u32, i64, u32 *, u32 *, i64, i64) = PICK(hits);
    const i64 nblocks = (n + BLOCK - 1) / BLOCK;
    i64 ring[LOOKAHEAD], next = 0, c = 0;
    int head = 0, queued = 0;
    while (c < cap) {
        while (queued < LOOKAHEAD && next < nblocks) {
            if (next + 8 <= nblocks) {
                int any = 0;                        /* (magnitudes are below 2**31) */
                for (int l = 0; l < 8; l++) any |= (int32_t)bmax[next + l] >= (int32_t)level;
                if (!any) { next += 8; continue; }
            }
            if (bmax[next] >= level) {
                for (int l = 0; l < BLOCK; l += 16) __builtin_prefetch(v + next * BLOCK + l);
                ring[(head + queued) % LOOKAHEAD] = next;
                queued++;
            }
            next++;
        }
        if (!queued) break;
        const i64 blk = ring[head], i0 = blk * BLOCK;
        head = (head + 1) % LOOKAHEAD;
        queued--;
        c = hits(v + i0, n - i0 < BLOCK ? n - i0 : BLOCK, level, i0, pos, bits, c, cap);
    }
    return c;
}

/* Step 3, settle to k: the k of the c candidates of largest magnitude, ties at the k-th
 * magnitude to the lower position (all of them when c <= k), ascending, into out. Returns how
 * many, or -1 (out of memory). */
static i64 settle(const u32 *pos, const u32 *bits, i64 c, i64 k, i64 *out) {
    if (c <= k) {
        for (i64 j = 0; j < c; j++) out[j] = pos[j];
        return c;
    }
    u32 *tmp = (u32 *)scratch(2, (size_t)c * sizeof(u32));
    if (!tmp) return -1;
    memcpy(tmp, bits, (size_t)c * sizeof(u32));
    const u32 T = kth_largest(tmp, c, k);
    i64 above = 0;
    for (i64 j = 0; j < c; j++) above += bits[j] > T;
    i64 ties = k - above, w = 0;                 /* the first `ties` at T, by position */
    for (i64 j = 0; j < c; j++)
        if (bits[j] > T || (bits[j] == T && ties-- > 0)) out[w++] = pos[j];
    return w;
}

/* Step 6, encode: the payload of a segment (wire.encode), c entries at the positions sel with
 * values vals (float32) or hv (float16 bits); every word written, the padding zero. Returns 0, or
 * -1 when the index section is too small (a bug: the Step's sizes do not fit the selection). */
static int encode(const bucket_t *b, const i64 *row, const i64 *sel, const float *vals,
                  const uint16_t *hv, i64 c, u32 flags) {
    int32_t *p = b->pay + row[R_PAY];
    const i64 iw = row[R_IW], words = row[R_WORDS], H = K.HEADER_WORDS;
    memset(p, 0, (size_t)words * sizeof(int32_t));
    int32_t *iwp = p + H;
    i64 tokens = c;
    if (b->delta16) {
        uint16_t *tok = (uint16_t *)iwp;           /* native order: low half first */
        i64 t = 0, prev = -1;
        for (i64 j = 0; j < c; j++) {
            const i64 gap = sel[j] - prev, esc = (gap - 1) / K.ESCAPE;
            if (t + esc + 1 > 2 * iw) return -1;
            for (i64 e = 0; e < esc; e++) tok[t++] = 0;
            tok[t++] = (uint16_t)(gap - esc * K.ESCAPE);
            prev = sel[j];
        }
        tokens = t;
    } else {
        for (i64 j = 0; j < c; j++) iwp[j] = (int32_t)sel[j];
    }
    if (hv) memcpy(p + H + iw, hv, (size_t)c * sizeof(uint16_t));
    else memcpy(p + H + iw, vals, (size_t)c * sizeof(float));
    p[0] = (int32_t)K.MAGIC_V3; p[1] = (int32_t)row[R_N]; p[2] = (int32_t)c;
    p[3] = (int32_t)WORD3(flags, b->delta16 ? K.INDEX_DELTA16 : K.INDEX_INT32,
                          b->fp16 ? K.VALUES_FP16 : K.VALUES_FP32);
    p[4] = (int32_t)tokens; p[5] = (int32_t)row[R_K];
    return 0;
}

/* The outputs of a segment whose gradient has NaN/Inf (step 1): state untouched, no entry, the
 * payload flagged. */
static void skip_nonfinite(bucket_t *b, i64 j) {
    i64 *row = ROW(b, j);
    const i64 k = row[R_K], a = row[R_START];
    memset(b->sel + a, 0, (size_t)k * sizeof(i64));
    memset(b->vals + a, 0, (size_t)k * sizeof(float));
    if (b->usent) memset(b->usent + a, 0, (size_t)k * sizeof(float));
    row[R_COUNT] = row[R_FINITE] = row[R_OVER] = row[R_FLUSH] = row[R_DROP] = 0;
    encode(b, row, NULL, NULL, NULL, 0, K.FLAG_NONFINITE);
}

/* Steps 3-6 of an updated segment whose samples are taken: the thresholds t1, t2 (each at least
 * MIN_BITS), the level (t1 if k entries reach it, else t2), its first cap candidates, the top k
 * of them; then mask (the values leave v, and u with masking), round (float16), encode. */
static void select_encode(bucket_t *b, i64 j) {
    i64 *row = ROW(b, j);
    const i64 n = row[R_N], k = row[R_K], s = row[R_S], a = row[R_START];
    const i64 cap = row[R_CAP] < n ? row[R_CAP] : n;
    float *v = b->v + row[R_OFF], *u = b->u ? b->u + row[R_OFF] : NULL;
    const u32 *bmax = b->bmax + row[R_OFF] / BLOCK;
    u32 t1 = K.MIN_BITS, t2 = K.MIN_BITS;
    if (s) {                      /* the ks2-th largest sample, then the ks1-th among the ks2 */
        u32 *smp = b->smp + b->soff[j];
        const i64 ks2 = row[R_KS2];
        const u32 x2 = 16 * ks2 <= s ? top_heap(smp, s, ks2) : kth_largest(smp, s, ks2);
        const u32 x1 = kth_largest(smp, ks2, row[R_KS1]);
        t1 = x1 > t1 ? x1 : t1;
        t2 = x2 > t2 ? x2 : t2;
    }
    u32 *pos = (u32 *)scratch(0, (size_t)cap * sizeof(u32));
    u32 *bits = (u32 *)scratch(1, (size_t)cap * sizeof(u32));
    if (!pos || !bits) { b->rc = -1; return; }
    /* cap >= k: stopping at cap candidates, fewer than k means fewer than k reach t1 at all */
    i64 c = candidates(v, n, bmax, t1, pos, bits, cap);
    if (c < k && t2 != t1) c = candidates(v, n, bmax, t2, pos, bits, cap);
    i64 *sel = b->sel + a;
    c = settle(pos, bits, c, k, sel);
    if (c < 0) { b->rc = -1; return; }
    /* 4. mask: the values (and velocities) sent leave v (and u with masking) */
    float *vals = b->vals + a, *usent = b->usent ? b->usent + a : NULL;
    for (i64 q = 0; q < c; q++) {
        const i64 p = sel[q];
        vals[q] = v[p];
        v[p] = 0.0f;
        if (usent) { usent[q] = u[p]; u[p] = 0.0f; }
    }
    memset(sel + c, 0, (size_t)(k - c) * sizeof(i64));
    memset(vals + c, 0, (size_t)(k - c) * sizeof(float));
    if (usent) memset(usent + c, 0, (size_t)(k - c) * sizeof(float));
    /* 5. round (precision.round_to_fp16): the rounding error stays in v, unless a value overflows:
     *    then the segment's u and v are zeroed */
    i64 over = 0, flush = 0;
    uint16_t *hv = NULL;
    if (b->fp16) {
        hv = (uint16_t *)scratch(2, (size_t)c * sizeof(uint16_t));
        if (!hv) { b->rc = -1; return; }
        for (i64 q = 0; q < c; q++) {
            hv[q] = to_half(bits_of(vals[q]));
            over += (hv[q] & 0x7fffu) == 0x7c00u;
            flush += (hv[q] & 0x7fffu) == 0 && vals[q] != 0.0f;
        }
        if (over) {
            memset(v, 0, (size_t)n * sizeof(float));
            if (u) memset(u, 0, (size_t)n * sizeof(float));
        } else {
            for (i64 q = 0; q < c; q++) v[sel[q]] = vals[q] - from_half(hv[q]);
        }
    }
    row[R_COUNT] = c; row[R_FINITE] = 1; row[R_OVER] = over; row[R_FLUSH] = flush;
    row[R_DROP] = over > 0;
    if (encode(b, row, sel, vals, hv, c, 0)) b->rc = -2;       /* 6. */
}

/* Step 2 of blocks [b0, b1) of segment j */
static void update(const bucket_t *b, i64 j, i64 b0, i64 b1) {
    const i64 *row = ROW(b, j);
    PICK(update)(b->mode, (const float *)(uintptr_t)row[R_G], b->u ? b->u + row[R_OFF] : NULL,
                 b->v + row[R_OFF], row[R_N], b0, b1, b->m, (float)b->scales[j],
                 b->bmax + row[R_OFF] / BLOCK);
}

/* The tasks of bucket_compress's regions */
static void check_task(void *ctx, i64 t) {            /* 1. a large segment's chunk, step 1 */
    bucket_t *b = (bucket_t *)ctx;                    /*    (chunk -1: its samples sorted) */
    const task_t *q = &b->tasks[t];
    const i64 *row = ROW(b, q->row), n = row[R_N];
    if (q->chunk < 0) { sort_samples(b, q->row); return; }
    if (!PICK(finite)((const float *)(uintptr_t)row[R_G], q->chunk * CHUNK,
                      MIN((q->chunk + 1) * CHUNK, n)))
        __atomic_store_n(&b->bad[q->row], 1, __ATOMIC_RELAXED);
}

static void update_task(void *ctx, i64 t) {           /* 2. a small segment, steps 1-6; */
    bucket_t *b = (bucket_t *)ctx;                    /*    or a large one's chunk, step 2 */
    const task_t *q = &b->tasks[t];                   /*    and its samples */
    const i64 j = q->row, c = q->chunk, *row = ROW(b, j), blocks = blocks_of(row);
    if (c < 0) {
        if (!PICK(finite)((const float *)(uintptr_t)row[R_G], 0, row[R_N])) {
            skip_nonfinite(b, j);                       /* (g comes into cache for the update) */
            return;
        }
        update(b, j, 0, blocks);
        sample_all(b, j);
        select_encode(b, j);
        return;
    }
    update(b, j, c * CHUNK_BLOCKS, MIN((c + 1) * CHUNK_BLOCKS, blocks));
    const float *v = b->v + row[R_OFF];
    const i64 *cs = b->cstart + b->coff[j];
    const u32 *spos = b->spos + b->soff[j], *sidx = b->sidx + b->soff[j];
    u32 *smp = b->smp + b->soff[j];
    for (i64 e = cs[c]; e < cs[c + 1]; e++) smp[sidx[e]] = mag(v[spos[e]]);
}

static void select_task(void *ctx, i64 t) {           /* 3. a large segment, steps 3-6 */
    bucket_t *b = (bucket_t *)ctx;
    select_encode(b, b->tasks[t].row);
}

static int by_size_desc(const void *x, const void *y) {
    const size_row *a = (const size_row *)x, *c = (const size_row *)y;
    return a->n < c->n ? 1 : a->n > c->n ? -1 : (a->row > c->row) - (a->row < c->row);
}

/* Every row's sizes against the buffers, before anything is written. */
static int check_rows(const bucket_t *b, i64 nrows, i64 nflat, i64 nwords, i64 nentries) {
    for (i64 j = 0; j < nrows; j++) {
        const i64 *r = ROW(b, j);
        const i64 n = r[R_N], k = r[R_K], s = r[R_S];
        const i64 vw = r[R_WORDS] - K.HEADER_WORDS - r[R_IW];
        if (n < 0 || n > INT32_MAX || k < 0 || k > n || (n && !r[R_G]) || r[R_OFF] < 0
            || r[R_OFF] % BLOCK || r[R_OFF] + n > nflat || s < 0 || s > n || r[R_CAP] < 0
            || (s && (r[R_KS1] < 1 || r[R_KS1] > r[R_KS2] || r[R_KS2] > s))
            || r[R_IW] < (b->delta16 ? (k + 1) / 2 : k) || vw < (b->fp16 ? (k + 1) / 2 : k)
            || r[R_PAY] < 0 || r[R_PAY] + r[R_WORDS] > nwords || r[R_START] < 0
            || r[R_START] + k > nentries)
            return -2;
    }
    return 0;
}

/* Steps 1-6 of every segment of a bucket (engine.py). Returns 0, -1 (out of memory) or -2 (a row
 * that does not fit its buffers: nothing written). */
static int bucket_compress(bucket_t *b, i64 nrows, i64 nflat, i64 nwords, i64 nentries,
                           int threads) {
    if (check_rows(b, nrows, nflat, nwords, nentries)) return -2;
    i64 nsmp = 0, nchunks = 0, ntasks = 0;
    for (i64 j = 0; j < nrows; j++) {
        const i64 *row = ROW(b, j);
        nsmp += row[R_S];
        nchunks += is_large(row) ? chunks_of(row) + 3 : 0;
        ntasks += is_large(row) ? chunks_of(row) + 1 : 1;
    }
    /* the call's buffers, carved from one of the calling thread's (kept: no page faults) */
    const size_t sizes[] = {sizeof(u32) * (size_t)(nflat / BLOCK + 1),
                            3 * sizeof(u32) * (size_t)(nsmp + 1),
                            sizeof(i64) * (size_t)(nchunks + 1),
                            2 * sizeof(i64) * (size_t)(nrows + 1),
                            sizeof(size_row) * (size_t)(nrows + 1),
                            sizeof(task_t) * (size_t)(ntasks + 1), (size_t)(nrows + 1)};
    size_t total = 0;
    for (int q = 0; q < 7; q++) total += (sizes[q] + 63) / 64 * 64;
    char *arena = (char *)scratch(3, total);
    if (!arena) return -1;
    void *part[7];
    for (int q = 0; q < 7; q++) { part[q] = arena; arena += (sizes[q] + 63) / 64 * 64; }
    b->bmax = (u32 *)part[0];
    b->smp = (u32 *)part[1]; b->spos = b->smp + nsmp + 1; b->sidx = b->spos + nsmp + 1;
    b->cstart = (i64 *)part[2]; b->soff = (i64 *)part[3]; b->coff = b->soff + nrows + 1;
    b->order = (size_row *)part[4]; b->tasks = (task_t *)part[5]; b->bad = (char *)part[6];
    memset(b->bad, 0, (size_t)nrows);
    for (i64 j = 0, so = 0, co = 0; j < nrows; j++) {
        const i64 *row = ROW(b, j);
        b->soff[j] = so; so += row[R_S];
        b->coff[j] = co; co += is_large(row) ? chunks_of(row) + 3 : 0;
        b->order[j] = (size_row){row[R_N], j};
    }
    qsort(b->order, (size_t)nrows, sizeof(size_row), by_size_desc);
    /* 1. the large segments' checks (and their samples sorted by chunk) */
    i64 nt = 0, nbig = 0;
    for (i64 q = 0; q < nrows; q++) {
        const i64 j = b->order[q].row, *row = ROW(b, j);
        if (!is_large(row)) continue;
        b->tasks[nt++] = (task_t){j, -1};
        for (i64 c = 0; c < chunks_of(row); c++) b->tasks[nt++] = (task_t){j, c};
    }
    parallel(check_task, b, nt, threads);
    /* 2. the small segments whole, the large ones' updates */
    nt = 0;
    for (i64 q = 0; q < nrows; q++) {
        const i64 j = b->order[q].row, *row = ROW(b, j);
        if (!is_large(row)) b->tasks[nt++] = (task_t){j, -1};
        else if (b->bad[j]) skip_nonfinite(b, j);
        else {
            for (i64 c = 0; c < chunks_of(row); c++) b->tasks[nt++] = (task_t){j, c};
            b->order[nbig++].row = j;               /* (the large ones, in order) */
        }
    }
    parallel(update_task, b, nt, threads);
    /* 3. the large segments' selections */
    for (i64 q = 0; q < nbig; q++) b->tasks[q] = (task_t){b->order[q].row, -1};
    parallel(select_task, b, nbig, threads);
    return b->rc;
}

/* ---- decode (OpsEngine.decode, wire.decode_sum) and split_bucket (wire.split_bucket) ------ */
typedef struct { i64 n, c, k, tokens, flags, len; int int32, fp16; } header_t;

/* wire._header: the checks of the payload header at word p of w[total]; its length in words
 * (wire.payload_words) into h->len. Returns 0, or -1 (malformed). */
static int read_header(const int32_t *w, i64 total, i64 p, header_t *h) {
    if (p + K.HEADER_WORDS > total || (u32)w[p] != K.MAGIC_V3) return -1;
    h->n = w[p + 1]; h->c = w[p + 2]; h->tokens = w[p + 4]; h->k = w[p + 5];
    const u32 w3 = (u32)w[p + 3], icode = (w3 >> 8) & 0xffu, vcode = (w3 >> 16) & 0xffu;
    if (h->n <= 0 || h->c < 0 || h->c > h->k || h->k > h->n || icode >= K.INDEX_CODES
        || vcode >= K.VALUE_CODES || (w3 >> 24))
        return -1;
    h->flags = w3 & 0xffu; h->int32 = icode == K.INDEX_INT32; h->fp16 = vcode == K.VALUES_FP16;
    const i64 escapes = (h->n - 1) / K.ESCAPE;                /* wire.max_escapes */
    if ((h->int32 && h->tokens != h->c) || h->tokens < h->c || h->tokens > h->c + escapes)
        return -1;
    h->len = K.HEADER_WORDS + (h->int32 ? h->k : (h->k + escapes + 1) / 2)
             + (h->fp16 ? (h->k + 1) / 2 : h->k);
    return 0;
}

/* The positions of a checked payload's c entries (at word p) into pos; -1 when the index
 * section does not hold exactly c entries, or one is outside [0, numel) (wire.read_payload). */
static int read_positions(const int32_t *w, i64 p, const header_t *h, i64 numel, int32_t *pos) {
    const int32_t *ix = w + p + K.HEADER_WORDS;
    if (h->int32) {
        for (i64 j = 0; j < h->c; j++) {
            if (ix[j] < 0 || ix[j] >= numel) return -1;
            pos[j] = ix[j];
        }
        return 0;
    }
    const uint16_t *tok = (const uint16_t *)ix;                 /* low half first */
    i64 at = -1, e = 0;
    for (i64 t = 0; t < h->tokens; t++) {
        if (!tok[t]) { at += K.ESCAPE; continue; }
        at += tok[t];
        if (e == h->c || at >= numel) return -1;
        pos[e++] = (int32_t)at;
    }
    return e == h->c ? 0 : -1;
}

/* Every rank's payload checked; then (all finite) out zeroed, the entries added in rank order
 * (out[i] + value), and, with scale, each sent position once times inv. Returns 0, 1 (a flagged
 * rank or a float16 value that is not finite: out untouched), -1 (malformed), -3 (memory). */
static int decode_impl(const int32_t *w, i64 total, i64 numel, i64 ranks, float *out, int scale,
                       float inv) {
    header_t *h = (header_t *)malloc(sizeof(header_t) * (size_t)(ranks + 1));
    i64 *at = (i64 *)malloc(sizeof(i64) * (size_t)(ranks + 1)), p = 0, entries = 0;
    int32_t *pos = NULL;
    int rc = -3, nonfinite = 0;
    if (!h || !at) goto done;
    rc = -1;
    for (i64 r = 0; r < ranks; r++) {                        /* the headers, all ranks */
        if (read_header(w, total, p, &h[r]) || h[r].n != numel || p + h[r].len > total) goto done;
        at[r] = p; entries += h[r].c; p += h[r].len;
    }
    if (p != total) goto done;
    rc = -3;
    if (!(pos = (int32_t *)malloc(sizeof(int32_t) * (size_t)(entries + 1)))) goto done;
    rc = -1;
    for (i64 r = 0, e = 0; r < ranks; e += h[r].c, r++) {     /* the indices and values */
        if (h[r].c && read_positions(w, at[r], &h[r], numel, pos + e)) goto done;
        nonfinite |= (h[r].flags & K.FLAG_NONFINITE) != 0;
        if (h[r].fp16) {
            const uint16_t *hv = (const uint16_t *)(w + at[r] + h[r].len - (h[r].k + 1) / 2);
            for (i64 j = 0; j < h[r].c; j++) nonfinite |= (hv[j] & 0x7c00u) == 0x7c00u;
        }
    }
    rc = nonfinite;
    if (nonfinite) goto done;
    memset(out, 0, sizeof(float) * (size_t)numel);
    for (i64 r = 0, e = 0; r < ranks; e += h[r].c, r++) {
        const int32_t *ps = pos + e;
        const int32_t *vw = w + at[r] + h[r].len - (h[r].fp16 ? (h[r].k + 1) / 2 : h[r].k);
        if (h[r].fp16)
            for (i64 j = 0; j < h[r].c; j++)
                out[ps[j]] = out[ps[j]] + from_half(((const uint16_t *)vw)[j]);
        else
            for (i64 j = 0; j < h[r].c; j++) out[ps[j]] = out[ps[j]] + float_of((u32)vw[j]);
    }
    if (scale) {              /* each position once, though several ranks sent it: gather first */
        float *tmp = (float *)malloc(sizeof(float) * (size_t)(entries + 1));
        if (!tmp) { rc = -3; goto done; }
        for (i64 j = 0; j < entries; j++) tmp[j] = out[pos[j]] * inv;
        for (i64 j = 0; j < entries; j++) out[pos[j]] = tmp[j];
        free(tmp);
    }
done:
    free(h); free(at); free(pos);
    return rc;
}

/* wire.split_bucket's walk: per rank [BUCKET_MAGIC, entries, then (member, payload) each], the
 * (member, start, words) of every payload into spans. Returns how many, or -1 (malformed). */
static i64 split_impl(const int32_t *w, i64 total, i64 ranks, i64 members, i64 *spans) {
    i64 p = 0, e = 0;
    for (i64 r = 0; r < ranks; r++) {
        if (p + 2 > total || (u32)w[p] != K.BUCKET_MAGIC) return -1;
        const i64 n = w[p + 1];
        if (n < 0 || n > members) return -1;
        p += 2;
        for (i64 j = 0; j < n; j++) {
            header_t h;
            if (p + 1 > total || w[p] < 0 || w[p] >= members || read_header(w, total, p + 1, &h)
                || p + 1 + h.len > total)
                return -1;
            spans[3 * e] = w[p]; spans[3 * e + 1] = p + 1; spans[3 * e + 2] = h.len;
            e++;
            p += 1 + h.len;
        }
    }
    return p == total ? e : -1;
}

/* ---- the Python functions --------------------------------------------------------------- */
#define PTR(type, x) ((type)(uintptr_t)(x))

static PyObject *py_configure(PyObject *self, PyObject *args) {
    PyObject *d;
    if (!PyArg_ParseTuple(args, "O!", &PyDict_Type, &d)) return NULL;
    for (size_t i = 0; i < NCONSTANTS; i++) {
        PyObject *x = PyDict_GetItemString(d, CONSTANTS[i].name);
        if (!x) return PyErr_Format(PyExc_KeyError, "configure: %s missing", CONSTANTS[i].name);
        const unsigned long long val = PyLong_AsUnsignedLongLong(x);
        if (PyErr_Occurred() || val > UINT32_MAX)
            return PyErr_Format(PyExc_ValueError, "configure: bad %s", CONSTANTS[i].name);
        *CONSTANTS[i].at = (u32)val;
    }
    if (K.ESCAPE == 0 || K.HEADER_WORDS < 6 || K.INDEX_CODES > 256 || K.VALUE_CODES > 256)
        return PyErr_Format(PyExc_ValueError, "configure: inconsistent constants");
    configured = 1;
    Py_RETURN_NONE;
}

static int ready(void) {
    if (!configured) PyErr_SetString(PyExc_RuntimeError, "dgc_horovod._kernels: not configured");
    return configured;
}

static PyObject *py_compress(PyObject *self, PyObject *args) {
    unsigned long long rows, scales, u, v, pay, sel, vals, usent;
    long long nrows, nflat, nwords, nentries;
    double m;
    int mode, masking, delta16, fp16, threads;
    if (!PyArg_ParseTuple(args, "KLKKKLdiiiiKLKKKLi", &rows, &nrows, &scales, &u, &v, &nflat, &m,
                          &mode, &masking, &delta16, &fp16, &pay, &nwords, &sel, &vals, &usent,
                          &nentries, &threads) || !ready())
        return NULL;
    if (nrows < 0 || (nrows && (!rows || !scales || !v)) || nflat < 0 || mode < 0 || mode > 2
        || ((mode || masking) && !u) || (masking && !usent) || (nwords && !pay)
        || (nentries && (!sel || !vals)) || nflat % BLOCK) {
        PyErr_SetString(PyExc_ValueError, "dgc_horovod._kernels.compress: bad arguments");
        return NULL;
    }
    bucket_t b;
    memset(&b, 0, sizeof b);
    b.rows = PTR(i64 *, rows); b.scales = PTR(const double *, scales);
    b.u = mode ? PTR(float *, u) : NULL; b.v = PTR(float *, v); b.m = (float)m; b.mode = mode;
    b.masking = masking; b.delta16 = delta16; b.fp16 = fp16;
    b.pay = PTR(int32_t *, pay); b.sel = PTR(i64 *, sel); b.vals = PTR(float *, vals);
    b.usent = masking ? PTR(float *, usent) : NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = nrows ? bucket_compress(&b, nrows, nflat, nwords, nentries, threads) : 0;
    Py_END_ALLOW_THREADS
    if (rc == -1) return PyErr_NoMemory();
    if (rc) return PyErr_Format(PyExc_ValueError, "dgc_horovod._kernels.compress: a row's "
                                "sizes do not fit its buffers or its selection (%d)", rc);
    Py_RETURN_NONE;
}

static PyObject *py_decode(PyObject *self, PyObject *args) {
    unsigned long long w, out;
    long long total, numel, ranks;
    int scale;
    double inv;
    if (!PyArg_ParseTuple(args, "KLLLKpd", &w, &total, &numel, &ranks, &out, &scale, &inv)
        || !ready())
        return NULL;
    if (total < 0 || numel < 0 || ranks < 0 || (total && !w) || (numel && !out)) {
        PyErr_SetString(PyExc_ValueError, "dgc_horovod._kernels.decode: bad arguments");
        return NULL;
    }
    int rc;
    const float invf = (float)inv;
    Py_BEGIN_ALLOW_THREADS
    rc = decode_impl(PTR(const int32_t *, w), total, numel, ranks, PTR(float *, out), scale, invf);
    Py_END_ALLOW_THREADS
    if (rc == -3) return PyErr_NoMemory();
    return PyLong_FromLong(rc);
}

static PyObject *py_split_bucket(PyObject *self, PyObject *args) {
    unsigned long long w, spans;
    long long total, ranks, members;
    if (!PyArg_ParseTuple(args, "KLLLK", &w, &total, &ranks, &members, &spans) || !ready())
        return NULL;
    if (total < 0 || ranks < 0 || members < 0 || (total && !w) || !spans) {
        PyErr_SetString(PyExc_ValueError, "dgc_horovod._kernels.split_bucket: bad arguments");
        return NULL;
    }
    i64 n;
    Py_BEGIN_ALLOW_THREADS
    n = split_impl(PTR(const int32_t *, w), total, ranks, members, PTR(i64 *, spans));
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(n);
}

static PyMethodDef methods[] = {
    {"configure", py_configure, METH_VARARGS, "configure({name: value}): the constants"},
    {"compress", py_compress, METH_VARARGS,
     "compress(rows, nrows, scales, u, v, nflat, m, mode, masking, delta16, fp16, payload, "
     "nwords, sel, vals, usent, nentries, threads)"},
    {"decode", py_decode, METH_VARARGS,
     "decode(words, total, numel, ranks, out, scale, inv) -> 0, 1 (non-finite), -1 (malformed)"},
    {"split_bucket", py_split_bucket, METH_VARARGS,
     "split_bucket(words, total, ranks, members, spans) -> entries, or -1 (malformed)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels",
                                    "The C engine of DGC (see dgc_horovod.core.c_engine).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__kernels(void) {
    pthread_atfork(NULL, NULL, pool_after_fork_child);
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "BLOCK", BLOCK)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
