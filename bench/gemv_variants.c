/* Variants of the f16 GEMV (T = 1) and of a plain streaming read, for bench/gemv_variants.py.
 * Built twice: with -mavx512f... (16 f32 lanes) and with -mavx2 -mfma -mf16c (8 lanes). Weights are
 * f16 rows of K; a thread computes y[n0 : n1] = w[n0 : n1] @ x. A variant: R rows read at once
 * (interleaved along K), L cache lines of each row per step, A accumulators per row, software
 * prefetch PF bytes ahead in every row's stream (0: none). */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#ifdef __AVX512F__
typedef __m512 vf;
enum { VL = 16 };
#define LOADH(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define LOADF(p) _mm512_loadu_ps(p)
#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define ADD(a, b) _mm512_add_ps(a, b)
#define ZERO() _mm512_setzero_ps()
#define HSUM(v) _mm512_reduce_add_ps(v)
#else
typedef __m256 vf;
enum { VL = 8 };
#define LOADH(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define LOADF(p) _mm256_loadu_ps(p)
#define FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define ADD(a, b) _mm256_add_ps(a, b)
#define ZERO() _mm256_setzero_ps()
static inline float HSUM(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

typedef void gemv_fn(const uint16_t *w, const float *x, float *y, int K, int n0, int n1);

#define DEF_GEMV(R, L, A, PF)                                                                              \
    static void gemv_##R##_##L##_##A##_##PF(const uint16_t *w, const float *x, float *y, int K, int n0,    \
                                            int n1) {                                                      \
        enum { V = 32 / VL * (L) };                                                                        \
        for (int n = n0; n < n1; n += (R)) {                                                               \
            vf acc[R][A];                                                                                  \
            for (int r = 0; r < (R); r++)                                                                  \
                for (int a = 0; a < (A); a++)                                                              \
                    acc[r][a] = ZERO();                                                                    \
            const uint16_t *wr[R];                                                                         \
            for (int r = 0; r < (R); r++)                                                                  \
                wr[r] = w + (size_t)(n + r < n1 ? n + r : n1 - 1) * K;                                                           \
            for (int k = 0; k < K; k += 32 * (L)) {                                                        \
                if (PF)                                                                                    \
                    for (int r = 0; r < (R); r++)                                                          \
                        for (int l = 0; l < (L); l++)                                                      \
                            _mm_prefetch((const char *)(wr[r] + k) + (PF) + 64 * l, _MM_HINT_T0);        \
                for (int v = 0; v < V; v++) {                                                              \
                    const vf xv = LOADF(x + k + v * VL);                                                   \
                    for (int r = 0; r < (R); r++)                                                          \
                        acc[r][v % (A)] = FMA(xv, LOADH(wr[r] + k + v * VL), acc[r][v % (A)]);             \
                }                                                                                          \
            }                                                                                              \
            for (int r = 0; r < (R); r++) {                                                                \
                for (int a = 1; a < (A); a++)                                                              \
                    acc[r][0] = ADD(acc[r][0], acc[r][a]);                                                 \
                if (n + r < n1) y[n + r] = HSUM(acc[r][0]);                                               \
            }                                                                                              \
        }                                                                                                  \
    }

/* K-blocked: blocks of RB rows; for each KC-column chunk of x (held in L1) each row of the block in
 * turn, its A accumulators kept across chunks (the summation order of R = 1). */
#define DEF_KB(RB, KC, L, A)                                                                               \
    static void kb_##RB##_##KC##_##L##_##A(const uint16_t *w, const float *x, float *y, int K, int n0,     \
                                           int n1) {                                                       \
        enum { V = 32 / VL * (L) };                                                                        \
        for (int nb = n0; nb < n1; nb += (RB)) {                                                           \
            const int rows = n1 - nb < (RB) ? n1 - nb : (RB);                                              \
            vf accs[RB][A];                                                                                \
            for (int r = 0; r < rows; r++)                                                                 \
                for (int a = 0; a < (A); a++)                                                              \
                    accs[r][a] = ZERO();                                                                   \
            for (int k0 = 0; k0 < K; k0 += (KC)) {                                                         \
                const int k1 = K - k0 < (KC) ? K : k0 + (KC);                                              \
                for (int r = 0; r < rows; r++) {                                                           \
                    const uint16_t *wr = w + (size_t)(nb + r) * K;                                         \
                    vf acc[A];                                                                             \
                    for (int a = 0; a < (A); a++)                                                          \
                        acc[a] = accs[r][a];                                                               \
                    for (int k = k0; k < k1; k += 32 * (L))                                                \
                        for (int v = 0; v < V; v++)                                                        \
                            acc[v % (A)] = FMA(LOADF(x + k + v * VL), LOADH(wr + k + v * VL), acc[v % (A)]);   \
                    for (int a = 0; a < (A); a++)                                                          \
                        accs[r][a] = acc[a];                                                               \
                }                                                                                          \
            }                                                                                              \
            for (int r = 0; r < rows; r++) {                                                               \
                for (int a = 1; a < (A); a++)                                                              \
                    accs[r][0] = ADD(accs[r][0], accs[r][a]);                                              \
                y[nb + r] = HSUM(accs[r][0]);                                                              \
            }                                                                                              \
        }                                                                                                  \
    }

/* the variants: name R L A PF */
#define VARIANTS(X)                                                                                        \
    X(1, 2, 4, 0)                                                                                          \
    X(1, 4, 4, 0)                                                                                          \
    X(4, 2, 4, 0)                                                                                          \
    X(4, 1, 2, 0)                                                                                          \
    X(4, 1, 1, 0)                                                                                          \
    X(6, 1, 1, 0)                                                                                          \
    X(8, 1, 1, 0)                                                                                          \
    X(8, 2, 1, 0)                                                                                          \
    X(8, 2, 2, 0)                                                                                          \
    X(8, 1, 1, 1024)                                                                                       \
    X(12, 1, 1, 0)                                                                                         \
    X(16, 1, 1, 0)
#define KB_VARIANTS(X)                                                                                     \
    X(8, 4096, 4, 4)                                                                                       \
    X(4, 4096, 4, 4)

VARIANTS(DEF_GEMV)
KB_VARIANTS(DEF_KB)
#define ENTRY(R, L, A, PF) gemv_##R##_##L##_##A##_##PF,
#define NAME(R, L, A, PF) "R" #R "_L" #L "_A" #A "_PF" #PF,
#define KB_ENTRY(RB, KC, L, A) kb_##RB##_##KC##_##L##_##A,
#define KB_NAME(RB, KC, L, A) "KB" #RB "x" #KC "_L" #L "_A" #A,
static gemv_fn *const variants[] = {VARIANTS(ENTRY) KB_VARIANTS(KB_ENTRY)};
static const char *const variant_names[] = {VARIANTS(NAME) KB_VARIANTS(KB_NAME)};
int n_variants(void) { return sizeof variants / sizeof variants[0]; }
const char *variant_name(int i) { return variant_names[i]; }

/* Streaming read of the bytes [p, p + n): S streams (the range cut in S parts read at once), software
 * prefetch PF bytes ahead (0: none). */
static float read_streams(const char *p, size_t n, int S, int PF) {
    vf s0 = ZERO(), s1 = ZERO(), s2 = ZERO(), s3 = ZERO();
    const size_t part = n / S / 256 * 256;
    const char *q[8];
    for (int i = 0; i < S; i++)
        q[i] = p + part * i;
    for (size_t off = 0; off < part; off += 128) {
        for (int i = 0; i < S; i++) {
            if (PF) {
                _mm_prefetch(q[i] + off + PF, _MM_HINT_T0);
                _mm_prefetch(q[i] + off + PF + 64, _MM_HINT_T0);
            }
            const float *f = (const float *)(q[i] + off);
#ifdef __AVX512F__
            s0 = ADD(s0, LOADF(f));
            s1 = ADD(s1, LOADF(f + 16));
#else
            s0 = ADD(s0, LOADF(f));
            s1 = ADD(s1, LOADF(f + 8));
            s2 = ADD(s2, LOADF(f + 16));
            s3 = ADD(s3, LOADF(f + 24));
#endif
        }
    }
    return HSUM(ADD(ADD(s0, s1), ADD(s2, s3)));
}

/* ---- a persistent pool of threads (1 or 2), a spin barrier between jobs ------------------------- */
struct job {
    int kind;                          /* 0: gemv over all copies, 1: read */
    int variant, K, N, copies;
    const uint16_t *w;                 /* copies x [N, K] */
    const float *x;
    float *y;
    const char *p;
    size_t n;
    int S, PF;
    float sink;
};
static struct job the_job;
static atomic_int go, done_count;
static atomic_int quit;
static int n_threads;
static pthread_t worker;

static void run_part(int tid) {
    struct job *j = &the_job;
    if (j->kind == 0) {
        const int half = j->N / n_threads / 8 * 8;
        const int n0 = half * tid, n1 = tid == n_threads - 1 ? j->N : half * (tid + 1);
        for (int c = 0; c < j->copies; c++)
            variants[j->variant](j->w + (size_t)c * j->N * j->K, j->x, j->y, j->K, n0, n1);
    } else {
        const size_t part = j->n / n_threads;
        float s = read_streams(j->p + part * tid, part, j->S, j->PF);
        if (s == 12345.f)
            j->sink = s;
    }
}

static void *worker_main(void *arg) {
    (void)arg;
    int seen = 0;
    for (;;) {
        int g;
        while ((g = atomic_load(&go)) == seen)
            if (atomic_load(&quit))
                return NULL;
        seen = g;
        run_part(1);
        atomic_fetch_add(&done_count, 1);
    }
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* seconds of one job */
static double run_job(void) {
    double t0 = now();
    atomic_store(&done_count, 0);
    if (n_threads == 2)
        atomic_fetch_add(&go, 1);
    run_part(0);
    while (n_threads == 2 && atomic_load(&done_count) < 1)
        ;
    return now() - t0;
}

void set_threads(int threads) {
    if (n_threads == 2) {
        atomic_store(&quit, 1);
        pthread_join(worker, NULL);
        atomic_store(&quit, 0);
    }
    n_threads = threads;
    if (threads == 2)
        pthread_create(&worker, NULL, worker_main, NULL);
}

/* best seconds over reps of the_job */
static double best_of(int reps) {
    double best = 1e30;
    for (int i = 0; i < reps; i++) {
        double t = run_job();
        if (t < best)
            best = t;
    }
    return best;
}

/* best seconds over reps of one pass of variant over every copy */
double time_gemv(int variant, const uint16_t *w, const float *x, float *y, int K, int N, int copies, int reps) {
    the_job = (struct job){.kind = 0, .variant = variant, .K = K, .N = N, .copies = copies, .w = w, .x = x, .y = y};
    return best_of(reps);
}

double time_read(const char *p, size_t n, int S, int PF, int reps) {
    the_job = (struct job){.kind = 1, .p = p, .n = n, .S = S, .PF = PF};
    return best_of(reps);
}
