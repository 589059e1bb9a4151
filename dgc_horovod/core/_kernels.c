/* Fused CPU kernels of DGC's compress step (dgc_horovod.core.kernels is the Python side).
 *
 * Plain C on raw pointers handed over by a backend (torch.Tensor.data_ptr(), ndarray.ctypes.data),
 * so the core stays free of any framework import. Every function mirrors, operation by operation,
 * what the backend's tensor ops compute (dgc_horovod/core/accumulate.py and sparsify.py), so both
 * paths give bit-identical state and selections:
 *
 *   - built with -O3 -ffp-contract=off: a*b + c is never contracted behind our back;
 *   - `fma` chooses fmaf(a, b, c) (one rounding, what PyTorch's vectorised add-with-alpha computes
 *     on CPUs with FMA) or round(round(a*b) + c) (NumPy), as the backend reports;
 *   - the threshold is the exact ks-th largest sampled magnitude (any selection algorithm gives
 *     the same value), candidates come out in ascending position order (as torch.nonzero).
 *
 * Functions (all pointers are addresses as Python ints; arrays are contiguous):
 *   all_finite(x, n[, threads]) -> bool                    float32 x[n] has no NaN/Inf
 *   step(g, u, v, n, mode, fma, m, s, uni, npos, ks, cidx, cmag, cap[, threads, k, out])
 *         -> (threshold, count, selected)
 *       1. momentum correction of accumulate.momentum_correction in place, one pass over g, u, v
 *          (mode 0: m = 0, 1: classic, 2: Nesterov; u is 0 for mode 0; s the clipping scale),
 *          recording the largest |v| of every 64-element block;
 *       2. with npos > 0: threshold = the ks-th largest |v| over the sampled positions
 *          min(floor(uni[j] * n), n - 1) of the float64 uniform draws uni[npos] in [0, 1);
 *          the positions with |v| >= threshold (only blocks whose maximum reaches it are read
 *          again) go to cidx (int64) and their magnitudes to cmag (float32), ascending, at most
 *          cap of them; count is the full number of candidates (count > cap: the caller rescans);
 *       3. with k > 0 and out: the top-k of the candidates, ascending, into out[k] when that set
 *          is unique (no tie at the k-th largest), or all candidates when k/2 <= count <= k;
 *          selected = how many were written, -1 when the caller must select (ties, too few,
 *          threshold 0).
 *       Large tensors are split over up to `threads` threads (one per 65,536 elements).
 *   finish(idx, c, v, u, mask_u, sort, vals, usent, payload, cap_words, numel, flags) -> words
 *       optionally sorts idx[c] (int64, unique) ascending in place, gathers vals = v[idx] and
 *       usent = u[idx] (usent may be 0), clears v[idx] (and u[idx] with mask_u), and writes the
 *       DGC v2 payload (wire.py: int32 or delta16 indices by `sort`, float32 values) to the int32
 *       buffer payload[cap_words]; returns the number of words written.
 *   decode_sum(words, total, numel, ranks, out, mode[, inv]) -> done
 *       the receive side (wire.decode_sum, DGCCore.decompress): checks the `ranks` payloads in
 *       the int32 words[total] as wire.read_payload does and, mode bits 1 / 2 / 4, zeroes
 *       float32 out[numel], adds every rank's entries in rank order (out[i] + value), then
 *       multiplies each sent position once by (float)inv. done False: out untouched, the
 *       caller runs the tensor-op reference (a malformed payload, a non-finite flag or value).
 *   split_bucket(words, total, ranks, members, spans, cap) -> entries
 *       wire.split_bucket's walk: (member, start, words) of every payload in an allgathered
 *       bucket into the int64 spans[3 * cap]; -1: the caller runs the reference (it raises).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define BLOCK 64                      /* elements per block of the fused pass */
#define MAGIC_V2 0x44474302u
#define BUCKET_MAGIC 0x44474342u
#define ESCAPE 65535

typedef int64_t i64;

ALWAYS_INLINE uint32_t absbits(float x) { uint32_t b; memcpy(&b, &x, 4); return b & 0x7fffffffu; }

ALWAYS_INLINE float mad(float a, float b, float c, const int fma) {
    return fma ? fmaf(a, b, c) : a * b + c;
}

/* One element of accumulate.momentum_correction: reads g, *u, *v, returns the new u and v.
 * unit: the scale s is 1.0 (the backends then take a one-pass form, see backend.scale_add_). */
ALWAYS_INLINE void update(const int mode, const int fma, const int unit, float m, float s,
                          float g, float u, float v, float *un, float *vn) {
    if (mode == 0) { *un = u; *vn = unit ? v + g : mad(s, g, v, fma); return; }
    float nu = unit ? mad(m, u, g, fma) : mad(s, g, m * u, fma);
    float nv;
    if (mode == 1) nv = v + nu;
    else { nv = unit ? v + g : mad(s, g, v, fma); nv = mad(m, nu, nv, fma); }
    *un = nu; *vn = nv;
}

/* k-th largest (1-based) of a[0..n): quickselect, a is reordered. */
static float kth_largest(float *a, i64 n, i64 k) {
    i64 lo = 0, hi = n - 1, want = k - 1;          /* index in descending order */
    while (lo < hi) {
        i64 mid = lo + (hi - lo) / 2;
        float x = a[lo], y = a[mid], z = a[hi], p;  /* median of three as pivot */
        p = (x > y) ? ((y > z) ? y : (x > z ? z : x)) : ((x > z) ? x : (y > z ? z : y));
        i64 i = lo, j = hi;
        while (i <= j) {                            /* Hoare partition, descending */
            while (a[i] > p) i++;
            while (a[j] < p) j--;
            if (i <= j) { float t = a[i]; a[i] = a[j]; a[j] = t; i++; j--; }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return a[want];
    }
    return a[want];
}

/* Grow-only per-thread scratch (the kernels release the GIL, so calls may run concurrently):
 * block maxima and sampled magnitudes of the per-tensor path (n/64 + s values for a tensor of
 * n elements with s samples) and the candidates' magnitudes of a top-k among candidates. */
static void *scratch(int slot, size_t bytes) {
    static __thread void *buf[2];
    static __thread size_t cap[2];
    if (bytes > cap[slot]) {
        void *p = realloc(buf[slot], bytes);
        if (!p) return NULL;
        buf[slot] = p;
        cap[slot] = bytes;
    }
    return buf[slot];
}

/* ---- the passes, each over a range, specialised on (mode, fma, unit) by constant arguments */
typedef struct {
    const float *g; float *u, *v; i64 n, b0, b1; float m, s; uint32_t *bmax;
    int mode, fma, unit;
    const double *uni; i64 j0, j1; float *smp;      /* the sample gather */
    const float *x; i64 i0, i1; int ok;             /* the finiteness check */
} job_t;

/* 1. the update of blocks [b0, b1); records each block's largest |v_new| in bmax (as IEEE bits,
 *    whose integer order is the order of non-negative floats) */
ALWAYS_INLINE void update_body(const int mode, const int fma, const int unit, job_t *j) {
    const float *restrict g = j->g;
    float *restrict u = j->u;
    float *restrict v = j->v;
    const float m = j->m, s = j->s;
    for (i64 b = j->b0; b < j->b1; b++) {
        const i64 i0 = b * BLOCK, len = (j->n - i0 < BLOCK) ? j->n - i0 : BLOCK;
        const float *restrict gb = g + i0;
        float *restrict vb = v + i0;
        uint32_t mx = 0;
        /* (mode is a constant in every instantiation: each branch is a plain loop that the
         *  compiler vectorises; a conditional load of u in one loop would stop it) */
        if (mode == 0) {
            for (i64 i = 0; i < len; i++) {
                float nu, nv;
                update(0, fma, unit, m, s, gb[i], 0.0f, vb[i], &nu, &nv);
                vb[i] = nv;
                uint32_t bits = absbits(nv);
                mx = bits > mx ? bits : mx;
            }
        } else {
            float *restrict ub = u + i0;
            for (i64 i = 0; i < len; i++) {
                float nu, nv;
                update(mode, fma, unit, m, s, gb[i], ub[i], vb[i], &nu, &nv);
                ub[i] = nu;
                vb[i] = nv;
                uint32_t bits = absbits(nv);
                mx = bits > mx ? bits : mx;
            }
        }
        if (j->bmax) j->bmax[b] = mx;
    }
}

#define UPDATE_DISPATCH(j)                                                             \
    switch ((j)->mode * 4 + (j)->fma * 2 + (j)->unit) {                                \
    case 0: update_body(0, 0, 0, j); break;   case 1: update_body(0, 0, 1, j); break;   \
    case 2: update_body(0, 1, 0, j); break;   case 3: update_body(0, 1, 1, j); break;   \
    case 4: update_body(1, 0, 0, j); break;   case 5: update_body(1, 0, 1, j); break;   \
    case 6: update_body(1, 1, 0, j); break;   case 7: update_body(1, 1, 1, j); break;   \
    case 8: update_body(2, 0, 0, j); break;   case 9: update_body(2, 0, 1, j); break;   \
    case 10: update_body(2, 1, 0, j); break;  default: update_body(2, 1, 1, j); break;  \
    }

ALWAYS_INLINE void finite_body(job_t *j) {
    const float *restrict x = j->x;
    uint32_t mx = 0;
    for (i64 i = j->i0; i < j->i1; i++) { uint32_t b = absbits(x[i]); mx = b > mx ? b : mx; }
    j->ok = mx < 0x7f800000u;
}

static void *update_generic(void *p) { UPDATE_DISPATCH((job_t *)p) return NULL; }
static void *finite_generic(void *p) { finite_body((job_t *)p); return NULL; }

#if defined(__x86_64__) && defined(__GNUC__)
/* The same code compiled for AVX2 + FMA, chosen at run time when the CPU has them. */
__attribute__((target("avx2,fma"))) static void *update_avx2(void *p)
{ UPDATE_DISPATCH((job_t *)p) return NULL; }
__attribute__((target("avx2,fma"))) static void *finite_avx2(void *p)
{ finite_body((job_t *)p); return NULL; }
static int have_avx2(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    }
    return known;
}
#define UPDATE_FN (have_avx2() ? update_avx2 : update_generic)
#define FINITE_FN (have_avx2() ? finite_avx2 : finite_generic)
#else
#define UPDATE_FN update_generic
#define FINITE_FN finite_generic
#endif

/* The sampled position of a uniform draw u in [0, 1) for n entries: floor(u * n), at most n - 1
 * (sparsify.sample_positions: u * n is rounded once in float64, as every backend computes it). */
ALWAYS_INLINE i64 sample_position(double u, i64 n) {
    const i64 p = (i64)(u * (double)n);
    return p < n ? p : n - 1;
}
ALWAYS_INLINE int uniforms_ok(const double *uni, i64 npos) {
    for (i64 j = 0; j < npos; j++)
        if (!(uni[j] >= 0.0 && uni[j] < 1.0)) return 0;
    return 1;
}

#define MAX_THREADS 64
static void *gather_worker(void *p) {
    job_t *j = (job_t *)p;
    const float *v = j->v;
    const double *uni = j->uni;
    const i64 n = j->n;
    for (i64 k = j->j0; k < j->j1; k++) {
        if (k + 32 < j->j1) __builtin_prefetch(v + sample_position(uni[k + 32], n));
        j->smp[k] = fabsf(v[sample_position(uni[k], n)]);
    }
    return NULL;
}

/* ---- a persistent pool of worker threads
 * parallel(fn, ctx, ntasks, threads) runs fn(ctx, 0..ntasks) on the calling thread and up to
 * threads-1 pool workers, which take task indices from a shared counter. Workers are started on
 * first use. Between regions a worker spins for a short while (SPIN pause instructions, about
 * 0.1 ms) and then sleeps on a condition variable: regions that follow each other closely (the
 * phases of one batch, the tensors of one step) do not pay for waking a sleeping thread, which
 * on a virtual machine can cost tens of microseconds, and an idle pool uses no CPU. One region
 * at a time: a caller that finds the pool busy (another Python thread, or a task calling
 * parallel()) runs its tasks inline. After fork() the child starts with an empty pool. */
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
#if defined(__x86_64__) && defined(__GNUC__)
    return _mm_getcsr() & ~CSR_FLAGS;
#else
    return 0;
#endif
}
ALWAYS_INLINE void set_fp_mode(unsigned csr) {
#if defined(__x86_64__) && defined(__GNUC__)
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
        i64 t = __atomic_fetch_add(&P.next, 1, __ATOMIC_RELAXED);
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
    pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t c = PTHREAD_COND_INITIALIZER;
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

/* Runs fn on jobs[0..T) in parallel (the per-tensor entry points). */
typedef struct { void *(*fn)(void *); job_t *jobs; } jobs_ctx;
static void job_task(void *c, i64 t) { jobs_ctx *j = (jobs_ctx *)c; j->fn(&j->jobs[t]); }
static void run_jobs(void *(*fn)(void *), job_t *jobs, int T) {
    jobs_ctx c = {fn, jobs};
    parallel(job_task, &c, T, T);
}

/* threads for n elements: one per PARALLEL_MIN elements, at most `threads` */
#define PARALLEL_MIN (1 << 16)
static int nthreads(i64 n, int threads) {
    i64 t = n / PARALLEL_MIN;
    if (t > threads) t = threads;
    if (t > MAX_THREADS) t = MAX_THREADS;
    return t < 1 ? 1 : (int)t;
}

static int finite_impl(const float *x, i64 n, int threads) {
    job_t jobs[MAX_THREADS];
    int T = nthreads(n, threads), ok = 1;
    for (int t = 0; t < T; t++) {
        memset(&jobs[t], 0, sizeof(job_t));
        jobs[t].x = x; jobs[t].i0 = n * t / T; jobs[t].i1 = n * (t + 1) / T;
    }
    run_jobs(FINITE_FN, jobs, T);
    for (int t = 0; t < T; t++) ok &= jobs[t].ok;
    return ok;
}

/* The positions i0 + i (0 <= i < len) with |p[i]| >= t, ascending, appended to cidx / cmag from
 * entry c on (at most cap entries are written); returns the new count. */
ALWAYS_INLINE i64 block_hits_body(const float *p, i64 len, float t, i64 i0, i64 *cidx,
                                  float *cmag, i64 c, i64 cap) {
    for (i64 i = 0; i < len; i++) {
        float a = fabsf(p[i]);
        if (a >= t) {
            if (c < cap) { cidx[c] = i0 + i; cmag[c] = a; }
            c++;
        }
    }
    return c;
}
static i64 block_hits_generic(const float *p, i64 len, float t, i64 i0, i64 *cidx, float *cmag,
                              i64 c, i64 cap) {
    return block_hits_body(p, len, t, i0, cidx, cmag, c, cap);
}
#if defined(__x86_64__) && defined(__GNUC__)
/* The same with AVX2: eight magnitudes compared at once; only lanes that reach t are visited
 * (in ascending order, so the output is the scalar loop's). */
__attribute__((target("avx2"))) static i64 block_hits_avx2(const float *p, i64 len, float t,
                                                         i64 i0, i64 *cidx, float *cmag, i64 c,
                                                         i64 cap) {
    const __m256 vt = _mm256_set1_ps(t);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    i64 i = 0;
    for (; i + 8 <= len; i += 8) {
        const __m256 a = _mm256_and_ps(_mm256_loadu_ps(p + i), absmask);
        unsigned m = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a, vt, _CMP_GE_OQ));
        while (m) {
            const int l = __builtin_ctz(m);
            m &= m - 1;
            if (c < cap) { cidx[c] = i0 + i + l; cmag[c] = fabsf(p[i + l]); }
            c++;
        }
    }
    return block_hits_body(p + i, len - i, t, i0 + i, cidx, cmag, c, cap);
}
#define BLOCK_HITS_FN (have_avx2() ? block_hits_avx2 : block_hits_generic)
#else
#define BLOCK_HITS_FN block_hits_generic
#endif

/* The top-k of the c candidates in ascending position order into out, when that set is unique
 * (no tie straddles the k-th largest magnitude) and c >= k; or all of them when k/2 <= c <= k.
 * Returns the number written, or -1 (ties, too few: the caller takes the backend's top-k). */
static i64 select_candidates(const i64 *cidx, const float *cmag, i64 c, i64 k, i64 *out) {
    if (2 * c < k) return -1;
    if (c <= k) { memcpy(out, cidx, (size_t)c * sizeof(i64)); return c; }
    float *tmp = (float *)scratch(1, (size_t)c * sizeof(float));
    if (!tmp) return -1;
    memcpy(tmp, cmag, (size_t)c * sizeof(float));
    const float T = kth_largest(tmp, c, k);
    i64 above = 0, equal = 0;
    for (i64 j = 0; j < c; j++) { above += cmag[j] > T; equal += cmag[j] == T; }
    if (above + equal != k) return -1;
    i64 w = 0;
    for (i64 j = 0; j < c; j++) if (cmag[j] >= T) out[w++] = cidx[j];
    return w;
}

/* The positions with |v| >= t (tb: its bits) in ascending order into cidx / cmag (at most cap of
 * them); only blocks whose recorded maximum reaches t are read. Returns the full count. */
static i64 candidates(const float *v, i64 n, const uint32_t *bmax, float t, uint32_t tb,
                      i64 *cidx, float *cmag, i64 cap) {
    /* The qualifying blocks are scattered over v (in memory, not in cache, for a large tensor):
     * the next LOOKAHEAD of them are prefetched while one is read, in ascending order. */
    enum { LOOKAHEAD = 16 };
    const i64 nblocks = (n + BLOCK - 1) / BLOCK;
    i64 ring[LOOKAHEAD], next = 0, c = 0;
    int head = 0, queued = 0;
    for (;;) {
        while (queued < LOOKAHEAD && next < nblocks) {
            if (bmax[next] >= tb) {
                const float *p = v + next * BLOCK;
                for (int l = 0; l < BLOCK; l += 16) __builtin_prefetch(p + l);
                ring[(head + queued) % LOOKAHEAD] = next;
                queued++;
            }
            next++;
        }
        if (!queued) break;
        const i64 b = ring[head];
        head = (head + 1) % LOOKAHEAD;
        queued--;
        const i64 i0 = b * BLOCK, len = (n - i0 < BLOCK) ? n - i0 : BLOCK;
        c = BLOCK_HITS_FN(v + i0, len, t, i0, cidx, cmag, c, cap);
    }
    return c;
}

static int step_impl(int mode, int fma, int unit, const float *g, float *u, float *v, i64 n,
                     float m, float s, const double *uni, i64 npos, i64 ks, i64 *cidx, float *cmag,
                     i64 cap, int threads, float *thr_out, i64 *count_out) {
    const i64 nblocks = (n + BLOCK - 1) / BLOCK;
    uint32_t *bmax = NULL;
    float *smp = NULL;
    if (npos > 0) {
        if (!uniforms_ok(uni, npos)) return -2;
        bmax = (uint32_t *)scratch(0, (size_t)(nblocks ? nblocks : 1) * sizeof(uint32_t));
        smp = (float *)scratch(1, (size_t)npos * sizeof(float));
        if (!bmax || !smp) return -1;
    }
    job_t jobs[MAX_THREADS];
    int T = nthreads(n, threads);
    for (int t = 0; t < T; t++) {
        job_t *j = &jobs[t];
        memset(j, 0, sizeof(job_t));
        j->g = g; j->u = u; j->v = v; j->n = n; j->m = m; j->s = s; j->bmax = bmax;
        j->mode = mode; j->fma = fma; j->unit = unit;
        j->b0 = nblocks * t / T; j->b1 = nblocks * (t + 1) / T;
        j->uni = uni; j->smp = smp; j->j0 = npos * t / T; j->j1 = npos * (t + 1) / T;
    }
    /* 1. the update, one pass over g, u, v */
    run_jobs(UPDATE_FN, jobs, T);
    if (npos == 0) { *thr_out = 0.0f; *count_out = 0; return 0; }
    /* 2. threshold: the ks-th largest |v| over the sampled positions */
    run_jobs(gather_worker, jobs, T);
    const float t = kth_largest(smp, npos, ks);
    const uint32_t tb = absbits(t);
    /* 3. candidates |v| >= t, ascending: only blocks whose maximum reaches t are read again */
    *thr_out = t;
    *count_out = candidates(v, n, bmax, t, tb, cidx, cmag, cap);
    return 0;
}

/* ascending sort of unique non-negative positions < 2**31: insertion sort or 3-pass LSD radix */
static int sort_positions(i64 *a, i64 n) {
    if (n <= 32) {
        for (i64 i = 1; i < n; i++) {
            i64 x = a[i], j = i - 1;
            while (j >= 0 && a[j] > x) { a[j + 1] = a[j]; j--; }
            a[j + 1] = x;
        }
        return 0;
    }
    i64 *tmp = (i64 *)malloc((size_t)n * sizeof(i64));
    if (!tmp) return -1;
    i64 *src = a, *dst = tmp;
    for (int shift = 0; shift < 33; shift += 11) {
        i64 cnt[2048] = {0};
        for (i64 i = 0; i < n; i++) cnt[(src[i] >> shift) & 2047]++;
        i64 sum = 0;
        for (int b = 0; b < 2048; b++) { i64 x = cnt[b]; cnt[b] = sum; sum += x; }
        for (i64 i = 0; i < n; i++) dst[cnt[(src[i] >> shift) & 2047]++] = src[i];
        i64 *t = src; src = dst; dst = t;
    }
    if (src != a) memcpy(a, src, (size_t)n * sizeof(i64));  /* 3 passes: result is in tmp */
    free(tmp);
    return 0;
}

static int finish_impl(i64 *idx, i64 c, float *v, float *u, int mask_u, int sort, float *vals,
                       float *usent, int32_t *payload, i64 cap_words, i64 numel, int flags,
                       i64 *words_out) {
    for (i64 j = 0; j < c; j++)
        if (idx[j] < 0 || idx[j] >= numel) return -2;
    if (sort && sort_positions(idx, c)) return -1;
    /* every check before the first write to v or u: a failure leaves the state as it was */
    i64 tokens = c;
    if (sort) {
        tokens = 0;
        i64 prev = -1;
        for (i64 j = 0; j < c; j++) {
            if (idx[j] <= prev) return -3;          /* not unique */
            tokens += (idx[j] - prev - 1) / ESCAPE + 1;
            prev = idx[j];
        }
    }
    i64 iw = sort ? (tokens + 1) / 2 : c;
    i64 words = 5 + iw + c;
    if (words > cap_words) return -4;
    for (i64 j = 0; j < c; j++) {
        i64 p = idx[j];
        if (j + 16 < c) {                            /* scattered positions: prefetch ahead */
            __builtin_prefetch(v + idx[j + 16], 1);
            if (usent || mask_u) __builtin_prefetch(u + idx[j + 16], 1);
        }
        vals[j] = v[p];
        if (usent) usent[j] = u[p];
        v[p] = 0.0f;
        if (mask_u) u[p] = 0.0f;
    }
    payload[0] = (int32_t)MAGIC_V2;
    payload[1] = (int32_t)numel;
    payload[2] = (int32_t)c;
    payload[3] = flags | (sort ? 1 : 0) << 8;
    payload[4] = (int32_t)tokens;
    int32_t *iwp = payload + 5;
    if (sort) {
        uint16_t *tok = (uint16_t *)iwp;            /* native order: low half first (LE) */
        i64 t = 0, prev = -1;
        for (i64 j = 0; j < c; j++) {
            i64 gap = idx[j] - prev, esc = (gap - 1) / ESCAPE;
            for (i64 e = 0; e < esc; e++) tok[t++] = 0;
            tok[t++] = (uint16_t)(gap - esc * ESCAPE);
            prev = idx[j];
        }
        if (t & 1) tok[t] = 0;
    } else {
        for (i64 j = 0; j < c; j++) iwp[j] = (int32_t)idx[j];
    }
    memcpy(payload + 5 + iw, vals, (size_t)c * sizeof(float));
    *words_out = words;
    return 0;
}

/* ---- batches: many tensors in one call (a bucket of the PyTorch adapter)
 *
 * step_many(desc, fdesc, count[, threads, out, vals, usent, payload, nk, nw, uni, nuni]): desc
 *   is an int64 array of count rows of NF fields (the F_* below), fdesc a float64 array of count
 *   rows (m, s, threshold); out (int64), vals, usent (float32) of nk entries, payload (int32) of
 *   nw words and uni (float64 uniform draws) of nuni entries are the batch buffers. The rows'
 *   regions in them follow one another in row order, and step_many writes each row's offsets:
 *   F_POS (its npos draws in uni), F_OUT (k entries of out, vals and, when F_USENT is 1, usent)
 *   and F_PAY (cap_words words of payload); a row with k = 0 is not finished here and has no
 *   region in out or payload. Per tensor it does
 *   what step() and then, when it selected (nsel >= 0) and k > 0, what finish() does, with
 *   the same arithmetic (so the same results as the per-tensor calls). It also settles two cases
 *   that step() leaves to the caller, with the set the backend's top-k would choose: more
 *   candidates than cap (collected again into temporary buffers) and fewer than k/2 (a lower
 *   sampled threshold that k of them reach, or the exact top-k over |v|), both when the set is
 *   unique. Outputs: count, nsel,
 *   words, and the threshold in fdesc. Then it compacts: the selected indices (out), values
 *   (vals), u at the sent positions (usent) and payloads of the tensors it finished are moved to
 *   the front of their batch buffers, in tensor order. Tensors with
 *   nsel < 0 are left to the caller (ties at the k-th magnitude, threshold 0, no sampling).
 *   Every row's gradient is checked for NaN/Inf before its state changes: a small tensor's (at
 *   most SMALL_NUMEL elements) by the task that updates it, just before, a larger one's in a
 *   first phase over the pool. A row with any keeps its state as it was, and its nsel is
 *   NONFINITE. A row whose v holds a NaN and that finds fewer than k/2 candidates is left to the
 *   caller (the backend's top-k ranks NaN first).
 *   Phases: (0) the NaN/Inf check of the larger tensors; (1) the update of every tensor over
 *   the pool: a small tensor (at most SMALL_BLOCKS
 *   blocks) is one task that checks, updates and finishes it while it is in cache, a larger one
 *   is cut in chunks of CHUNK_BLOCKS blocks (65,536 elements);
 *   (2) the gather of the sampled magnitudes of the larger tensors, in chunks; (3) per larger
 *   tensor, largest first: threshold, candidates, selection, gather/clear/encode. All arguments
 *   are checked before any state changes. */
enum { F_G, F_U, F_V, F_N, F_MODE, F_FMA, F_POS, F_NPOS, F_KS, F_CIDX, F_CMAG, F_CAP, F_K,
       F_OUT, F_VALS, F_USENT, F_MASKU, F_PAY, F_CAPW, F_SORT, F_FLAGS,
       F_COUNT, F_NSEL, F_WORDS, NF };
enum { D_M, D_S, D_THR, ND };

typedef struct { i64 t, lo, hi; } range_t;
#ifndef SMALL_BLOCKS
#define SMALL_BLOCKS 4096         /* a tensor of at most 4096 blocks (262,144 elements: v is 1 MiB,
                                     it stays in L2 from its update to its selection) is "small" */
#endif
#define SMALL_NUMEL ((i64)SMALL_BLOCKS * BLOCK)
#define NONFINITE (-2)                           /* F_NSEL of a small row whose g has NaN/Inf */
typedef struct {
    i64 *d; double *f; i64 nt;
    i64 *o; float *vals, *usent; int32_t *pay; const double *uni;   /* the batch buffers */
    i64 *boff, *soff; uint32_t *bmax; float *smp;
    range_t *r; i64 nr; i64 *order; char *small, *bad; int rc;
} batch_t;

#define CHUNK_BLOCKS 1024          /* 64K elements per update task */
#define CHUNK_SAMPLES 16384        /* sampled positions per gather task */
#define CHUNK_FINITE (1 << 16)     /* elements per finiteness task */

static i64 make_ranges(range_t *r, i64 t, i64 total, i64 chunk) {
    i64 w = 0;
    for (i64 lo = 0; lo < total; lo += chunk) {
        r[w].t = t; r[w].lo = lo; r[w].hi = lo + chunk < total ? lo + chunk : total; w++;
    }
    return w;
}

static void select_one(batch_t *b, i64 t);

/* A chunk of a large row's gradient checked for NaN/Inf (phase 0 of step_many). */
static void large_finite_task(void *c, i64 k) {
    batch_t *b = (batch_t *)c;
    const range_t *r = &b->r[k];
    job_t j; memset(&j, 0, sizeof j);
    j.x = (const float *)(uintptr_t)b->d[NF * r->t + F_G]; j.i0 = r->lo; j.i1 = r->hi;
    FINITE_FN(&j);
    if (!j.ok) __atomic_store_n(&b->bad[r->t], 1, __ATOMIC_RELAXED);
}

/* The outputs of a row whose gradient has NaN/Inf (its state is not touched). */
static void mark_nonfinite(batch_t *b, i64 t) {
    i64 *row = b->d + NF * t;
    row[F_COUNT] = 0; row[F_NSEL] = NONFINITE; row[F_WORDS] = 0; b->f[ND * t + D_THR] = 0.0;
}

static void update_task(void *c, i64 k) {
    batch_t *b = (batch_t *)c;
    const range_t *r = &b->r[k];
    i64 *row = b->d + NF * r->t;
    double *f = b->f + ND * r->t;
    if (b->small[r->t]) {                /* checked here, while g comes into cache for the update */
        job_t q; memset(&q, 0, sizeof q);
        q.x = (const float *)(uintptr_t)row[F_G]; q.i0 = 0; q.i1 = row[F_N];
        FINITE_FN(&q);
        if (!q.ok) {                     /* NaN/Inf: the state stays as it is */
            mark_nonfinite(b, r->t);
            return;
        }
    }
    job_t j; memset(&j, 0, sizeof j);
    j.g = (const float *)(uintptr_t)row[F_G]; j.u = (float *)(uintptr_t)row[F_U];
    j.v = (float *)(uintptr_t)row[F_V]; j.n = row[F_N];
    j.m = (float)f[D_M]; j.s = (float)f[D_S];
    j.mode = (int)row[F_MODE]; j.fma = row[F_FMA] ? 1 : 0; j.unit = j.s == 1.0f;
    j.bmax = row[F_NPOS] > 0 ? b->bmax + b->boff[r->t] : NULL;
    j.b0 = r->lo; j.b1 = r->hi;
    UPDATE_FN(&j);
    if (b->small[r->t]) {                /* the whole tensor: gather and select it now */
        if (row[F_NPOS] > 0) {
            job_t q; memset(&q, 0, sizeof q);
            q.v = j.v; q.n = j.n; q.uni = b->uni + row[F_POS];
            q.smp = b->smp + b->soff[r->t]; q.j0 = 0; q.j1 = row[F_NPOS];
            gather_worker(&q);
        }
        select_one(b, r->t);
    }
}

static void gather_task(void *c, i64 k) {
    batch_t *b = (batch_t *)c;
    const range_t *r = &b->r[k];
    const i64 *row = b->d + NF * r->t;
    job_t j; memset(&j, 0, sizeof j);
    j.v = (float *)(uintptr_t)row[F_V]; j.n = row[F_N]; j.uni = b->uni + row[F_POS];
    j.smp = b->smp + b->soff[r->t]; j.j0 = r->lo; j.j1 = r->hi;
    gather_worker(&j);
}

/* The k largest |v| of v[n] in ascending position order into out, when that set is unique (no
 * tie at the k-th largest magnitude, which is > 0): what the backend's top-k over |v| selects.
 * Returns k, or -1 (ties, a zero k-th magnitude, out of memory: the caller takes the backend's
 * top-k). */
static i64 exact_topk_unique(const float *v, i64 n, i64 k, i64 *out) {
    if (k < 1 || k > n) return -1;
    /* a buffer of n floats, freed at once: the per-thread scratch would keep the largest one
     * this rare fallback ever needed for the life of the process */
    float *tmp = (float *)malloc((size_t)n * sizeof(float));
    if (!tmp) return -1;
    for (i64 i = 0; i < n; i++) tmp[i] = fabsf(v[i]);
    const float T = kth_largest(tmp, n, k);
    free(tmp);
    if (!(T > 0.0f)) return -1;
    i64 above = 0, equal = 0;
    for (i64 i = 0; i < n; i++) { float a = fabsf(v[i]); above += a > T; equal += a == T; }
    if (above + equal != k) return -1;
    i64 w = 0;
    for (i64 i = 0; i < n; i++) if (fabsf(v[i]) >= T) out[w++] = i;
    return w;
}

/* The top-k (unique set, ascending) among the cnt positions with |v| >= thr into out: from the
 * candidate buffers when they hold all of them, else collected again into temporary buffers.
 * Returns the number written or -1 (see select_candidates). */
static i64 choose(const float *v, i64 n, const uint32_t *bmax, float thr, i64 cnt, i64 k,
                  const i64 *cidx, const float *cmag, i64 cap, i64 *out) {
    if (cnt <= cap) return select_candidates(cidx, cmag, cnt, k, out);
    i64 *ci = (i64 *)malloc(sizeof(i64) * (size_t)cnt);
    float *cm = (float *)malloc(sizeof(float) * (size_t)cnt);
    i64 nsel = -1;
    if (ci && cm) {
        candidates(v, n, bmax, thr, absbits(thr), ci, cm, cnt);
        nsel = select_candidates(ci, cm, cnt, k, out);
    }
    free(ci);
    free(cm);
    return nsel;
}

static void select_one(batch_t *b, i64 t) {
    i64 *row = b->d + NF * t;
    double *f = b->f + ND * t;
    row[F_COUNT] = 0; row[F_NSEL] = -1; row[F_WORDS] = 0; f[D_THR] = 0.0;
    const i64 npos = row[F_NPOS], n = row[F_N];
    if (npos == 0) return;
    float *v = (float *)(uintptr_t)row[F_V];
    const float thr = kth_largest(b->smp + b->soff[t], npos, row[F_KS]);
    const i64 cap = row[F_CAP];
    i64 *cidx = (i64 *)(uintptr_t)row[F_CIDX];
    float *cmag = (float *)(uintptr_t)row[F_CMAG];
    const i64 cnt = candidates(v, n, b->bmax + b->boff[t], thr, absbits(thr), cidx, cmag, cap);
    f[D_THR] = thr; row[F_COUNT] = cnt;
    const i64 k = row[F_K];
    if (k <= 0 || thr <= 0.0f) return;
    i64 *out = b->o + row[F_OUT];
    const uint32_t *bmax = b->bmax + b->boff[t];
    i64 nsel = -1;
    int nan_in_v = 0;                    /* a NaN in v: the backend's top-k ranks it first */
    if (2 * cnt < k)
        for (i64 q = 0, nb = (n + BLOCK - 1) / BLOCK; q < nb && !nan_in_v; q++)
            nan_in_v = bmax[q] > 0x7f800000u;
    if (nan_in_v) {
        nsel = -1;                       /* left to the caller */
    } else if (2 * cnt < k) {
        /* Too few candidates: the backend would take the exact top-k over v. Its set (when
         * unique) is also the top-k among the positions above any threshold that at least k of
         * them reach: lower the threshold to the (4 ks)-th, (16 ks)-th, ... largest sample, then,
         * failing that, take the exact top-k over v. (The reported threshold and count stay the
         * first ones, for the caller's fallback.) */
        float *smp = b->smp + b->soff[t];
        for (i64 ks = row[F_KS]; ks < npos;) {
            ks = 4 * ks < npos ? 4 * ks : npos;
            const float t2 = kth_largest(smp, npos, ks);
            if (!(t2 > 0.0f)) break;
            const i64 c2 = candidates(v, n, bmax, t2, absbits(t2), cidx, cmag, cap);
            if (c2 >= k) { nsel = choose(v, n, bmax, t2, c2, k, cidx, cmag, cap, out); break; }
        }
        if (nsel < 0) nsel = exact_topk_unique(v, n, k, out);
    } else {
        nsel = choose(v, n, bmax, thr, cnt, k, cidx, cmag, cap, out);
    }
    row[F_NSEL] = nsel;
    if (nsel < 0) return;
    i64 words = 0;
    int rc = finish_impl(out, nsel, v, (float *)(uintptr_t)row[F_U], (int)row[F_MASKU],
                         (int)row[F_SORT], b->vals + row[F_OUT],
                         row[F_USENT] ? b->usent + row[F_OUT] : NULL, b->pay + row[F_PAY],
                         row[F_CAPW], n, (int)row[F_FLAGS], &words);
    if (rc) {                 /* the row's state is as it was (finish_impl checks first) */
        row[F_NSEL] = -1;     /* out of memory: the caller finishes it; else a bug: raise */
        if (rc != -1) b->rc = rc;
        return;
    }
    row[F_WORDS] = words;
}

static void select_task(void *c, i64 task) {
    batch_t *b = (batch_t *)c;
    select_one(b, b->order[task]);
}

typedef struct { i64 n, t; } size_row;
static int by_size_desc(const void *a, const void *b) {
    const size_row *x = (const size_row *)a, *y = (const size_row *)b;
    return x->n < y->n ? 1 : x->n > y->n ? -1 : (x->t > y->t) - (x->t < y->t);
}

/* Every row's fields, its regions of the batch buffers (sizes nk, nw, nuni) and its uniforms. */
static int check_rows(const batch_t *b, i64 nk, i64 nw, i64 nuni) {
    for (i64 t = 0; t < b->nt; t++) {
        const i64 *row = b->d + NF * t;
        const i64 n = row[F_N], npos = row[F_NPOS], mode = row[F_MODE], k = row[F_K];
        if (n < 0 || mode < 0 || mode > 2 || (mode && !row[F_U]) || !row[F_G] || !row[F_V]
            || npos < 0 || (npos && (row[F_KS] < 1 || row[F_KS] > npos || row[F_POS] < 0
                                     || row[F_POS] > nuni - npos || !b->uni
                                     || !row[F_CIDX] || !row[F_CMAG] || row[F_CAP] < 0))
            || ((row[F_MASKU] || row[F_USENT]) && !row[F_U]) || k < 0
            || (k && (!npos || row[F_OUT] < 0 || row[F_OUT] > nk - k || !b->o || !b->vals
                      || row[F_PAY] < 0 || row[F_CAPW] < 0 || row[F_PAY] > nw - row[F_CAPW]
                      || !b->pay || (row[F_USENT] && !b->usent))))
            return -5;
        if (npos && !uniforms_ok(b->uni + row[F_POS], npos)) return -2;
    }
    return 0;
}

static int step_many_impl(i64 *d, double *f, i64 nt, int threads, i64 *o, float *vals,
                          float *usent, int32_t *pay, const double *uni, i64 nk, i64 nw,
                          i64 nuni) {
    if (nt <= 0) return 0;
    batch_t b; memset(&b, 0, sizeof b);
    b.d = d; b.f = f; b.nt = nt;
    b.o = o; b.vals = vals; b.usent = usent; b.pay = pay; b.uni = uni;
    /* the rows' regions of the batch buffers, one after the other in row order */
    for (i64 t = 0, po = 0, ko = 0, wo = 0; t < nt; t++) {
        i64 *row = d + NF * t;
        row[F_POS] = po; row[F_OUT] = ko; row[F_PAY] = wo;
        if (row[F_NPOS] > 0) po += row[F_NPOS];
        if (row[F_K] > 0) { ko += row[F_K]; if (row[F_CAPW] > 0) wo += row[F_CAPW]; }
    }
    int rc = check_rows(&b, nk, nw, nuni);
    if (rc) return rc;
    b.boff = (i64 *)malloc(sizeof(i64) * (size_t)(nt + 1));
    b.soff = (i64 *)malloc(sizeof(i64) * (size_t)(nt + 1));
    b.order = (i64 *)malloc(sizeof(i64) * (size_t)(nt + 1));
    b.small = (char *)malloc((size_t)(nt + 1));
    b.bad = (char *)calloc((size_t)(nt + 1), 1);
    i64 nblk = 0, nsmp = 0, nranges = 0, nbig = 0;
    if (!b.boff || !b.soff || !b.order || !b.small || !b.bad) { rc = -1; goto out; }
    for (i64 t = 0; t < nt; t++) {
        const i64 *row = d + NF * t;
        const i64 blocks = (row[F_N] + BLOCK - 1) / BLOCK;
        b.boff[t] = nblk; b.soff[t] = nsmp;
        if (row[F_NPOS] > 0) { nblk += blocks; nsmp += row[F_NPOS]; }
        nranges += (blocks <= SMALL_BLOCKS ? 1 : (blocks + CHUNK_BLOCKS - 1) / CHUNK_BLOCKS
                                                 + (row[F_N] + CHUNK_FINITE - 1) / CHUNK_FINITE)
                   + (row[F_NPOS] + CHUNK_SAMPLES - 1) / CHUNK_SAMPLES;
        b.small[t] = blocks <= SMALL_BLOCKS;   /* one task does all of it, in cache */
        if (!b.small[t]) b.order[nbig++] = t;
    }
    b.bmax = (uint32_t *)malloc(sizeof(uint32_t) * (size_t)(nblk + 1));
    b.smp = (float *)malloc(sizeof(float) * (size_t)(nsmp + 1));
    b.r = (range_t *)malloc(sizeof(range_t) * (size_t)(nranges + 1));
    if (!b.bmax || !b.smp || !b.r) { rc = -1; goto out; }
    /* 0. the large gradients' NaN/Inf check (a small one is checked by the task that updates
     *    it): a row with any is left out of what follows, its state untouched */
    b.nr = 0;
    for (i64 q = 0; q < nbig; q++)
        b.nr += make_ranges(b.r + b.nr, b.order[q], d[NF * b.order[q] + F_N], CHUNK_FINITE);
    parallel(large_finite_task, &b, b.nr, threads);
    i64 ngood = 0;
    for (i64 q = 0; q < nbig; q++) {
        if (b.bad[b.order[q]]) mark_nonfinite(&b, b.order[q]);
        else b.order[ngood++] = b.order[q];
    }
    nbig = ngood;
    /* the large tensors, largest first, for phase 3 (no allocation after the state changes) */
    size_row *sr = (size_row *)malloc(sizeof(size_row) * (size_t)(nbig + 1));
    if (!sr) { rc = -1; goto out; }
    for (i64 q = 0; q < nbig; q++) { sr[q].n = d[NF * b.order[q] + F_N]; sr[q].t = b.order[q]; }
    qsort(sr, (size_t)nbig, sizeof(size_row), by_size_desc);
    /* 1. the updates */
    b.nr = 0;
    for (i64 t = 0; t < nt; t++) {
        const i64 blocks = (d[NF * t + F_N] + BLOCK - 1) / BLOCK;
        if (!b.bad[t])
            b.nr += make_ranges(b.r + b.nr, t, blocks, b.small[t] ? SMALL_BLOCKS : CHUNK_BLOCKS);
    }
    parallel(update_task, &b, b.nr, threads);
    /* 2. the sampled magnitudes of the large tensors */
    b.nr = 0;
    for (i64 q = 0; q < nbig; q++)
        b.nr += make_ranges(b.r + b.nr, b.order[q], d[NF * b.order[q] + F_NPOS], CHUNK_SAMPLES);
    parallel(gather_task, &b, b.nr, threads);
    /* 3. per large tensor, largest first */
    for (i64 q = 0; q < nbig; q++) b.order[q] = sr[q].t;
    free(sr);
    parallel(select_task, &b, nbig, threads);
    rc = b.rc;
    /* compaction of what was finished, in row order, to the front of the batch buffers */
    if (!rc) {
        i64 oo = 0, wo = 0;
        for (i64 t = 0; t < nt; t++) {
            const i64 *row = d + NF * t;
            const i64 nsel = row[F_NSEL], words = row[F_WORDS];
            if (row[F_K] <= 0 || nsel < 0) continue;
            memmove(o + oo, o + row[F_OUT], sizeof(i64) * (size_t)nsel);
            memmove(vals + oo, vals + row[F_OUT], sizeof(float) * (size_t)nsel);
            if (row[F_USENT])
                memmove(usent + oo, usent + row[F_OUT], sizeof(float) * (size_t)nsel);
            memmove(pay + wo, pay + row[F_PAY], sizeof(int32_t) * (size_t)words);
            oo += nsel; wo += words;
        }
    }
out:
    free(b.boff); free(b.soff); free(b.order); free(b.small); free(b.bad); free(b.bmax);
    free(b.smp); free(b.r);
    return rc;
}

/* ---- the receive side: wire.decode_sum in one call (dgc_horovod.core.kernels.decode_sum) ----
 * Every rank's payload in `w` (DGC v2, wire.py), checked as wire.read_payload checks it, then
 * summed in rank order into out[numel]. The call declines (returns 1, out untouched) whenever
 * the tensor-op reference must run instead: a payload it would reject (it raises the error), a
 * rank's non-finite flag or any non-finite value (the caller's NaN path), so whatever this
 * function writes is finite-input IEEE float32 arithmetic with a unique result. */
#define DEC_ZERO 1          /* zero out first (else it holds what to add to) */
#define DEC_ADD 2           /* add every rank's entries, in rank order */
#define DEC_SCALE 4         /* then out[i] *= inv at every sent position, each once */

/* IEEE-754 binary16 -> binary32, exact for every finite value (subnormals included); the
 * caller declines on Inf/NaN (exponent 31) before converting. */
ALWAYS_INLINE float half_to_float(uint32_t h) {
    uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ffu, b;
    if (e) b = sign | ((e + 112) << 23) | (m << 13);
    else if (!m) b = sign;
    else {                                  /* subnormal: m * 2**-24, normalised */
        int sh = 0;
        while (!(m & 0x400u)) { m <<= 1; sh++; }
        b = sign | ((uint32_t)(113 - sh) << 23) | ((m & 0x3ffu) << 13);
    }
    float f; memcpy(&f, &b, 4); return f;
}

typedef struct { i64 idx, val, c; int delta16, fp16; } dec_t;    /* one rank's sections */

/* Check every payload; fill r[nranks] and pos[] (all ranks' positions, rank order). Returns 0,
 * or 1 when the reference must run (malformed, flagged or non-finite). */
static int decode_parse(const int32_t *w, i64 total, i64 numel, i64 nranks, dec_t *r,
                        int32_t *pos, i64 cap) {
    i64 p = 0, np = 0;
    for (i64 k = 0; k < nranks; k++) {
        if (p + 5 > total) return 1;
        uint32_t magic = (uint32_t)w[p], w3 = (uint32_t)w[p + 3];
        i64 n = w[p + 1], c = w[p + 2], t = w[p + 4];
        if (magic != MAGIC_V2 || n != numel || c < 0 || c > numel || (w3 >> 24)) return 1;
        uint32_t flags = w3 & 0xff, ic = (w3 >> 8) & 0xff, vc = (w3 >> 16) & 0xff;
        if (ic > 1 || vc > 1 || (ic == 0 && t != c) || t < c || t > numel) return 1;
        if (flags & 1) return 1;                                    /* FLAG_NONFINITE */
        i64 iw = ic ? (t + 1) / 2 : c, vw = vc ? (c + 1) / 2 : c, start = p + 5;
        if (start + iw + vw > total) return 1;
        r[k].c = c; r[k].delta16 = (int)ic; r[k].fp16 = (int)vc;
        r[k].idx = start; r[k].val = start + iw;
        p = start + iw + vw;
        if (!c) continue;
        if (np + c > cap) return 1;
        if (ic == 0) {
            const int32_t *ix = w + start;
            for (i64 j = 0; j < c; j++) {
                if (ix[j] < 0 || ix[j] >= numel) return 1;
                pos[np + j] = ix[j];
            }
        } else {
            const uint16_t *tok = (const uint16_t *)(w + start);   /* low half first (LE) */
            i64 at = -1, e = 0;
            for (i64 j = 0; j < t; j++) {
                uint32_t d = tok[j];
                if (!d) { at += ESCAPE; continue; }
                at += d;
                if (e == c || at >= numel) return 1;
                pos[np + e++] = (int32_t)at;
            }
            if (e != c) return 1;
        }
        if (vc == 0) {
            const int32_t *v = w + r[k].val;
            for (i64 j = 0; j < c; j++)
                if (((uint32_t)v[j] & 0x7f800000u) == 0x7f800000u) return 1;
        } else {
            const uint16_t *v = (const uint16_t *)(w + r[k].val);
            for (i64 j = 0; j < c; j++)
                if ((v[j] & 0x7c00u) == 0x7c00u) return 1;
        }
        np += c;
    }
    return p == total ? 0 : 1;
}

static int decode_impl(const int32_t *w, i64 total, i64 numel, i64 nranks, float *out, int mode,
                       float inv, int *declined) {
    *declined = 1;
    if (nranks < 0 || numel < 0 || total < 0) return 0;
    i64 cap = 2 * total;                        /* entries fit in the words (>= 1/2 word each) */
    dec_t *r = (dec_t *)malloc(sizeof(dec_t) * (size_t)(nranks ? nranks : 1));
    int32_t *pos = (int32_t *)malloc(sizeof(int32_t) * (size_t)(cap ? cap : 1));
    if (!r || !pos) { free(r); free(pos); return -1; }
    if (decode_parse(w, total, numel, nranks, r, pos, cap)) { free(r); free(pos); return 0; }
    *declined = 0;
    if (mode & DEC_ZERO) memset(out, 0, sizeof(float) * (size_t)numel);
    i64 np = 0;
    for (i64 k = 0; k < nranks; k++) {
        i64 c = r[k].c;
        const int32_t *ps = pos + np;
        if (mode & DEC_ADD) {
            if (r[k].fp16) {
                const uint16_t *v = (const uint16_t *)(w + r[k].val);
                for (i64 j = 0; j < c; j++) out[ps[j]] = out[ps[j]] + half_to_float(v[j]);
            } else {
                const float *v = (const float *)(w + r[k].val);
                for (i64 j = 0; j < c; j++) out[ps[j]] = out[ps[j]] + v[j];
            }
        }
        np += c;
    }
    int rc = 0;
    if ((mode & DEC_SCALE) && np) {             /* gathered before any write: each once */
        float *tmp = (float *)malloc(sizeof(float) * (size_t)np);
        if (!tmp) rc = -1;
        else {
            for (i64 j = 0; j < np; j++) tmp[j] = out[pos[j]] * inv;
            for (i64 j = 0; j < np; j++) out[pos[j]] = tmp[j];
            free(tmp);
        }
    }
    free(r); free(pos);
    return rc;
}

/* wire.split_bucket's walk over an allgathered bucket: for each of `nranks` segments
 * [BUCKET_MAGIC, n, then n times (member, payload)], the (member, start word, words) of every
 * payload, in order, into spans[3 * cap]. Returns how many, or -1 when the reference must run
 * (a segment it would reject: it raises the error; or more than cap entries). The payloads
 * themselves are checked when they are decoded. */
static i64 split_impl(const int32_t *w, i64 total, i64 nranks, i64 members, i64 *spans, i64 cap) {
    i64 p = 0, e = 0;
    for (i64 k = 0; k < nranks; k++) {
        if (p + 2 > total || (uint32_t)w[p] != BUCKET_MAGIC) return -1;
        i64 n = w[p + 1];
        if (n < 0 || n > members) return -1;
        p += 2;
        for (i64 j = 0; j < n; j++) {
            if (p + 1 > total) return -1;
            i64 m = w[p], h = p + 1;
            if (m < 0 || m >= members || h + 5 > total) return -1;
            i64 c = w[h + 2], t = w[h + 4];
            uint32_t w3 = (uint32_t)w[h + 3], ic = (w3 >> 8) & 0xff, vc = (w3 >> 16) & 0xff;
            if (c < 0 || t < 0 || ic > 1 || vc > 1) return -1;
            i64 len = 5 + (ic ? (t + 1) / 2 : c) + (vc ? (c + 1) / 2 : c);
            if (h + len > total || e == cap) return -1;
            spans[3 * e] = m; spans[3 * e + 1] = h; spans[3 * e + 2] = len;
            e++;
            p = h + len;
        }
    }
    return p == total ? e : -1;
}

static PyObject *err(int rc) {
    const char *what = rc == -1 ? "out of memory" : rc == -2 ? "sample draw outside [0, 1)"
                     : rc == -3 ? "positions are not unique" : rc == -5 ? "bad batch row"
                     : "payload buffer too small";
    PyErr_Format(rc == -1 ? PyExc_MemoryError : PyExc_ValueError, "dgc_horovod kernel: %s", what);
    return NULL;
}

static PyObject *py_all_finite(PyObject *self, PyObject *args) {
    unsigned long long x; long long n; int threads = 1;
    if (!PyArg_ParseTuple(args, "KL|i", &x, &n, &threads)) return NULL;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = finite_impl((const float *)(uintptr_t)x, n, threads);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(ok);
}

static PyObject *py_step(PyObject *self, PyObject *args) {
    unsigned long long g, u, v, uni, cidx, cmag, out = 0;
    long long n, npos, ks, cap, k = 0;
    int mode, fma, threads = 1;
    double m, s;
    if (!PyArg_ParseTuple(args, "KKKLiiddKLLKKL|iLK", &g, &u, &v, &n, &mode, &fma, &m, &s, &uni,
                          &npos, &ks, &cidx, &cmag, &cap, &threads, &k, &out))
        return NULL;
    if (mode < 0 || mode > 2 || (mode && !u) || n < 0 || npos < 0 || (npos && (ks < 1 || ks > npos))) {
        PyErr_SetString(PyExc_ValueError, "dgc_horovod kernel step: bad arguments");
        return NULL;
    }
    float thr = 0.0f;
    i64 count = 0, nsel = -1;
    int rc;
    float mf = (float)m, sf = (float)s;
    Py_BEGIN_ALLOW_THREADS
    rc = step_impl(mode, fma ? 1 : 0, sf == 1.0f, (const float *)(uintptr_t)g,
                   (float *)(uintptr_t)u, (float *)(uintptr_t)v, n, mf, sf,
                   (const double *)(uintptr_t)uni, npos, ks, (i64 *)(uintptr_t)cidx,
                   (float *)(uintptr_t)cmag, cap, threads, &thr, &count);
    if (!rc && out && k > 0 && npos > 0 && thr > 0.0f && count <= cap)
        nsel = select_candidates((const i64 *)(uintptr_t)cidx, (const float *)(uintptr_t)cmag,
                                 count, k, (i64 *)(uintptr_t)out);
    Py_END_ALLOW_THREADS
    if (rc) return err(rc);
    return Py_BuildValue("(dLL)", (double)thr, (long long)count, (long long)nsel);
}

static PyObject *py_finish(PyObject *self, PyObject *args) {
    unsigned long long idx, v, u, vals, usent, payload;
    long long c, cap_words, numel;
    int mask_u, sort, flags;
    if (!PyArg_ParseTuple(args, "KLKKiiKKKLLi", &idx, &c, &v, &u, &mask_u, &sort, &vals, &usent,
                          &payload, &cap_words, &numel, &flags))
        return NULL;
    if (c < 0 || (mask_u && !u) || (usent && !u)) {
        PyErr_SetString(PyExc_ValueError, "dgc_horovod kernel finish: bad arguments");
        return NULL;
    }
    i64 words = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = finish_impl((i64 *)(uintptr_t)idx, c, (float *)(uintptr_t)v, (float *)(uintptr_t)u, mask_u,
                     sort, (float *)(uintptr_t)vals, (float *)(uintptr_t)usent,
                     (int32_t *)(uintptr_t)payload, cap_words, numel, flags, &words);
    Py_END_ALLOW_THREADS
    if (rc) return err(rc);
    return PyLong_FromLongLong(words);
}

static PyObject *py_step_many(PyObject *self, PyObject *args) {
    unsigned long long d, f, o = 0, v = 0, u = 0, p = 0, uni = 0;
    long long nt, nk = 0, nw = 0, nuni = 0; int threads = 1;
    if (!PyArg_ParseTuple(args, "KKL|iKKKKLLKL", &d, &f, &nt, &threads, &o, &v, &u, &p, &nk,
                          &nw, &uni, &nuni))
        return NULL;
    if (nt < 0 || (nt && (!d || !f)) || nk < 0 || nw < 0 || nuni < 0) {
        PyErr_SetString(PyExc_ValueError, "dgc_horovod kernel step_many: bad arguments");
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = nt ? step_many_impl((i64 *)(uintptr_t)d, (double *)(uintptr_t)f, nt, threads,
                             (i64 *)(uintptr_t)o, (float *)(uintptr_t)v, (float *)(uintptr_t)u,
                             (int32_t *)(uintptr_t)p, (const double *)(uintptr_t)uni, nk, nw,
                             nuni) : 0;
    Py_END_ALLOW_THREADS
    if (rc) return err(rc);
    Py_RETURN_NONE;
}

static PyObject *py_decode_sum(PyObject *self, PyObject *args) {
    unsigned long long w, out; long long total, numel, nranks; int mode; double inv = 1.0;
    if (!PyArg_ParseTuple(args, "KLLLKi|d", &w, &total, &numel, &nranks, &out, &mode, &inv))
        return NULL;
    if (total < 0 || numel < 0 || nranks < 0 || (total && !w) || (numel && !out)
            || mode & ~(DEC_ZERO | DEC_ADD | DEC_SCALE)) {
        PyErr_SetString(PyExc_ValueError, "dgc_horovod kernel decode_sum: bad arguments");
        return NULL;
    }
    int rc, declined;
    float invf = (float)inv;
    Py_BEGIN_ALLOW_THREADS
    rc = decode_impl((const int32_t *)(uintptr_t)w, total, numel, nranks, (float *)(uintptr_t)out,
                     mode, invf, &declined);
    Py_END_ALLOW_THREADS
    if (rc) return err(rc);
    return PyBool_FromLong(!declined);
}

static PyObject *py_split_bucket(PyObject *self, PyObject *args) {
    unsigned long long w, spans; long long total, nranks, members, cap;
    if (!PyArg_ParseTuple(args, "KLLLKL", &w, &total, &nranks, &members, &spans, &cap))
        return NULL;
    if (total < 0 || nranks < 0 || members < 0 || cap < 0 || (total && !w) || (cap && !spans)) {
        PyErr_SetString(PyExc_ValueError, "dgc_horovod kernel split_bucket: bad arguments");
        return NULL;
    }
    i64 n;
    Py_BEGIN_ALLOW_THREADS
    n = split_impl((const int32_t *)(uintptr_t)w, total, nranks, members, (i64 *)(uintptr_t)spans,
                   cap);
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(n);
}

static PyMethodDef methods[] = {
    {"all_finite", py_all_finite, METH_VARARGS, "all_finite(x, n) -> bool"},
    {"step", py_step, METH_VARARGS, "step(g, u, v, n, mode, fma, m, s, uni, npos, ks, cidx, cmag, cap)"},
    {"finish", py_finish, METH_VARARGS,
     "finish(idx, c, v, u, mask_u, sort, vals, usent, payload, cap_words, numel, flags) -> words"},
    {"step_many", py_step_many, METH_VARARGS, "step_many(desc, fdesc, count[, threads, out, vals, usent, payload, nk, nw, uni, nuni])"},
    {"decode_sum", py_decode_sum, METH_VARARGS,
     "decode_sum(words, total, numel, ranks, out, mode[, inv]) -> done"},
    {"split_bucket", py_split_bucket, METH_VARARGS,
     "split_bucket(words, total, ranks, members, spans, cap) -> entries or -1"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels",
                                    "Fused CPU kernels of DGC's compress step.", -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) {
    pthread_atfork(NULL, NULL, pool_after_fork_child);
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddIntConstant(m, "SMALL_NUMEL", (long)SMALL_NUMEL)
              || PyModule_AddIntConstant(m, "NONFINITE", NONFINITE))) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
