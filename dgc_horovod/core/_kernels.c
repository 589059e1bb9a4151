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
 *   step(g, u, v, n, mode, fma, m, s, pos, npos, ks, cidx, cmag, cap[, threads, k, out])
 *         -> (threshold, count, selected)
 *       1. momentum correction of accumulate.momentum_correction in place, one pass over g, u, v
 *          (mode 0: m = 0, 1: classic, 2: Nesterov; u is 0 for mode 0; s the clipping scale),
 *          recording the largest |v| of every 64-element block;
 *       2. with npos > 0: threshold = the ks-th largest |v| over the int64 positions pos[npos];
 *          the positions with |v| >= threshold (only blocks whose maximum reaches it are read
 *          again) go to cidx (int64) and their magnitudes to cmag (float32), ascending, at most
 *          cap of them; count is the full number of candidates (count > cap: the caller rescans);
 *       3. with k > 0 and out: the top-k of the candidates, ascending, into out[k] when that set
 *          is unique (no tie at the k-th largest), or all candidates when k/2 <= count <= k;
 *          selected = how many were written, -1 when the caller must select (ties, too few,
 *          threshold 0).
 *       Large tensors are split over up to `threads` threads (one per 2**19 elements).
 *   finish(idx, c, v, u, mask_u, sort, vals, usent, payload, cap_words, numel, flags) -> words
 *       optionally sorts idx[c] (int64, unique) ascending in place, gathers vals = v[idx] and
 *       usent = u[idx] (usent may be 0), clears v[idx] (and u[idx] with mask_u), and writes the
 *       DGC v2 payload (wire.py: int32 or delta16 indices by `sort`, float32 values) to the int32
 *       buffer payload[cap_words]; returns the number of words written.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define BLOCK 64                      /* elements per block of the fused pass */
#define MAGIC_V2 0x44474302u
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

/* Grow-only per-thread scratch (the kernels release the GIL, so calls may run concurrently). */
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
    const i64 *pos; i64 j0, j1; float *smp;         /* the sample gather */
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
        float *restrict ub = mode ? u + i0 : NULL;
        float *restrict vb = v + i0;
        uint32_t mx = 0;
        for (i64 i = 0; i < len; i++) {
            float nu, nv;
            update(mode, fma, unit, m, s, gb[i], mode ? ub[i] : 0.0f, vb[i], &nu, &nv);
            if (mode) ub[i] = nu;
            vb[i] = nv;
            uint32_t bits = absbits(nv);
            mx = bits > mx ? bits : mx;
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

static void *gather_worker(void *p) {
    job_t *j = (job_t *)p;
    const float *v = j->v;
    const i64 *pos = j->pos;
    for (i64 k = j->j0; k < j->j1; k++) {
        if (k + 32 < j->j1) __builtin_prefetch(v + pos[k + 32]);
        j->smp[k] = fabsf(v[pos[k]]);
    }
    return NULL;
}

/* Runs fn on jobs[0..T): jobs 1.. on new threads (inline when a thread cannot start). */
#define MAX_THREADS 64
static void run_jobs(void *(*fn)(void *), job_t *jobs, int T) {
    pthread_t th[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 1; t < T; t++) started[t] = pthread_create(&th[t], NULL, fn, &jobs[t]) == 0;
    fn(&jobs[0]);
    for (int t = 1; t < T; t++) {
        if (started[t]) pthread_join(th[t], NULL);
        else fn(&jobs[t]);
    }
}

/* threads for n elements: one per PARALLEL_MIN elements, at most `threads` */
#define PARALLEL_MIN (1 << 19)
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

static int step_impl(int mode, int fma, int unit, const float *g, float *u, float *v, i64 n,
                     float m, float s, const i64 *pos, i64 npos, i64 ks, i64 *cidx, float *cmag,
                     i64 cap, int threads, float *thr_out, i64 *count_out) {
    const i64 nblocks = (n + BLOCK - 1) / BLOCK;
    uint32_t *bmax = NULL;
    float *smp = NULL;
    if (npos > 0) {
        for (i64 j = 0; j < npos; j++)
            if (pos[j] < 0 || pos[j] >= n) return -2;
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
        j->pos = pos; j->smp = smp; j->j0 = npos * t / T; j->j1 = npos * (t + 1) / T;
    }
    /* 1. the update, one pass over g, u, v */
    run_jobs(UPDATE_FN, jobs, T);
    if (npos == 0) { *thr_out = 0.0f; *count_out = 0; return 0; }
    /* 2. threshold: the ks-th largest |v| over the sampled positions */
    run_jobs(gather_worker, jobs, T);
    const float t = kth_largest(smp, npos, ks);
    const uint32_t tb = absbits(t);
    /* 3. candidates |v| >= t, ascending: only blocks whose maximum reaches t are read again */
    i64 c = 0;
    for (i64 b = 0; b < nblocks; b++) {
        if (bmax[b] < tb) continue;
        const i64 i0 = b * BLOCK, len = (n - i0 < BLOCK) ? n - i0 : BLOCK;
        for (i64 i = 0; i < len; i++) {
            float a = fabsf(v[i0 + i]);
            if (a >= t) {
                if (c < cap) { cidx[c] = i0 + i; cmag[c] = a; }
                c++;
            }
        }
    }
    *thr_out = t;
    *count_out = c;
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
    for (i64 j = 0; j < c; j++) {
        i64 p = idx[j];
        vals[j] = v[p];
        if (usent) usent[j] = u[p];
        v[p] = 0.0f;
        if (mask_u) u[p] = 0.0f;
    }
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

static PyObject *err(int rc) {
    const char *what = rc == -1 ? "out of memory" : rc == -2 ? "position out of range"
                     : rc == -3 ? "positions are not unique" : "payload buffer too small";
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
    unsigned long long g, u, v, pos, cidx, cmag, out = 0;
    long long n, npos, ks, cap, k = 0;
    int mode, fma, threads = 1;
    double m, s;
    if (!PyArg_ParseTuple(args, "KKKLiiddKLLKKL|iLK", &g, &u, &v, &n, &mode, &fma, &m, &s, &pos,
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
                   (const i64 *)(uintptr_t)pos, npos, ks, (i64 *)(uintptr_t)cidx,
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

static PyMethodDef methods[] = {
    {"all_finite", py_all_finite, METH_VARARGS, "all_finite(x, n) -> bool"},
    {"step", py_step, METH_VARARGS, "step(g, u, v, n, mode, fma, m, s, pos, npos, ks, cidx, cmag, cap)"},
    {"finish", py_finish, METH_VARARGS,
     "finish(idx, c, v, u, mask_u, sort, vals, usent, payload, cap_words, numel, flags) -> words"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels",
                                    "Fused CPU kernels of DGC's compress step.", -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
