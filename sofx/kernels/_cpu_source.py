"""C source of the native CPU Adam kernels (compiled on first use by :mod:`sofx.kernels._cpu_build`).

Four code paths, all with the same arithmetic:

``vstep_*``, ``vundo_*``  explicit AVX-512 vectors (where the CPU also converts
             bfloat16 in hardware, HW_BF16): one loop per dtype combination,
             three 16-lane vectors at a time (their chains interleave) from
             memory to memory, every stream read
             prefetched 1-2.3 KiB ahead (staggered by stream), bfloat16 converted in registers; IEEE
             square roots and div_by (true divisions in the inverse where the
             CPU's divider is fast: FAST_DIVIDER) for ``cpu_fast``, MKL's
             square root inline and true divisions for ``cpu`` (when a replica
             passed its load-time check: of MKL's AVX-512 code path on Intel
             CPUs, of its generic one on AMD's, Zen 4 and 5, as in AVX2
             builds, of its AVX2 one under MKL_ENABLE_INSTRUCTIONS=AVX2, the
             IEEE square root where torch's is not MKL's routine; each its own
             instance of the loops). They take every operation of the two
             paths below on such CPUs (those of ``exact_*`` only with the
             replica); the portable build (no -march=native) checks them bit
             for bit (but for cpu_fast's inverse of tiny values: quot_vec).
             On CPUs with AVX2 and FMA but without that (AMD Zen 2/3, older
             Intel) the same loops with 8-lane vectors, bfloat16 converted by
             integer operations, tiny quotients unscaled (quot8): every
             operation of ``fused_*``, and of ``exact_*``: with the AVX2 replica
             of MKL's square root inline where the load-time check finds it
             equal to ``torch.sqrt`` (MKL's generic code path, which it runs on
             AMD CPUs, or its AVX2 one, which it runs on Intel CPUs without
             AVX-512; in AVX-512 builds without bfloat16 conversion, Skylake-SP
             to Ice Lake-SP, the replica of its AVX-512 path on 8 lanes), else
             as ``xexact_*`` (MKL's square root called per chunk of XTILE
             elements between two vector passes).
``fused_*``  one loop per (param, grad, state) dtype combination, element by
             element from memory to memory, IEEE ``sqrtf``: loads, math and
             stores interleave, so the update runs at the memory bandwidth.
             Where a storage dtype is bfloat16 the loops run per chunk, the
             bfloat16 results converted by the CPU's own instruction where it
             has one (store_bf16). The inverse divides by 1 - lr*wd, beta1 and
             beta2 through div_by (below; exact but for quotients of tiny or
             huge numbers, where it may be an ulp off; the vector loops scale
             tiny ones first). Used by ``cpu_fast`` (``exact`` 0).
``exact_*``  the same per chunk of ``TILE`` elements, split around the square
             roots of the chunk, which are torch's own bit for bit: MKL's
             ``vmsSqrt`` computed inline where a load-time check finds the
             replica (``mkl_sqrt_replica``) equal to ``torch.sqrt``, else a call
             to that routine (passed in as a function pointer); the inverse
             with true divisions, as ``reference.py``. Used by ``cpu``
             (``exact`` 1).
``run_tiles`` any other dtype combination (float16 params or states, mixed
             gradient dtypes): tiles converted to float32 local arrays, then the
             math (float16 conversions do not vectorize with gcc 12 anyway, and
             fewer instantiations keep the cold compile short).

The arithmetic reproduces ``reference.py``, which follows torch's own CPU
element-wise kernels operation by operation: ``lerp`` and ``add(alpha=)`` are
fused multiply-adds, ``addcmul`` is ``fma(c*g, g, v)``, ``addcdiv`` is
``p + (s*m)/d``, divisions are true divisions (sqrt(v) / sqrt(bc2) is computed by div_by,
which gives a true division's bits there: see its comment). The file is compiled with
``-ffp-contract=off`` so that no other multiply-add is fused.

Outputs may alias the inputs element for element (donation); the loops carry
``GCC ivdep`` so that the compiler neither versions nor de-vectorizes them for
that. Element types (per array): 0 float32, 1 bfloat16, 2 float16 (when the
compiler has ``_Float16``). Rounding to bfloat16 is round-to-nearest-even, a
nan stays a nan.
"""

from sofx.kernels.base import FINITE_CHUNK

SOURCE = r"""
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <float.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#define HW_RSQRT14 1
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define HW_BF16 1
#endif

#define TILE 128
#define MIN_PER_THREAD 65536
#ifndef PREFETCH_TILES
#define PREFETCH_TILES 2
#endif

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };
enum { OP_STEP = 0, OP_UNDO = 1, OP_UNDO_REDO = 2 };

/* Scalars of one step, as doubles computed on the host (index = meaning). */
enum {
  S_GRAD_SCALE, S_DECAY_FACTOR, S_WD, S_ONE_MINUS_B1, S_B1, S_B2, S_ONE_MINUS_B2,
  S_BC2_SQRT, S_EPS, S_STEP_SIZE, S_HAS_GRAD_SCALE, S_HAS_DECAY,
  S_LIMIT_F32, S_LIMIT_BF16, S_LIMIT_F16, S_LOSSY, S_L2_CV, S_L2_CM, S_L2_WA, S_L2_WB, S_L2_WKA, S_L2_WKB, S_P_KEPT,
  S_COUNT
};

/* lim[dtype]: a checked step flags a chunk whose gradient has an element whose magnitude bits (sign cleared)
   exceed lim, in the gradient's own dtype: an inf, a nan, or a finite value so large that its square (scaled)
   could overflow float32, whose step's inverse would be inf - inf (see Adam's undo strategies). lossy: it
   also flags a chunk whose step an algebraic inverse would restore too lossily (chunk_exact; base.py's
   lossy_factor, for any value: 0, a beta of 0 or a step from zero moments (StepCall.zero_moments), still flags
   a nan v and a non-finite m or gh). l2[]: cv, cm, wa, wb, wka, wkb of base.py's LossyL2 (its L2 terms,
   see chunk_exact), none where p_kept (the step's record keeps p: StepCall.p_kept). */
typedef struct {
  float gs, decay, wd, omb1, b1, b2, omb2, bc2, eps, ss, lossy, l2[6];
  int has_gs, has_decay, p_kept;
  uint32_t lim[3];
} Sc;

/* The square root: IEEE sqrtf, or the vector routine torch's own sqrt uses (MKL's
   vmsSqrt_64(n, in, out, mode)), so that results match torch bit for bit. MKL would
   open a parallel region per call when torch runs several threads; `local` (MKL's
   mkl_set_num_threads_local) makes each calling thread's calls sequential. */
typedef void (*vsqrt_fn)(int64_t, const float *, float *, int64_t);
typedef int (*local_threads_fn)(int);
typedef struct {
  vsqrt_fn fn;
  int64_t mode;
  local_threads_fn local;
  int replica;                       /* 0, or which inline replica of torch's square root stands in for fn (a
                                        REPLICA_* kind this build has, checked against torch.sqrt at load) */
} Sqrt;
/* The inline replicas of torch's square root, MKL's vmsSqrt: of its AVX-512 code path (what it runs on Intel CPUs
   with AVX-512; rsqrt14 and one multiply-add), of its generic one (what it runs on AMD CPUs, with or without
   AVX-512; rsqrtps and a Goldschmidt iteration) and of its AVX2 one (what it runs on Intel CPUs with AVX2 but
   not AVX-512; the generic one's steps as multiply-adds: correctly rounded but for tiny numbers, see
   mkl_avx2_replica8). AVX-512 builds have all three, AVX2 builds (with FMA) the generic and the AVX2 ones, the
   portable build none. REPLICA_IEEE stands for a torch whose square root is IEEE's (built without MKL, or not
   using it for sqrt): cpu's vector loops then take the hardware's square root with their true divisions (else
   the exact tile loops would run, with sqrtf, 1.1-1.8x slower); the builds with vector loops have it. Each is a
   bit in the mask sofx_has_sqrt_replica returns. */
enum { REPLICA_AVX512 = 1, REPLICA_GENERIC = 2, REPLICA_AVX2 = 4, REPLICA_IEEE = 8 };
#define REPLICA_KIND(sq) ((sq) ? (sq)->replica : 0)
/* The Sqrt a vector loop's step takes (both vector sections): with IEEE square roots cpu's step is cpu_fast's
   (only the inverse's divisions differ between the two). */
#define STEP_SQ(sq) (REPLICA_KIND(sq) == REPLICA_IEEE ? (const Sqrt *)0 : (sq))

typedef struct {
  int op, decoupled;
  int dp, dg, ds, dg2, dpo;          /* dtypes: p (and outputs), g, m/v, g_new, p_old */
  int64_t n;
  const void *p, *g, *m, *v, *g2, *pold;
  void *po, *mo, *vo;
  void *pc;                          /* 0, or where the new parameters also go (see copy_params) */
  int dpc;                           /* pc's dtype */
  uint8_t *skip;                     /* 0, or one flag per CHUNK elements: see run_range */
  const int64_t *chunks;             /* 0, or the listed chunks the job runs on (see run_listed) */
  int64_t leaf_n;                    /* with chunks: the block's elements (n: the listed chunks') */
  int packed;                        /* with chunks: p, m, v hold the listed chunks one after another */
  void *kp, *km, *kv;                /* with chunks: 0, or where the listed chunks' p, m, v are copied first */
  Sc s1, s2;
  Sqrt sq;
  int exact;                         /* bitwise the reference: the exact_* loops, divisions in the inverse */
  int64_t begin, end;
} Job;

int sofx_has_f16(void) {
#ifdef __FLT16_MAX__
  return 1;
#else
  return 0;
#endif
}

static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if (f != f) return (uint16_t)((u >> 16) | 0x0040u); /* quiet nan, sign kept */
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static void load(float *dst, const void *src, int dt, int64_t off, int n) {
  if (dt == DT_F32) {
    const float *s = (const float *)src + off;
    for (int i = 0; i < n; i++) dst[i] = s[i];
  } else if (dt == DT_BF16) {
    const uint16_t *s = (const uint16_t *)src + off;
    for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
  } else {
#ifdef __FLT16_MAX__
    const _Float16 *s = (const _Float16 *)src + off;
    for (int i = 0; i < n; i++) dst[i] = (float)s[i];
#endif
  }
}

#ifdef HW_BF16
/* 16 floats -> bfloat16, f32_to_bf16's bits (checked over all 2^32 floats, tests/test_cpu_division.py):
   the CPU's instruction (AVX512-BF16's vcvtneps2bf16: round-to-nearest-even, nan kept quiet with its
   sign and upper payload bits, as f32_to_bf16), which flushes subnormal inputs to zero; the subnormal
   lanes (one vfpclassps), rare, are rounded with integers in registers (f32_to_bf16's formula: no nan
   there). No scalar fall-back: until this stop a vector with any zero result went through a scalar
   loop, which made all-bf16 steps 3-4x slower where m and v are 0 (untouched embedding rows) and, kept
   in the loops as a cold path, cost registers. */
static inline __attribute__((always_inline)) __m256i cvt_bf16_16(__m512 x) {
  __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
  const __mmask16 sub = _mm512_fpclass_ps_mask(x, 0x20);
  if (__builtin_expect(sub != 0, 0)) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    h = _mm256_mask_mov_epi16(h, sub, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
  }
  return h;
}
#endif

/* Float tile -> bfloat16, bit for bit f32_to_bf16: 16 elements per instruction where the CPU converts
   in hardware (cvt_bf16_16). */
static inline void store_bf16(uint16_t *restrict d, const float *restrict s, int n) {
  int i = 0;
#ifdef HW_BF16
  for (; i + 16 <= n; i += 16) _mm256_storeu_si256((__m256i *)(d + i), cvt_bf16_16(_mm512_loadu_ps(s + i)));
#endif
  for (; i < n; i++) d[i] = f32_to_bf16(s[i]);
}

/* x = float(bfloat16(x)) on a tile (what storing and reloading a bfloat16 array gives). */
static inline void round_bf16(float *x, int n) {
  int i = 0;
#ifdef HW_BF16
  for (; i + 16 <= n; i += 16) {
    const __m256i h = cvt_bf16_16(_mm512_loadu_ps(x + i));
    _mm512_storeu_si512(x + i, _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
#endif
  for (; i < n; i++) x[i] = bf16_to_f32(f32_to_bf16(x[i]));
}

static void store(void *dst, int dt, int64_t off, const float *src, int n) {
  if (dt == DT_F32) {
    float *d = (float *)dst + off;
    for (int i = 0; i < n; i++) d[i] = src[i];
  } else if (dt == DT_BF16) {
    store_bf16((uint16_t *)dst + off, src, n);
  } else {
#ifdef __FLT16_MAX__
    _Float16 *d = (_Float16 *)dst + off;
    for (int i = 0; i < n; i++) d[i] = (_Float16)src[i];
#endif
  }
}

/* Round a float tile to dtype dt and back (an intermediate stored to memory). */
static void round_to(float *x, int dt, int n) {
  if (dt == DT_BF16) {
    round_bf16(x, n);
  } else if (dt == DT_F16) {
#ifdef __FLT16_MAX__
    for (int i = 0; i < n; i++) x[i] = (float)(_Float16)x[i];
#endif
  }
}

/* The steps of MKL's generic square root from the CPU's rsqrt estimate y of x (mkl_sqrt_formula8's comment gives
   them), on a vector type V with the intrinsics P##_*_ps, every operation rounded on its own: one definition for
   the AVX2 builds' 8-lane replica and the AVX-512 builds' 16-lane one, whose bits must agree. */
#define MKL_GENERIC_STEPS(name, V, P)                                              \
  static inline __attribute__((always_inline)) V name(V x, V y) {                 \
    const V half = P##_set1_ps(0.5f);                                              \
    const V s = P##_mul_ps(x, y);                                                  \
    const V h = P##_mul_ps(y, half);                                               \
    const V e = P##_sub_ps(half, P##_mul_ps(s, h));                                \
    const V s1 = P##_add_ps(P##_mul_ps(s, e), s);                                  \
    const V h1 = P##_add_ps(P##_mul_ps(e, h), h);                                  \
    return P##_add_ps(P##_mul_ps(P##_sub_ps(x, P##_mul_ps(s1, s1)), h1), s1);      \
  }

#if defined(__AVX2__) && defined(__FMA__)
/* MKL's high-accuracy float32 square root where it runs its AVX2 code path (Intel CPUs with AVX2 but without
   AVX-512; any Intel CPU under MKL_ENABLE_INSTRUCTIONS=AVX2): the generic path's steps (MKL_GENERIC_STEPS) with
   every multiply and add fused, from the CPU's rsqrtps estimate y:
     s = x*y,  h = y/2,  e = fma(-s, h, 1/2),  s1 = fma(s, e, s),  h1 = fma(h, e, h),
     sqrt(x) ~ fma(fma(-s1, s1, x), h1, s1).
   That is correctly rounded (IEEE sqrtf's result) for every x >= 2^-104, but not for the tiny normal x below,
   where the remainder x - s1*s1 is subnormal (about 1% of them an ulp off); for +-0, the subnormals, +inf and
   nans MKL's results are sqrtf's, and a negative non-nan x gives the positive default nan 0x7FC00000 (sqrtps:
   the negative one). So the replica is the CPU's square root where no lane is below 2^-104 but +0 (two compares
   and a test beyond it), else mkl_avx2_rare*: the formula on the tiny normal lanes, MKL's nan on the negative
   ones. tests/test_cpu_mkl_sqrt.py compares it with torch.sqrt on every float32 bit pattern where MKL runs
   this code path (test_the_avx2_code_paths_replica_under_mkl_enable_instructions). */
#define MKL_AVX2_STEPS(name, V, P)                                                 \
  static inline __attribute__((always_inline)) V name(V x, V y) {                 \
    const V half = P##_set1_ps(0.5f);                                              \
    const V s = P##_mul_ps(x, y);                                                  \
    const V h = P##_mul_ps(y, half);                                               \
    const V e = P##_fnmadd_ps(s, h, half);                                         \
    const V s1 = P##_fmadd_ps(s, e, s);                                            \
    const V h1 = P##_fmadd_ps(h, e, h);                                            \
    return P##_fmadd_ps(P##_fnmadd_ps(s1, s1, x), h1, s1);                         \
  }
MKL_AVX2_STEPS(mkl_avx2_steps8, __m256, _mm256)
static __attribute__((noinline, unused)) __m256 mkl_avx2_rare8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i tiny = _mm256_andnot_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(0x00800000), bits),
                                           _mm256_cmpgt_epi32(_mm256_set1_epi32(0x0B800000), bits)); /* 2^-126.. */
  const __m256 r = _mm256_blendv_ps(_mm256_sqrt_ps(x), mkl_avx2_steps8(x, _mm256_rsqrt_ps(x)),
                                    _mm256_castsi256_ps(tiny));
  const __m256 neg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ); /* not -0, not a nan */
  return _mm256_blendv_ps(r, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), neg);
}
static inline __attribute__((always_inline)) __m256 mkl_avx2_replica8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i low = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x0B800000), bits); /* < 2^-104, negatives included */
  const __m256i plus_zero = _mm256_cmpeq_epi32(bits, _mm256_setzero_si256());
  if (__builtin_expect(_mm256_testc_si256(plus_zero, low), 1)) return _mm256_sqrt_ps(x); /* low lanes all +0 */
  return mkl_avx2_rare8(x);
}
#endif

#ifdef HW_RSQRT14
/* MKL's high-accuracy float32 square root as ATen calls it (vmsSqrt, its AVX-512 code path), computed
   inline: y = rsqrt14(x) (the instruction's result is defined bit for bit), s = x*y, then one
   multiply-add correction s + (x - s*s) * (y/2). Within an ulp, not always correctly rounded: this is
   where MKL's bits differ from IEEE sqrtf (0.6% of values). Equal to MKL's for every x in
   [2^-95, FLT_MAX], nan, +-0, +inf and every negative number; below 2^-95 (tiny positive x, subnormals
   included) MKL's result is the formula's on x * 2^64, times 2^-32 (both exact scalings). Every float
   of those ranges that matters is compared in tests/test_cpu_mkl_sqrt.py (all 2^28 tiny ones among
   them). The library uses it only where a check at load (sofx.kernels._cpu_build) finds it equal to
   torch.sqrt, i.e. where torch's MKL takes this code path. */
static inline __attribute__((always_inline)) __m512 mkl_sqrt_formula(__m512 x) {
  const __m512 y = _mm512_rsqrt14_ps(x);
  const __m512 s0 = _mm512_mul_ps(x, y);
  const __m512 r = _mm512_fnmadd_ps(s0, s0, x);
  return _mm512_fmadd_ps(r, _mm512_mul_ps(y, _mm512_set1_ps(0.5f)), s0);
}

/* The replica on one vector. The usual vector, every lane in [2^-95, FLT_MAX], costs one integer compare
   beyond the formula; the others (zeros, tiny values, infinities, nans, negatives) a few more operations.
   Tiny lanes go through the formula only scaled: on x itself its remainder x - s*s would be subnormal,
   and subnormal results cost a microcode assist each (this, and a call to MKL for such vectors, made the
   exact step 6-8x slower where second moments had decayed below 2^-95 and the gradient was 0: rows of
   an embedding unused for ~50k steps). */
static inline __attribute__((always_inline)) __m512 mkl_sqrt_replica16(__m512 x) {
  /* bits - bits(2^-95) < bits(inf) - bits(2^-95), unsigned: 2^-95 <= x <= FLT_MAX */
  const __m512i u = _mm512_sub_epi32(_mm512_castps_si512(x), _mm512_set1_epi32(0x10000000));
  const __mmask16 direct = _mm512_cmplt_epu32_mask(u, _mm512_set1_epi32(0x7F800000 - 0x10000000));
  if (__builtin_expect(direct == (__mmask16)0xFFFF, 1)) return mkl_sqrt_formula(x);
  /* the tiny lanes (0 < x < 2^-95, subnormals included: positive bit patterns below 2^-95's) scaled */
  const __m512i bits = _mm512_castps_si512(x);
  const __mmask16 tiny = _mm512_cmplt_epu32_mask(_mm512_sub_epi32(bits, _mm512_set1_epi32(1)),
                                                 _mm512_set1_epi32(0x10000000 - 1));
  __m512 s = mkl_sqrt_formula(_mm512_mask_mul_ps(x, tiny, x, _mm512_set1_ps(0x1p64f)));
  s = _mm512_mask_mul_ps(s, tiny, s, _mm512_set1_ps(0x1p-32f));
  /* vectors of rows without gradient (lanes in range, +0 or tiny) stop here: formula(+0) is a nan (0 * inf),
     replaced by the +0 */
  const __mmask16 plus_zero = _mm512_testn_epi32_mask(bits, bits);
  if ((direct | tiny | plus_zero) == (__mmask16)0xFFFF) return _mm512_mask_mov_ps(s, plus_zero, x);
  const __m512 zero = _mm512_setzero_ps();
  const __mmask16 keep = _mm512_cmp_ps_mask(x, zero, _CMP_EQ_OQ) |
                         _mm512_cmp_ps_mask(x, _mm512_set1_ps(INFINITY), _CMP_EQ_OQ);
  const __mmask16 neg = _mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ);
  s = _mm512_mask_mov_ps(s, keep, x); /* nans: the formula's nan */
  return _mm512_mask_mov_ps(s, neg, _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000))); /* MKL's for x < 0 */
}

#ifndef HW_BF16
/* MKL's AVX-512 code path on 8 lanes, for the AVX2 loops of AVX-512 builds without bfloat16 conversion (and their
   tile routine, mkl_sqrt_replica below, so that the tests of sofx_sqrt check what the loops run): its formula with
   the 256-bit rsqrt14 (the same estimate per lane as the 512-bit one) where every lane is in [2^-95, FLT_MAX], as
   mkl_sqrt_replica16's usual vector; any other vector through mkl_sqrt_replica16 itself, the vector twice. */
static __attribute__((noinline)) __m256 mkl_avx512_path_rare8(__m256 x) {
  const __m512 twice = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(x)),
                                                           _mm256_castps_pd(x), 1));
  return _mm512_castps512_ps256(mkl_sqrt_replica16(twice));
}
static inline __attribute__((always_inline)) __m256 mkl_avx512_path_replica8(__m256 x) {
#ifdef __AVX512VL__
  const __m256i u = _mm256_sub_epi32(_mm256_castps_si256(x), _mm256_set1_epi32(0x10000000));
  if (__builtin_expect(_mm256_cmplt_epu32_mask(u, _mm256_set1_epi32(0x7F800000 - 0x10000000)) == 0xFF, 1)) {
    const __m256 y = _mm256_rsqrt14_ps(x);
    const __m256 s0 = _mm256_mul_ps(x, y);
    const __m256 r = _mm256_fnmadd_ps(s0, s0, x);
    return _mm256_fmadd_ps(r, _mm256_mul_ps(y, _mm256_set1_ps(0.5f)), s0);
  }
#endif
  return mkl_avx512_path_rare8(x);
}
#endif
/* MKL's generic code path on 16 lanes (AMD CPUs with AVX-512: Zen 4 and 5, where MKL does not take its
   AVX-512 path): the formula and the cases of mkl_sqrt_replica8 below (the AVX2 builds' replica, whose
   comment gives them), every operation rounded on its own, with the CPU's 8-lane rsqrtps estimate on
   each half of the vector (rsqrt14 is another, more accurate estimate; AVX-512 has no 16-lane rsqrtps). */
static inline __attribute__((always_inline)) __m512 rsqrt_estimate16(__m512 x) {
  const __m256 lo = _mm256_rsqrt_ps(_mm512_castps512_ps256(x));
  const __m256 hi = _mm256_rsqrt_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
}
MKL_GENERIC_STEPS(mkl_generic_steps16, __m512, _mm512)
static inline __attribute__((always_inline)) __m512 mkl_generic_formula16(__m512 x) {
  return mkl_generic_steps16(x, rsqrt_estimate16(x));
}
/* The formula on the tiny normal lanes (2^-126 <= x < 2^-102) scaled: x * 2^64 through it, the result times
   2^-32. On x itself the remainder x - s1*s1 is subnormal there, and subnormal operands and results cost a
   microcode assist each on this CPU (Zen 5: `cpu`'s undo+redo 2.9x slower on rows whose second moment had
   decayed to 1e-34, benchmarks/RESULTS.md); the Zen 3 of the AVX2 replica has no such cost (see
   mkl_sqrt_replica8). The bits are the same: rsqrtps of x * 4^32 is its estimate of x times 2^-32 (its table
   depends on the significand and the exponent's parity), so every intermediate scales by a power of two
   exactly, and the remainder, a difference of two floats within a factor of 2 of each other, is exact in
   both (Sterbenz; subnormal or not). */
static inline __attribute__((always_inline)) __m512 mkl_generic_scaled16(__m512 x, __mmask16 tiny) {
  const __m512 s = mkl_generic_formula16(_mm512_mask_mul_ps(x, tiny, x, _mm512_set1_ps(0x1p64f)));
  return _mm512_mask_mul_ps(s, tiny, s, _mm512_set1_ps(0x1p-32f));
}
static inline __attribute__((always_inline)) __mmask16 tiny_normal16(__m512i bits) { /* 2^-126 <= x < 2^-102 */
  return _mm512_cmplt_epu32_mask(_mm512_sub_epi32(bits, _mm512_set1_epi32(0x00800000)),
                                 _mm512_set1_epi32(0x0C800000 - 0x00800000));
}
/* The lanes outside the formula's range, as mkl_sqrt_rare8: sqrtps, and MKL's nan for negative numbers. */
static __attribute__((noinline)) __m512 mkl_generic_rare16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i sum = _mm512_add_epi32(bits, _mm512_set1_epi32(0x7F800000));
  const __mmask16 other = _mm512_cmpgt_epi32_mask(sum, _mm512_set1_epi32((int)0xFEFFF000));
  const __m512 r = _mm512_mask_sqrt_ps(mkl_generic_scaled16(x, tiny_normal16(bits)), other, x);
  const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ); /* not -0, not a nan */
  return _mm512_mask_mov_ps(r, neg, _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)));
}
/* The usual vector, every lane in [2^-102, 0x7F7FF000], costs one integer compare beyond the formula; vectors
   of tiny normal lanes and +0 (the rows without gradient for long: decayed or never touched) take the scaled
   formula inline, the others (subnormals, the largest floats, infinities, nans, negatives) a call. */
static inline __attribute__((always_inline)) __m512 mkl_generic_replica16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __mmask16 direct = _mm512_cmplt_epu32_mask(_mm512_sub_epi32(bits, _mm512_set1_epi32(0x0C800000)),
                                                   _mm512_set1_epi32(0x7F7FF001 - 0x0C800000));
  if (__builtin_expect(direct == (__mmask16)0xFFFF, 1)) return mkl_generic_formula16(x);
  const __mmask16 tiny = tiny_normal16(bits), plus_zero = _mm512_testn_epi32_mask(bits, bits);
  if ((direct | tiny | plus_zero) == (__mmask16)0xFFFF) /* formula(+0) is a nan (0 * inf): the +0 instead */
    return _mm512_mask_mov_ps(mkl_generic_scaled16(x, tiny), plus_zero, x);
  return mkl_generic_rare16(x); /* out of line, as mkl_sqrt_rare8 */
}

/* MKL's AVX2 code path on 16 lanes: mkl_avx2_replica8's cases, with the 8-lane rsqrtps estimate on each half. */
MKL_AVX2_STEPS(mkl_avx2_steps16, __m512, _mm512)
static __attribute__((noinline)) __m512 mkl_avx2_rare16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __mmask16 tiny = _mm512_cmplt_epu32_mask(_mm512_sub_epi32(bits, _mm512_set1_epi32(0x00800000)),
                                                 _mm512_set1_epi32(0x0B800000 - 0x00800000)); /* 2^-126.. */
  const __m512 r = _mm512_mask_mov_ps(_mm512_sqrt_ps(x), tiny, mkl_avx2_steps16(x, rsqrt_estimate16(x)));
  const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ); /* not -0, not a nan */
  return _mm512_mask_mov_ps(r, neg, _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)));
}
static inline __attribute__((always_inline)) __m512 mkl_avx2_replica16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __mmask16 low = _mm512_mask_cmplt_epi32_mask(_mm512_test_epi32_mask(bits, bits), bits,
                                                     _mm512_set1_epi32(0x0B800000)); /* < 2^-104 but +0 */
  if (__builtin_expect(low == 0, 1)) return _mm512_sqrt_ps(x);
  return mkl_avx2_rare16(x);
}

/* The AVX-512 path's replica as the build's loops take it: 16 lanes, or 8 at a time (see above). */
static inline __attribute__((always_inline)) __m512 mkl_avx512_path_replica16(__m512 x) {
#ifdef HW_BF16
  return mkl_sqrt_replica16(x);
#else
  const __m256 lo = mkl_avx512_path_replica8(_mm512_castps512_ps256(x));
  const __m256 hi = mkl_avx512_path_replica8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
#endif
}
static void mkl_sqrt_replica(float *restrict out, const float *restrict in, int n, int kind) {
  for (int i = 0; i < n; i += 16) {
    const __mmask16 lanes = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1u);
    const __m512 x = _mm512_maskz_loadu_ps(lanes, in + i);
    _mm512_mask_storeu_ps(out + i, lanes, kind == REPLICA_GENERIC ? mkl_generic_replica16(x)
                                          : kind == REPLICA_AVX2  ? mkl_avx2_replica16(x)
                                          : kind == REPLICA_IEEE  ? _mm512_sqrt_ps(x)
                                                                  : mkl_avx512_path_replica16(x));
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
#define HW_RSQRT8 1
/* MKL's high-accuracy float32 square root as ATen calls it, where MKL runs its generic SSE code path (seen on
   an AMD EPYC, Zen 3, which is not given MKL's AVX2 kernels), computed inline on 8 lanes: the rsqrt
   estimate y (the CPU's own instruction: its table differs between vendors, which the load-time check
   covers), s = x*y, h = y/2, then one Goldschmidt iteration and a final correction, every operation rounded
   on its own (no multiply-add; -ffp-contract=off keeps it so):
     e = 1/2 - s*h,  s1 = s*e + s,  h1 = e*h + h,  sqrt(x) ~ (x - s1*s1)*h1 + s1.
   Within an ulp, not always correctly rounded (17% of values differ from IEEE sqrtf there). MKL takes this
   formula where bits(x) + bits(+inf), as a signed 32-bit sum, is at most 0xFEFFF000: the positive normal x
   up to 0x7F7FF000 (just below FLT_MAX); for every other x (+-0, subnormals, the top 4095 floats, +inf,
   nans, negative numbers) its results are IEEE sqrtf's, except that a negative non-nan x gives the
   positive default nan 0x7FC00000 (sqrtps gives the negative one). tests/test_cpu_mkl_sqrt.py compares the
   replica with torch.sqrt on every float32 bit pattern. The library uses it only where a check at load
   (sofx.kernels._cpu_build) finds it equal to torch.sqrt, i.e. where torch's MKL takes this code path. */
MKL_GENERIC_STEPS(mkl_generic_steps8, __m256, _mm256)
static inline __attribute__((always_inline)) __m256 mkl_sqrt_formula8(__m256 x) {
  return mkl_generic_steps8(x, _mm256_rsqrt_ps(x));
}
/* The replica on one vector: the formula, and for a vector with a lane outside its range (rare in Adam's
   second moments: exact zeros, subnormals) sqrtps there and MKL's nan for negative numbers. Tiny normal x, whose
   remainder x - s1*s1 is subnormal, are not scaled into range first (as the AVX-512 replica does): on the
   AMD EPYC of benchmarks/RESULTS.md that made them slower (1.26 -> 1.55 ns per element), not faster. */
static __attribute__((noinline)) __m256 mkl_sqrt_rare8(__m256 x, __m256 other) {
  const __m256 r = _mm256_blendv_ps(mkl_sqrt_formula8(x), _mm256_sqrt_ps(x), other);
  const __m256 neg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ); /* not -0, not a nan */
  return _mm256_blendv_ps(r, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), neg);
}
static inline __attribute__((always_inline)) __m256 mkl_sqrt_replica8(__m256 x) {
  const __m256i sum = _mm256_add_epi32(_mm256_castps_si256(x), _mm256_set1_epi32(0x7F800000));
  const __m256 other = _mm256_castsi256_ps(_mm256_cmpgt_epi32(sum, _mm256_set1_epi32((int)0xFEFFF000)));
  if (__builtin_expect(_mm256_testz_ps(other, other), 1)) return mkl_sqrt_formula8(x);
  return mkl_sqrt_rare8(x, other); /* out of line: the loops stay smaller (and compile faster) */
}
/* kind: REPLICA_GENERIC, REPLICA_AVX2 or REPLICA_IEEE */
static inline __m256 replica8_of_kind(__m256 x, int kind) {
  return kind == REPLICA_AVX2 ? mkl_avx2_replica8(x) : kind == REPLICA_IEEE ? _mm256_sqrt_ps(x) : mkl_sqrt_replica8(x);
}
static void mkl_sqrt_replica(float *restrict out, const float *restrict in, int n, int kind) {
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, replica8_of_kind(_mm256_loadu_ps(in + i), kind));
  if (i < n) {
    float t[8] = {0};
    memcpy(t, in + i, sizeof(float) * (size_t)(n - i));
    _mm256_storeu_ps(t, replica8_of_kind(_mm256_loadu_ps(t), kind));
    memcpy(out + i, t, sizeof(float) * (size_t)(n - i));
  }
}
#endif

static void sqrt_tile(float *restrict out, const float *restrict in, const Sqrt *sq, int n) {
#if defined(HW_RSQRT14) || defined(HW_RSQRT8)
  if (sq->replica) {
    mkl_sqrt_replica(out, in, n, sq->replica);
    return;
  }
#endif
  if (sq->fn) {
    sq->fn((int64_t)n, in, out, sq->mode);
  } else {
    for (int i = 0; i < n; i++) out[i] = sqrtf(in[i]);
  }
}

static Sc make_sc(const double *d) {
  Sc s;
  s.gs = (float)d[S_GRAD_SCALE];
  s.decay = (float)d[S_DECAY_FACTOR];
  s.wd = (float)d[S_WD];
  s.omb1 = (float)d[S_ONE_MINUS_B1];
  s.b1 = (float)d[S_B1];
  s.b2 = (float)d[S_B2];
  s.omb2 = (float)d[S_ONE_MINUS_B2];
  s.bc2 = (float)d[S_BC2_SQRT];
  s.eps = (float)d[S_EPS];
  s.ss = (float)d[S_STEP_SIZE];
  s.has_gs = d[S_HAS_GRAD_SCALE] != 0.0;
  s.has_decay = d[S_HAS_DECAY] != 0.0;
  s.lim[DT_F32] = (uint32_t)d[S_LIMIT_F32];
  s.lim[DT_BF16] = (uint32_t)d[S_LIMIT_BF16];
  s.lim[DT_F16] = (uint32_t)d[S_LIMIT_F16];
  s.lossy = (float)d[S_LOSSY];
  for (int i = 0; i < 6; i++) s.l2[i] = (float)d[S_L2_CV + i];
  s.p_kept = d[S_P_KEPT] != 0.0;
  return s;
}

/* x / b from rb = RN(1/b) (rounded once: (float)(1.0 / (double)b)): the product q, the remainder
   r = b*q - x by one multiply-add, and one multiply-add correction q - r*rb (Markstein), in place
   of a division (the divider bounds these loops: a square root and two divisions per element of a
   step take about as long as the memory traffic on two cores). No test for the special cases: with
   the remainder taken this way round, x = +-0 gives q - (+0) = +-0 and a nan x its own (quieted) nan,
   and r clamped to FLT_MAX (a nan r, from x = +-inf, becomes FLT_MAX; the clamp is one min, which
   returns its second operand for a nan first one) keeps q = +-inf. That is one vector operation
   instead of a compare and a blend: the AVX2 undo's arithmetic 16% faster, the undo+redo's 9%
   (benchmarks/RESULTS.md "AVX2: one operation per division's guard").
   Exact, i.e. the bits of x / b, for every b with b and 1/b normal and every x with x / b finite and
   |x| >= 2^-78 (so that a nonzero r, a multiple of about |x| 2^-48, is normal), and for x 0, inf or
   nan; in particular for x = sqrt(v) (>= 2^-74.5 where not 0) over b = sqrt(1 - beta2^t) (>= 2^-12).
   Why: scaling x or b by a power of two scales every step exactly, so take x, b in [1, 2).
   |x/b - q| < 2^-23 and, with b*rb = 1 + d (|d| < 2^-24) and r = (x - b*q)(1 + e) (|e| <= 2^-24),
   q + r*rb = x/b + (x/b - q)(d + e + d*e): within 2^-46 (1 + 2^-25) of x/b. A quotient of two 24-bit
   significands X/B is never a rounding midpoint (an odd 25-bit number times a power of two) and lies
   at least N / (B 2^K) from one, N = |X 2^K - M B| a positive integer (K = 24 or 25, M odd); so the
   correction can round differently from x / b only where N <= 8. Those (x, b) pairs are few (about
   1.7e8 over all 2^23 x 2^23 significands) and tests/test_cpu_division.py computes every one of them
   with this function: none differs. Below that range (|x| < 2^-78; differences seen only below
   ~2^-100) the result may be an ulp off, and below it the remainder is subnormal: a microcode assist
   per element (quot_vec scales such x into the range). Where x / b overflows: +inf for a positive x (as
   the division), nan for a negative one (r = -inf there; the division gives -inf). */
static inline float div_by(float x, float b, float rb) {
  const float q = x * rb;
  const float r = fmaf(q, b, -x);
  const float rc = r < FLT_MAX ? r : FLT_MAX; /* minss: FLT_MAX for a nan r */
  return fmaf(-rc, rb, q);
}

/* One Adam step on a tile (P, G, M, V in float32; G is modified). */
static void step_tile(float *restrict P, float *restrict G, float *restrict M, float *restrict V,
                      float *restrict D, const Sqrt *sq, const Sc *s, int decoupled, int n) {
  if (s->has_gs) {
    const float gs = s->gs;
    for (int i = 0; i < n; i++) G[i] = G[i] * gs;
  }
  if (s->has_decay) {
    if (decoupled) {
      const float f = s->decay;
      for (int i = 0; i < n; i++) P[i] = P[i] * f;
    } else {
      const float wd = s->wd;
      for (int i = 0; i < n; i++) G[i] = fmaf(P[i], wd, G[i]); /* g.add(p, alpha=wd) */
    }
  }
  const float w = s->omb1; /* m.lerp(g, w) as torch: fma from the nearer end */
  if (fabsf(w) < 0.5f) {
    for (int i = 0; i < n; i++) M[i] = fmaf(w, G[i] - M[i], M[i]);
  } else {
    const float w1 = w - 1.0f;
    for (int i = 0; i < n; i++) M[i] = fmaf(w1, G[i] - M[i], G[i]);
  }
  const float b2 = s->b2, c2 = s->omb2; /* v.mul(b2).addcmul(g, g, value=1-b2) */
  for (int i = 0; i < n; i++) V[i] = fmaf(c2 * G[i], G[i], V[i] * b2);
  const float bc2 = s->bc2, eps = s->eps, nss = -s->ss; /* p.addcdiv(m, sqrt(v)/bc2 + eps, -ss) */
  sqrt_tile(D, V, sq, n);
  for (int i = 0; i < n; i++) {
    const float d = D[i] / bc2 + eps;
    P[i] = P[i] + (nss * M[i]) / d;
  }
}

/* The inverse on a tile: P, M, V hold the stepped values on entry, the restored ones on exit.
   With use_pold, P holds the snapshot of the old parameter on entry. */
static void undo_tile(float *restrict P, float *restrict G, float *restrict M, float *restrict V,
                      float *restrict D, const Sqrt *sq, const Sc *s, int decoupled, int use_pold, int n) {
  if (s->has_gs) {
    const float gs = s->gs;
    for (int i = 0; i < n; i++) G[i] = G[i] * gs;
  }
  if (!use_pold) {
    const float bc2 = s->bc2, eps = s->eps, ss = s->ss;
    sqrt_tile(D, V, sq, n);
    for (int i = 0; i < n; i++) {
      const float d = D[i] / bc2 + eps;
      P[i] = P[i] + (ss * M[i]) / d; /* u as the step computed it: (ss * m) / d */
    }
    if (decoupled && s->has_decay) {
      const float f = s->decay;
      for (int i = 0; i < n; i++) P[i] = P[i] / f;
    }
  }
  if (!decoupled && s->has_decay) {
    const float wd = s->wd;
    for (int i = 0; i < n; i++) G[i] = fmaf(P[i], wd, G[i]);
  }
  const float omb1 = s->omb1, b1 = s->b1, omb2 = s->omb2, b2 = s->b2;
  for (int i = 0; i < n; i++) M[i] = (M[i] - omb1 * G[i]) / b1;
  for (int i = 0; i < n; i++) {
    const float x = (V[i] - (omb2 * G[i]) * G[i]) / b2; /* the step's rounding of its term: 0 comes back 0 */
    V[i] = x < 0.0f ? 0.0f : x; /* clamp at 0, nan stays nan */
  }
}

/* Ask for the cache line at byte `off` of an array, for reading (locality 3: into L1). The address is
   computed as an integer: the fused loops prefetch a fixed distance ahead, past the end of the array
   near its end, where a prefetch does not fault (and pointer arithmetic would be undefined). */
static inline void prefetch_line(const void *base, int64_t off) {
  __builtin_prefetch((const void *)((uintptr_t)base + (uintptr_t)off), 0, 3);
}

/* How far ahead the fused loops prefetch their streams (benchmarks/RESULTS.md "Prefetch": 1-2 KiB did
   best at 2^26 elements, 512 bytes less). */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 1024
#endif

/* Software prefetch of the tile `ahead` tiles on: the hardware prefetchers see each array in
   bursts of one tile and ramp up too slowly for L3-resident data. */
static void prefetch(const void *base, int dt, int64_t off, int64_t end) {
  if (!base || off >= end) return;
  const int es = dt == DT_F32 ? 4 : 2;
  const int64_t bytes = ((end - off) < TILE ? (end - off) : TILE) * es;
  for (int64_t k = 0; k < bytes; k += 64) prefetch_line(base, off * es + k);
}

static void run_tiles(const Job *j) {
  float P[TILE], G[TILE], M[TILE], V[TILE], D[TILE];
  const int restore = (j->sq.fn && j->sq.local) ? j->sq.local(1) : -1;
  for (int64_t off = j->begin; off < j->end; off += TILE) {
    const int n = (int)((j->end - off) < TILE ? (j->end - off) : TILE);
    const int64_t pf = off + PREFETCH_TILES * TILE;
    prefetch(j->op != OP_STEP && j->pold ? j->pold : j->p, j->op != OP_STEP && j->pold ? j->dpo : j->dp, pf, j->end);
    prefetch(j->g, j->dg, pf, j->end);
    prefetch(j->m, j->ds, pf, j->end);
    prefetch(j->v, j->ds, pf, j->end);
    if (j->op == OP_UNDO_REDO) prefetch(j->g2, j->dg2, pf, j->end);
    if (j->op != OP_STEP && j->pold) load(P, j->pold, j->dpo, off, n);
    else load(P, j->p, j->dp, off, n);
    load(G, j->g, j->dg, off, n);
    load(M, j->m, j->ds, off, n);
    load(V, j->v, j->ds, off, n);
    if (j->op == OP_STEP) {
      step_tile(P, G, M, V, D, &j->sq, &j->s1, j->decoupled, n);
    } else {
      undo_tile(P, G, M, V, D, &j->sq, &j->s1, j->decoupled, j->pold != 0, n);
      if (j->op == OP_UNDO_REDO) {
        round_to(P, j->dp, n);
        round_to(M, j->ds, n);
        round_to(V, j->ds, n);
        load(G, j->g2, j->dg2, off, n);
        step_tile(P, G, M, V, D, &j->sq, &j->s2, j->decoupled, n);
      }
    }
    store(j->po, j->dp, off, P, n);
    store(j->mo, j->ds, off, M, n);
    store(j->vo, j->ds, off, V, n);
  }
  if (restore >= 0) j->sq.local(restore);
}

/* ---------------------------------------------------------------- fused path
   One loop per (param, grad, state) dtype combination, one element at a time from memory
   to memory (bfloat16 outputs through small tiles, see FUSED): loads, math and stores
   interleave, so the memory streams never stall on a compute phase. Same operations as
   step_tile/undo_tile, with loop-invariant selects in place of branches (multiplying by 1.0f
   or dividing by 1.0f is exact), and IEEE sqrtf. */
typedef struct {
  float gs, pmul, wd, coef, b2, c2, bc2, rbc2, eps, nss;
  int l2, small;
} StepK;

typedef struct {
  float gs, pdiv, wd, bc2, eps, ss, omb1, b1, omb2, b2;
  float rbc2, rpdiv, rb1, rb2; /* reciprocals of bc2, pdiv, b1, b2 (the fast inverse) */
  int l2;
} UndoK;

static StepK step_k(const Sc *s, int decoupled) {
  StepK k;
  k.gs = s->has_gs ? s->gs : 1.0f;
  k.pmul = (decoupled && s->has_decay) ? s->decay : 1.0f;
  k.wd = s->wd;
  k.l2 = !decoupled && s->has_decay;
  k.small = fabsf(s->omb1) < 0.5f;
  k.coef = k.small ? s->omb1 : s->omb1 - 1.0f;
  k.b2 = s->b2;
  k.c2 = s->omb2;
  k.bc2 = s->bc2;
  k.rbc2 = (float)(1.0 / (double)s->bc2);
  k.eps = s->eps;
  k.nss = -s->ss;
  return k;
}

static UndoK undo_k(const Sc *s, int decoupled) {
  UndoK k;
  k.gs = s->has_gs ? s->gs : 1.0f;
  k.pdiv = (decoupled && s->has_decay) ? s->decay : 1.0f;
  k.wd = s->wd;
  k.l2 = !decoupled && s->has_decay;
  k.bc2 = s->bc2;
  k.eps = s->eps;
  k.ss = s->ss;
  k.omb1 = s->omb1;
  k.b1 = s->b1;
  k.omb2 = s->omb2;
  k.b2 = s->b2;
  k.rbc2 = (float)(1.0 / (double)k.bc2);
  k.rpdiv = (float)(1.0 / (double)k.pdiv);
  k.rb1 = (float)(1.0 / (double)k.b1);
  k.rb2 = (float)(1.0 / (double)k.b2);
  return k;
}

/* The step up to the square root: decayed p, m', v' (P, M, V updated in place). */
static inline void step_pre(float *P, float G, float *M, float *V, const StepK *k) {
  float g = G * k->gs;
  const float p = *P * k->pmul;
  g = k->l2 ? fmaf(p, k->wd, g) : g;
  *M = fmaf(k->coef, g - *M, k->small ? *M : g);
  *V = fmaf(k->c2 * g, g, *V * k->b2);
  *P = p;
}

/* The parameter update, given D = sqrt(v'); D / sqrt(bc2) by div_by (exact there). */
static inline float step_post(float P, float M, float D, const StepK *k) {
  const float d = div_by(D, k->bc2, k->rbc2) + k->eps;
  return P + (k->nss * M) / d;
}

static inline void step_elem(float *P, float G, float *M, float *V, const StepK *k) {
  step_pre(P, G, M, V, k);
  *P = step_post(*P, *M, sqrtf(*V), k);
}

/* x / b, a true division (fast 0) or div_by (fast 1: cpu_fast's inverse, by beta1, beta2, 1 - lr*wd; the
   inverse is an approximation of a few ulps anyway, and a true float reciprocal alone would be 1.5 ulps
   off, wrong for 27% of all x); fast is a constant at every call site. The vector loops (quot_vec)
   differ for 0 < |x| < 2^-78 only: see there. */
static inline float quot(float x, float b, float rb, int fast) {
  return fast ? div_by(x, b, rb) : x / b;
}

/* The inverse given D = sqrt(v') (unused with have_p_old). P: the stepped parameter
   (have_p_old 0) or the snapshot of the old one (have_p_old 1). u = (ss * m) / d is recomputed
   as the step computed it, so that p' + u recovers p where p is small against u.
   D / sqrt(bc2) is div_by on both paths (exact there). The divisions by 1 - lr*wd, beta1 and beta2:
   fast 0 true divisions, as the reference (the exact path); fast 1 (cpu_fast's fused loops) div_by,
   an ulp off only for tiny or huge operands; with true divisions the fused undo+redo would do six
   divisions and two square roots per element and be bound by the divider. */
static inline void undo_elem_d(float *P, float G, float *M, float *V, float D, const UndoK *k, int have_p_old,
                               int fast) {
  float g = G * k->gs;
  float p = *P;
  if (!have_p_old) {
    const float d = div_by(D, k->bc2, k->rbc2) + k->eps;
    p = quot(p + (k->ss * *M) / d, k->pdiv, k->rpdiv, fast);
  }
  g = k->l2 ? fmaf(p, k->wd, g) : g;
  const float m = quot(*M - k->omb1 * g, k->b1, k->rb1, fast);
  const float x = quot(*V - (k->omb2 * g) * g, k->b2, k->rb2, fast); /* (the step's term: see undo_tile) */
  *P = p;
  *M = m;
  *V = x < 0.0f ? 0.0f : x;
}

/* Outputs may be the inputs' own storage, element for element (buffer donation): there is no
   dependence between iterations, only within one, which vectorization keeps. (clang: its own pragma.) */
#if defined(__clang__)
#define IVDEP _Pragma("clang loop vectorize(assume_safety)")
#else
#define IVDEP _Pragma("GCC ivdep")
#endif

#define LD_0(ptr, i) (((const float *)(ptr))[i])
#define LD_1(ptr, i) bf16_to_f32(((const uint16_t *)(ptr))[i])
#define LD_2(ptr, i) ((float)((const _Float16 *)(ptr))[i])

/* The loops run per chunk of FTILE elements: float32 outputs are stored as they are computed,
   bfloat16 ones go to a float tile that store_bf16 converts after the loop, and with a bfloat16
   storage the undone values of an undo+redo are rounded by round_bf16 between an undo loop and a
   redo loop (with float32 storage it is one loop). A hardware conversion (where the CPU has one)
   takes one instruction per 16 elements where rounding in software inline takes eight vector
   operations, and the bfloat16 loops were bound by those rather than by memory. */
#ifndef FTILE
#define FTILE 256
#endif

/* The (param, grad, state) storage dtypes with loops of their own (0 float32, 1 bfloat16): all fp32
   with fp32 or bf16 states; bf16 params and grads with fp32 or bf16 states; bf16 params with fp32
   grads and fp32 or bf16 states. Every other combination runs run_tiles. */
#define NATIVE_COMBOS(X) X(0, 0, 0) X(0, 0, 1) X(1, 1, 0) X(1, 1, 1) X(1, 0, 0) X(1, 0, 1)
#define TST_0(ptr, T, e, i, x) (((float *)(ptr))[e] = (x))
#define TST_1(ptr, T, e, i, x) ((T)[i] = (x))
#define TFLUSH_0(ptr, off, T, n)
#define TFLUSH_1(ptr, off, T, n) store_bf16((uint16_t *)(ptr) + (off), (T), (n))
#define TRT_0(T, n)
#define TRT_1(T, n) round_bf16((T), (n))

/* The step of the compiler-vectorized loops (the build without AVX-512, e.g. AVX2 CPUs) prefetches
   the line 1 KiB ahead in each float32 stream, 16 elements at a time: measured by building without
   AVX-512 (-mno-avx512f) on the benchmark machine, the float32 step at 2^26 elements 46.8-47.2 ->
   39.0-39.2 ms. Not done where a dtype is bfloat16 or float16 (there the split loop was slower:
   45.8 -> 54 ms), nor in the inverse (77 -> 87 ms: compute bound there). */
#define STEP_STRIDE(DP, DG, DS) ((DP || DG || DS) ? FTILE : 16)
static inline int prefetch_lines(const void *p, const void *g, const void *m, const void *v, int64_t e) {
  prefetch_line(p, e * 4 + PREFETCH_BYTES);
  prefetch_line(g, e * 4 + PREFETCH_BYTES);
  prefetch_line(m, e * 4 + PREFETCH_BYTES);
  prefetch_line(v, e * 4 + PREFETCH_BYTES);
  return 1;
}

#define UNDO_LOOP(DP, DG, DS, PSRC, HAVE_P_OLD, REDO)                              \
  for (int64_t off = begin; off < end; off += FTILE) {                             \
    const int n = (int)((end - off) < FTILE ? (end - off) : FTILE);                \
    IVDEP for (int i = 0; i < n; i++) {                                            \
      const int64_t e = off + i;                                                   \
      float P = LD_##DP(PSRC, e), M = LD_##DS(m, e), V = LD_##DS(v, e);            \
      undo_elem_d(&P, LD_##DG(g, e), &M, &V, HAVE_P_OLD ? 0.0f : sqrtf(V), &u, HAVE_P_OLD, 1); \
      if (REDO && (DP || DS)) {                                                    \
        PT[i] = P;                                                                 \
        MT[i] = M;                                                                 \
        VT[i] = V;                                                                 \
      } else {                                                                     \
        if (REDO) step_elem(&P, LD_##DG(g2, e), &M, &V, &k);                       \
        TST_##DP(po, PT, e, i, P);                                                 \
        TST_##DS(mo, MT, e, i, M);                                                 \
        TST_##DS(vo, VT, e, i, V);                                                 \
      }                                                                            \
    }                                                                              \
    if (REDO && (DP || DS)) {                                                      \
      TRT_##DP(PT, n);                                                             \
      TRT_##DS(MT, n);                                                             \
      TRT_##DS(VT, n);                                                             \
      IVDEP for (int i = 0; i < n; i++) {                                          \
        const int64_t e = off + i;                                                 \
        float P = PT[i], M = MT[i], V = VT[i];                                     \
        step_elem(&P, LD_##DG(g2, e), &M, &V, &k);                                 \
        TST_##DP(po, PT, e, i, P);                                                 \
        TST_##DS(mo, MT, e, i, M);                                                 \
        TST_##DS(vo, VT, e, i, V);                                                 \
      }                                                                            \
    }                                                                              \
    TFLUSH_##DP(po, off, PT, n);                                                   \
    TFLUSH_##DS(mo, off, MT, n);                                                   \
    TFLUSH_##DS(vo, off, VT, n);                                                   \
  }

/* Software prefetch of the line PREFETCH_BYTES ahead in every stream the vector loops read, one
   prefetch per stream and vector (a bfloat16 stream's line is asked for twice: cheaper than testing).
   The hardware prefetchers alone leave 5 or 6 streams read and 3 written at one page offset short of
   the bandwidth; with this the float32 step at 2^26 elements went from 43.6 to 37.9 ms and the
   undo+redo with a new gradient from 58.5 to 48.9 ms (benchmarks/RESULTS.md "Prefetch"; 4096 bytes
   ahead as good as 1024-2048 for the step, worse for the undo+redo; NTA hints made the undo+redo
   slower). The streams' distances are staggered by PREFETCH_STAGGER bytes (p, g, m, v, g2 in that
   order), so that the lines in flight at one moment lie at different page offsets although torch gives
   the arrays one: the undo+redo with a new gradient 3% faster, the step unchanged (RESULTS.md
   "Staggered prefetch": 0 to 448 bytes tried; the traffic-only floor does not move, the arithmetic
   hides better behind it). */
#define PREFETCH_STAGGER 320
/* (the vector loops' only: unused in the portable build) */
static inline __attribute__((unused)) void prefetch_at(const void *base, int64_t e, int es, int stream) {
  prefetch_line(base, e * es + PREFETCH_BYTES + stream * PREFETCH_STAGGER);
}
/* The same for a stream the loop writes but does not read (its outputs elsewhere than its inputs: a step
   out of place, from a snapshot's kept values): asked for with the intent to write, so that the store
   does not wait for the line. */
static inline __attribute__((unused)) void prefetch_out(void *base, int64_t e, int es, int stream) {
  __builtin_prefetch((void *)((uintptr_t)base + (uintptr_t)(e * es + PREFETCH_BYTES + stream * PREFETCH_STAGGER)),
                     1, 3);
}
#define ES_0 4
#define ES_1 2
/* The arrays of a step (and the new gradient where with_g2 is set) at element e. */
#define PREFETCH_ARRAYS(DP, DG, DS, a, e, with_g2)                                      \
  do {                                                                             \
    prefetch_at((a).p, (e), ES_##DP, 0);                                           \
    prefetch_at((a).g, (e), ES_##DG, 1);                                           \
    prefetch_at((a).m, (e), ES_##DS, 2);                                           \
    prefetch_at((a).v, (e), ES_##DS, 3);                                           \
    if (with_g2) prefetch_at((a).g2, (e), ES_##DG, 4);                             \
    if ((a).po != (const void *)(a).p) {                                           \
      prefetch_out((a).po, (e), ES_##DP, 5);                                       \
      prefetch_out((a).mo, (e), ES_##DS, 6);                                       \
      prefetch_out((a).vo, (e), ES_##DS, 7);                                       \
    }                                                                              \
  } while (0)

/* The arrays of a job (a local copy: stores through po/mo/vo cannot alias it). */
typedef struct {
  const void *p, *g, *m, *v, *g2;
  void *po, *mo, *vo;
} Arrays;

/* Elements per chunk (FINITE_CHUNK, put in by the module below): copy_params runs after the step of each chunk,
   and the finiteness check (skip) is per chunk, in L2 when the copy reads it. A multiple of XTILE (so of TILE
   and FTILE: the exact loops' square-root chunks stay where they were) and of 16 (the vector loops' scan of the
   next chunk). */
#define CHUNK @FINITE_CHUNK@

/* 1 if no element of g[begin, end) (of dtype dg) has magnitude bits above lim (an inf or a nan has the
   largest: see Sc.lim). */
static int chunk_finite(const void *g, int dg, int64_t begin, int64_t end, uint32_t lim) {
  if (dg == DT_F32) {
    const uint32_t *u = (const uint32_t *)g;
    uint32_t bad = 0;
    for (int64_t i = begin; i < end; i++) bad |= (u[i] & 0x7FFFFFFFu) > lim;
    return !bad;
  }
  const uint16_t *u = (const uint16_t *)g;
  uint32_t bad = 0;
  for (int64_t i = begin; i < end; i++) bad |= (uint32_t)(u[i] & 0x7FFFu) > lim;
  return !bad;
}

/* 1 if the step of the job's elements [begin, end) (of an undo+redo: its redo) can be undone algebraically
   within DESIGN.md's tolerance (base.py's lossy_elements, the same operations in the same order): no element
   with not (gh * gh * c <= v), c the step's Sc.lossy, gh its effective gradient (g * gs, plus wd * p in L2
   mode), v the second moment before it: a zero v with a nonzero gh is flagged (a redo with a much smaller
   gradient would magnify any leftover of its inverse, see base.py's LOSSY_V_RATIO; a leaf's first step has
   c = 0: StepCall.zero_moments) unless m is 0 too and zok (base.py's zeros_come_back: float32 moments, no L2
   decay): the inverse then gives both back exactly (it subtracts the step's own roundings). An undo+redo's is
   the undone one: b2 times it, v' - (1 - b2) gh_old^2 (at least 0), against b2 (gh * gh * c) (no division),
   gh_old the old gradient's (p: p_old where given, else p', in L2 mode what the inverse recovers from it: pest),
   and its undone m's numerator m' - (1 - b1) gh_old.
   A non-finite gh * gh * c is flagged whatever v (an inf or nan p in L2 mode: its inverse gives nan moments); a
   non-finite m (m' of an undo+redo) too: its inverse gives nan p. In L2 mode (base.py's _l2_term, the inverse's
   p an ulp of p' off, times wd in gh) gh * gh * c is max(gh * gh * c, (A + |gh|) |gh| cv, (B + |gh|)^2 cm), A = |p|
   wa + q wka, B = |p| wb + q wkb, q = |m'| / sqrt(v') (0 where m' is 0; m' = r1 mb + (1 - b1) gh, v' = r2 v + ((1 -
   b2) gh) gh; mb: m, an undo+redo's undone numerator m' - (1 - b1) gh_old; r1, r2: b1, b2, an undo+redo's b1 /
   b1_old, b2 / b2_old), a nan term leaving the others' maximum; then times b2s. */
/* The constants of that test for a job (n: the step taken, o: an undo+redo's undone one). */
typedef struct {
  float c, b2s, gsn, wdn, gso, wdo, omb2o, omb1o;
  float cv, cm, wa, wb, wka, wkb, r1, r2, omb1n, omb2n; /* L2 mode's (base.py's LossyL2) */
  float sso, bc2o, epso; /* the undone step's (pest) */
  int l2n, l2o, zok; /* zok: moments exactly 0 come back exactly 0 (their elements not flagged) */
  int pest; /* an undo+redo in L2 mode given p' (no p_old): p is what the inverse recovers (base.py's
               _recovered_param), p + (ss m) / (sqrt(v) / bc2 + eps) of the undone step, before the test */
  int l2t; /* the L2 term: l2n, but where the step's record keeps p */
} LossyK;
static LossyK lossy_k(const Job *j) {
  const int redo = j->op == OP_UNDO_REDO;
  const Sc *sn = redo ? &j->s2 : &j->s1, *so = &j->s1;
  LossyK x;
  x.c = sn->lossy;
  x.b2s = redo ? so->b2 : 1.0f; /* (a product with 1 is exact) */
  x.gsn = sn->has_gs ? sn->gs : 1.0f;
  x.gso = so->has_gs ? so->gs : 1.0f;
  /* (as the step's l2: has_decay, also where the decay rounds to 0 in float32, whose fmaf(p, 0, g) makes an inf p's
     moments nan) */
  x.l2n = !j->decoupled && sn->has_decay;
  x.l2o = redo && !j->decoupled && so->has_decay;
  x.wdn = sn->wd;
  x.wdo = so->wd;
  x.omb2o = so->omb2;
  x.omb1o = so->omb1;
  x.zok = j->ds == DT_F32 && !x.l2n && !x.l2o;
  x.pest = redo && !j->pold && (x.l2n || x.l2o);
  x.sso = so->ss;
  x.bc2o = so->bc2;
  x.epso = so->eps;
  x.l2t = x.l2n && !sn->p_kept;
  x.cv = sn->l2[0];
  x.cm = sn->l2[1];
  x.wa = sn->l2[2];
  x.wb = sn->l2[3];
  x.wka = sn->l2[4];
  x.wkb = sn->l2[5];
  x.r1 = redo ? (float)((double)sn->b1 / (double)so->b1) : sn->b1;
  x.r2 = redo ? (float)((double)sn->b2 / (double)so->b2) : sn->b2;
  x.omb1n = sn->omb1;
  x.omb2n = sn->omb2;
  return x;
}
static int chunk_exact(const Job *j, int64_t begin, int64_t end) {
  const int redo = j->op == OP_UNDO_REDO;
  const LossyK x = lossy_k(j);
  const void *pp = redo && j->pold ? j->pold : j->p;
  const int dpp = redo && j->pold ? j->dpo : j->dp;
  float P[TILE], G[TILE], G2[TILE], M[TILE], V[TILE];
  const float *Z = redo ? G2 : M; /* 0 where the moments' m is (a redo's: the undone m's numerator) */
  /* |v| + |z| + zk is 0 exactly at the moments exactly 0 that zok exempts (nonnegative terms: no cancellation,
     a nan stays a nan); in float arithmetic, which GCC vectorizes where an int test of the two was not */
  const float zk = x.zok ? 0.0f : 1.0f;
  int bad = 0;
  for (int64_t off = begin; off < end && !bad; off += TILE) {
    const int n = (int)(end - off < TILE ? end - off : TILE);
    load(M, j->m, j->ds, off, n);
    load(V, j->v, j->ds, off, n);
    load(G, j->g, j->dg, off, n);
    if (x.l2n || x.l2o) load(P, pp, dpp, off, n);
    if (x.pest)
      for (int i = 0; i < n; i++) P[i] = P[i] + (x.sso * M[i]) / (sqrtf(V[i]) / x.bc2o + x.epso);
    if (redo) {
      load(G2, j->g2, j->dg2, off, n);
      for (int i = 0; i < n; i++) {
        float go = G[i] * x.gso;
        if (x.l2o) go = go + P[i] * x.wdo;
        const float u = V[i] - x.omb2o * go * go;
        V[i] = u < 0.0f ? 0.0f : u;
        G[i] = G2[i];
        G2[i] = M[i] - x.omb1o * go; /* the undone m's numerator (0 where the undone m is 0) */
      }
    }
    for (int i = 0; i < n; i++) {
      float gh = G[i] * x.gsn;
      if (x.l2n) gh = gh + P[i] * x.wdn;
      float t = gh * gh * x.c;
      if (x.l2t) { /* Z: mb */
        const float mp = Z[i] * x.r1 + gh * x.omb1n, vp = V[i] * x.r2 + gh * x.omb2n * gh;
        const float q = mp == 0.0f ? 0.0f : fabsf(mp) / sqrtf(vp);
        const float ap = fabsf(P[i]), ag = fabsf(gh);
        const float a = ap * x.wa + q * x.wka + ag, b = ap * x.wb + q * x.wkb + ag;
        const float t1 = a * ag * x.cv, t2 = b * b * x.cm;
        if (t1 > t) t = t1;
        if (t2 > t) t = t2;
      }
      t = t * x.b2s;
      const float nz = fabsf(V[i]) + fabsf(Z[i]) + zk;
      bad |= (!(t <= V[i]) & (nz != 0.0f)) | !(t <= FLT_MAX) | !(fabsf(M[i]) <= FLT_MAX);
    }
  }
  return !bad;
}

/* 1 if the next chunk's elements the loop's vectors did not read (its partial last vector; see LOSSY_AT) are
   flagged by chunk_exact. */
#define LOSSY_REST_BAD(j, begin, scan_end)                                         \
  (!chunk_exact((j), (begin) + CHUNK + ((scan_end) - (begin) - CHUNK) / 16 * 16, (scan_end)))
/* The lines of the next chunk's vector at e that the vector loops' test reads beside its gradient (v, m; p in L2
   mode, an undo+redo's old gradient), prefetched as SCAN_AT prefetches the gradient (the vector builds only). */
#define LOSSY_PREFETCH(DP, DG, DS, a, e, lx, redo)                                 \
  do {                                                                             \
    _mm_prefetch((const char *)(a).v + ((e) + CHUNK) * ES_##DS + SCAN_PREFETCH, _MM_HINT_T0); \
    _mm_prefetch((const char *)(a).m + ((e) + CHUNK) * ES_##DS + SCAN_PREFETCH, _MM_HINT_T0); \
    if ((lx).l2n || (lx).l2o)                                                      \
      _mm_prefetch((const char *)(a).p + ((e) + CHUNK) * ES_##DP + SCAN_PREFETCH, _MM_HINT_T0); \
    if (redo) _mm_prefetch((const char *)(a).g + ((e) + CHUNK) * ES_##DG + SCAN_PREFETCH, _MM_HINT_T0); \
  } while (0)

#ifndef SCAN_PREFETCH
#define SCAN_PREFETCH 2048
#endif
/* 1 if the next chunk's elements the loop's vectors did not read (from begin + CHUNK + a multiple of 16 to
   scan_end: its partial last vector) hold an inf or a nan. */
#define SCAN_REST_BAD(DG, gs, begin, scan_end, lim)                                \
  (!chunk_finite((gs), DG, (begin) + CHUNK + ((scan_end) - (begin) - CHUNK) / 16 * 16, (scan_end), (lim)))

/* The step with explicit 16-lane vectors where the CPU converts bfloat16 in hardware (HW_BF16): the same
   operations as step_elem in the same order (so the same bits: the portable build's scalar loops are
   checked against it), but bfloat16 values are converted in registers, with no float tiles and no
   separate conversion pass. That is what the all-bf16 step needed: 0.82 -> 0.94 of the bandwidth its
   bytes imply at 2^26 elements (benchmarks/RESULTS.md). Subnormal lanes are converted with integer
   arithmetic (cvt_bf16_16: the instruction flushes them). The last, partial
   vector of a range takes only its `lanes` (masked loads read zeros elsewhere, masked stores leave the
   rest of memory alone), so there is no scalar remainder loop. */
#ifdef HW_BF16
/* The vector loops' read of the next chunk's gradient (vstep_run and vundo_run with scan; see scan_step_for). */
static inline __mmask16 vnonfinite_0(const void *g, int64_t e, uint32_t lim) {
  const __m512i x = _mm512_and_si512(_mm512_loadu_si512((const float *)g + e), _mm512_set1_epi32(0x7FFFFFFF));
  return _mm512_cmpgt_epu32_mask(x, _mm512_set1_epi32((int)lim));
}
static inline __mmask16 vnonfinite_1(const void *g, int64_t e, uint32_t lim) {
  const __m256i x = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)((const uint16_t *)g + e)),
                                     _mm256_set1_epi16(0x7FFF));
  return _mm256_cmpgt_epu16_mask(x, _mm256_set1_epi16((short)lim));
}
/* The next chunk's vector at e (of the gradient gs, dtype DG) into bad, with its line prefetched ahead. */
#define SCAN_AT(DG, gs, e, scan_end, bad, lim)                                     \
  if ((e) + CHUNK + 16 <= (scan_end)) {                                            \
    _mm_prefetch((const char *)(gs) + ((e) + CHUNK) * ES_##DG + SCAN_PREFETCH, _MM_HINT_T0); \
    (bad) |= vnonfinite_##DG((gs), (e) + CHUNK, (lim));                            \
  }
/* 1 if the next chunk (from begin + CHUNK to scan_end) has an inf or a nan: bad from the loop, the rest
   (the next chunk's partial last vector) by chunk_finite. */
#define SCAN_RESULT(DG, gs, begin, scan_end, bad, lim)                             \
  ((bad) != 0 || SCAN_REST_BAD(DG, gs, begin, scan_end, lim))
static inline __mmask16 lanes_left(int64_t left) {
  return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
}
#define ALL_LANES ((__mmask16)0xFFFF)
/* With lanes a constant ALL_LANES (the loops' full vectors) these are plain loads and stores: masked
   ones cost 5-8% of the all-bf16 step. */
static inline __attribute__((always_inline)) __m512 vld_0(const void *p, int64_t e, __mmask16 lanes) {
  const float *a = (const float *)p + e;
  return lanes == ALL_LANES ? _mm512_loadu_ps(a) : _mm512_maskz_loadu_ps(lanes, a);
}
static inline __attribute__((always_inline)) __m512 vld_1(const void *p, int64_t e, __mmask16 lanes) {
  const uint16_t *a = (const uint16_t *)p + e;
  const __m256i h = lanes == ALL_LANES ? _mm256_loadu_si256((const __m256i *)a) : _mm256_maskz_loadu_epi16(lanes, a);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __attribute__((always_inline)) void vst_0(void *p, int64_t e, __m512 x, __mmask16 lanes) {
  float *a = (float *)p + e;
  if (lanes == ALL_LANES) _mm512_storeu_ps(a, x);
  else _mm512_mask_storeu_ps(a, lanes, x);
}
/* 16 bfloat16 bit patterns h stored at element e of p, in its lanes */
static inline __attribute__((always_inline)) void vst_bits(void *p, int64_t e, __m256i h, __mmask16 lanes) {
  uint16_t *d = (uint16_t *)p + e;
  if (lanes == ALL_LANES) _mm256_storeu_si256((__m256i *)d, h);
  else _mm256_mask_storeu_epi16(d, lanes, h);
}
static inline __attribute__((always_inline)) void vst_1(void *p, int64_t e, __m512 x, __mmask16 lanes) {
  vst_bits(p, e, cvt_bf16_16(x), lanes);
}
/* vst_1 by the CPU's conversion alone, the lanes it would get wrong (subnormal: it flushes them) or'd into *sub
   (a caller that finds *sub set stores its vectors again by vst_*): one test per group of stores instead of one
   per vector. */
static inline __attribute__((always_inline)) void vst_fast_1(void *p, int64_t e, __m512 x, __mmask16 lanes,
                                                             __mmask16 *sub) {
  *sub |= _mm512_fpclass_ps_mask(x, 0x20);
  vst_bits(p, e, (__m256i)_mm512_cvtneps_pbh(x), lanes);
}

/* Even/odd order for the jobs whose streams are all bfloat16 (EO_111): a pair of vectors holds 32 elements,
   those at e, e+2, ..., e+30 in x[0] and e+1, ..., e+31 in x[1]. Elementwise arithmetic does not care, as
   long as every stream of a loop uses the same order. A pair loads by one 512-bit load, a shift and an and (the
   natural order: two loads, two zero-extensions across lanes, two shifts) and stores by one two-vector
   conversion (vcvtne2ps2bf16), one word permute, one store (two conversions, two stores). The subnormal lanes
   are found as vst_fast_1 finds them; the exact store (vst2_eo) converts each vector by cvt_bf16_16. On the Zen 5
   EPYC, in cache, the all-bf16 step took 0.82-0.88 (cpu) and 0.83-0.85 (cpu_fast) of the natural order's time, the
   inverse 0.90-0.99, the undo+redo 0.99-1.07 (kernel_compute.py --against, stop 30); rounding the undo+redo's
   undone pairs by one two-vector conversion and two permutes instead of vround_1 per vector: no clear gain. */
#define ALL_LANES32 0xFFFFFFFFu
static inline __mmask32 lanes32_left(int64_t left) {
  return left >= 32 ? (__mmask32)ALL_LANES32 : (__mmask32)((1u << left) - 1u);
}
static inline __attribute__((always_inline)) void vld2_eo(const void *p, int64_t e, __mmask32 lanes, __m512 *x) {
  const uint16_t *a = (const uint16_t *)p + e;
  const __m512i h = lanes == ALL_LANES32 ? _mm512_loadu_si512(a) : _mm512_maskz_loadu_epi16(lanes, a);
  x[0] = _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
  x[1] = _mm512_castsi512_ps(_mm512_and_si512(h, _mm512_set1_epi32((int)0xFFFF0000u)));
}
/* 32 bit patterns, those of x[0] in words 0-15 and of x[1] in words 16-31, stored interleaved at e */
static inline __attribute__((always_inline)) void vst2_eo_bits(void *p, int64_t e, __m512i h, __mmask32 lanes) {
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  h = _mm512_permutexvar_epi16(order, h);
  uint16_t *d = (uint16_t *)p + e;
  if (lanes == ALL_LANES32) _mm512_storeu_si512(d, h);
  else _mm512_mask_storeu_epi16(d, lanes, h);
}
static inline __attribute__((always_inline)) void vst2_eo(void *p, int64_t e, const __m512 *x, __mmask32 lanes) {
  vst2_eo_bits(p, e, _mm512_inserti64x4(_mm512_castsi256_si512(cvt_bf16_16(x[0])), cvt_bf16_16(x[1]), 1), lanes);
}
static inline __attribute__((always_inline)) void vst2_fast_eo(void *p, int64_t e, const __m512 *x, __mmask32 lanes,
                                                               __mmask16 *sub) {
  *sub |= _mm512_fpclass_ps_mask(x[0], 0x20) | _mm512_fpclass_ps_mask(x[1], 0x20);
  vst2_eo_bits(p, e, (__m512i)_mm512_cvtne2ps_pbh(x[1], x[0]), lanes);
}
/* w vectors at e (w even with eo: w / 2 pairs), in lanes l: of each vector (16 bits), or with eo of each
   pair (32 bits) */
#define EO_000 0
#define EO_001 0
#define EO_100 0
#define EO_101 0
#define EO_110 0
#define EO_111 1
static inline __attribute__((always_inline)) void vldw_0(const void *p, int64_t e, int w, uint32_t l, int eo,
                                                         __m512 *x) {
  (void)eo;
  for (int i = 0; i < w; i++) x[i] = vld_0(p, e + 16 * i, (__mmask16)l);
}
static inline __attribute__((always_inline)) void vldw_1(const void *p, int64_t e, int w, uint32_t l, int eo,
                                                         __m512 *x) {
  if (eo)
    for (int i = 0; i < w; i += 2) vld2_eo(p, e + 16 * i, (__mmask32)l, x + i);
  else
    for (int i = 0; i < w; i++) x[i] = vld_1(p, e + 16 * i, (__mmask16)l);
}
static inline __attribute__((always_inline)) void vstw_0(void *p, int64_t e, int w, uint32_t l, int eo,
                                                         const __m512 *x) {
  (void)eo;
  for (int i = 0; i < w; i++) vst_0(p, e + 16 * i, x[i], (__mmask16)l);
}
static inline __attribute__((always_inline)) void vstw_1(void *p, int64_t e, int w, uint32_t l, int eo,
                                                         const __m512 *x) {
  if (eo)
    for (int i = 0; i < w; i += 2) vst2_eo(p, e + 16 * i, x + i, (__mmask32)l);
  else
    for (int i = 0; i < w; i++) vst_1(p, e + 16 * i, x[i], (__mmask16)l);
}
static inline __attribute__((always_inline)) void vstw_fast_0(void *p, int64_t e, int w, uint32_t l, int eo,
                                                              const __m512 *x, __mmask16 *sub) {
  (void)eo;
  (void)sub;
  vstw_0(p, e, w, l, 0, x);
}
static inline __attribute__((always_inline)) void vstw_fast_1(void *p, int64_t e, int w, uint32_t l, int eo,
                                                              const __m512 *x, __mmask16 *sub) {
  if (eo)
    for (int i = 0; i < w; i += 2) vst2_fast_eo(p, e + 16 * i, x + i, (__mmask32)l, sub);
  else
    for (int i = 0; i < w; i++) vst_fast_1(p, e + 16 * i, x[i], (__mmask16)l, sub);
}



/* The square roots of a vector: IEEE (rk 0) or torch's, MKL's (rk: the REPLICA_* kind in use; the vector
   loops run the exact path only where there is one). The loops take rk from their Sqrt once (a value: their
   vector stores may alias any memory, a Sqrt's field too, so it would be loaded again per vector). */
static inline __attribute__((always_inline)) __m512 sqrt_vec(__m512 x, int rk) {
  if (!rk || rk == REPLICA_IEEE) return _mm512_sqrt_ps(x);
  if (rk == REPLICA_AVX2) return mkl_avx2_replica16(x);
  return rk == REPLICA_GENERIC ? mkl_generic_replica16(x) : mkl_sqrt_replica16(x);
}
/* f(args..., fast, rk) with constant fast and rk (the loops are always inlined bodies, one instance each):
   cpu_fast's (sq 0: div_by and IEEE square roots), cpu's with its replica (true divisions) or cpu's with IEEE
   square roots (fast 2: the divisions exact by div_by where it is exact, see quot_exact_vec). A kind
   chosen inside one loop costs a branch per vector and the registers of both formulas: 1.2-1.5x slower
   undo+redo. */
#define BY_SQRT(sq, f, ...)                                                        \
  (REPLICA_KIND(sq) == REPLICA_GENERIC  ? f(__VA_ARGS__, 0, REPLICA_GENERIC)        \
   : REPLICA_KIND(sq) == REPLICA_AVX512 ? f(__VA_ARGS__, 0, REPLICA_AVX512)         \
   : REPLICA_KIND(sq) == REPLICA_AVX2   ? f(__VA_ARGS__, 0, REPLICA_AVX2)           \
   : REPLICA_KIND(sq) == REPLICA_IEEE   ? f(__VA_ARGS__, 2, REPLICA_IEEE)           \
                                        : f(__VA_ARGS__, 1, 0))

/* div_by on 16 lanes (the min returns its second operand where the first is nan, as minss). */
static inline __attribute__((always_inline)) __m512 div_by_vec(__m512 x, float b, float rb) {
  const __m512 vrb = _mm512_set1_ps(rb);
  const __m512 q = _mm512_mul_ps(x, vrb);
  const __m512 r = _mm512_min_ps(_mm512_fmsub_ps(q, _mm512_set1_ps(b), x), _mm512_set1_ps(FLT_MAX));
  return _mm512_fnmadd_ps(r, vrb, q);
}

/* FAST_DIVIDER 1: the build found a CPU whose 512-bit divider is fast (AMD Zen 5 and later), where true divisions
   beat div_by in two places: cpu's denominators (below) and cpu_fast's inverse (quot_vec). */
#ifndef FAST_DIVIDER
#define FAST_DIVIDER 0
#endif
/* d = sqrt(v) / sqrt(bc2) + eps, the division by div_by, or where the CPU's divider is fast (FAST_DIVIDER)
   and the square root is a replica (cpu's loops: the replica's multiplies and adds, not the divider, fill
   the vector units) a true division: the same bits (div_by's comment). On the Zen 5 EPYC, in cache, cpu's
   steps took 0.83-0.86 of the time with it and three vectors at a time (those alone: 0.91-0.96), its
   undo+redo 0.90-0.94 (kernel_compute.py --against); cpu_fast's steps, whose IEEE square root is on the
   divider already, were slower so (1.07-1.16 for float32). */
static inline __attribute__((always_inline)) __m512 adam_denominator(__m512 v, float bc2, float rbc2, float eps,
                                                                     int rk) {
  const __m512 r = sqrt_vec(v, rk);
  const int replica_on_fma = rk && rk != REPLICA_AVX2 && rk != REPLICA_IEEE; /* those two: on the divider */
  const __m512 q = FAST_DIVIDER && replica_on_fma ? _mm512_div_ps(r, _mm512_set1_ps(bc2)) : div_by_vec(r, bc2, rbc2);
  return _mm512_add_ps(q, _mm512_set1_ps(eps));
}

/* step_elem on 16 lanes, the square root by sqrt_vec. */
static inline __attribute__((always_inline)) void step_vec(__m512 *P, __m512 G, __m512 *M, __m512 *V,
                                                            const StepK *k, int rk) {
  __m512 g = _mm512_mul_ps(G, _mm512_set1_ps(k->gs));
  const __m512 p = _mm512_mul_ps(*P, _mm512_set1_ps(k->pmul));
  if (k->l2) g = _mm512_fmadd_ps(p, _mm512_set1_ps(k->wd), g);
  *M = _mm512_fmadd_ps(_mm512_set1_ps(k->coef), _mm512_sub_ps(g, *M), k->small ? *M : g);
  *V = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(k->c2), g), g, _mm512_mul_ps(*V, _mm512_set1_ps(k->b2)));
  const __m512 d = adam_denominator(*V, k->bc2, k->rbc2, k->eps, rk);
  *P = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(k->nss), *M), d));
}


/* The step takes STEP_WIDTH vectors at a time, as the inverse does (UNDO_WIDTH below): on the Zen 5 EPYC, in cache,
   3 took 0.91-0.96 of the time of one at a time (both backends; 2: 0.94-0.98). */
#ifndef STEP_WIDTH
#define STEP_WIDTH 3
#endif
/* The all-bfloat16 loops (EO_111) take vectors in even/odd pairs: EO_STEP_WIDTH and EO_UNDO_WIDTH vectors at a
   time (even). On the Zen 5 EPYC, in cache, 4 instead of 2 made cpu's step 1.22x and its inverse 1.4x slower
   (spills), cpu_fast's alike. */
#ifndef EO_STEP_WIDTH
#define EO_STEP_WIDTH 2
#endif
#ifndef EO_UNDO_WIDTH
#define EO_UNDO_WIDTH 2
#endif
_Static_assert(EO_STEP_WIDTH % 2 == 0 && EO_UNDO_WIDTH % 2 == 0, "even/odd widths are pairs of vectors");
#define SWIDTH(eo) ((eo) ? EO_STEP_WIDTH : STEP_WIDTH)
#define UWIDTH(eo) ((eo) ? EO_UNDO_WIDTH : UNDO_WIDTH)
#define MAX_WIDTH 8
_Static_assert(STEP_WIDTH <= MAX_WIDTH && EO_STEP_WIDTH <= MAX_WIDTH && EO_UNDO_WIDTH <= MAX_WIDTH,
               "widths up to MAX_WIDTH");
/* The vectors of one unit of a loop (one, or an even/odd pair), their lanes when full, and those of a last,
   partial unit of left elements. */
#define UNIT(eo) ((eo) ? 2 : 1)
#define FULL_LANES(eo) ((eo) ? ALL_LANES32 : (uint32_t)ALL_LANES)
static inline uint32_t unit_lanes_left(int eo, int64_t left) {
  return eo ? (uint32_t)lanes32_left(left) : (uint32_t)lanes_left(left);
}
/* chunk_exact's L2 terms on 16 lanes (t: gh * gh * c; mb: m0). */
static inline __attribute__((always_inline)) __m512 vlossy_l2(__m512 t, __m512 gh, __m512 p, __m512 mb, __m512 v,
                                                               const LossyK *x) {
  const __m512 mp = _mm512_add_ps(_mm512_mul_ps(mb, _mm512_set1_ps(x->r1)),
                                  _mm512_mul_ps(gh, _mm512_set1_ps(x->omb1n)));
  const __m512 vp = _mm512_add_ps(_mm512_mul_ps(v, _mm512_set1_ps(x->r2)),
                                  _mm512_mul_ps(_mm512_mul_ps(gh, _mm512_set1_ps(x->omb2n)), gh));
  const __m512 q = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(mp, _mm512_setzero_ps(), _CMP_NEQ_UQ), _mm512_abs_ps(mp),
                                       _mm512_sqrt_ps(vp));
  const __m512 ap = _mm512_abs_ps(p), ag = _mm512_abs_ps(gh);
  const __m512 a = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(ap, _mm512_set1_ps(x->wa)),
                                               _mm512_mul_ps(q, _mm512_set1_ps(x->wka))), ag);
  const __m512 b = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(ap, _mm512_set1_ps(x->wb)),
                                               _mm512_mul_ps(q, _mm512_set1_ps(x->wkb))), ag);
  const __m512 t1 = _mm512_mul_ps(_mm512_mul_ps(a, ag), _mm512_set1_ps(x->cv));
  const __m512 t2 = _mm512_mul_ps(_mm512_mul_ps(b, b), _mm512_set1_ps(x->cm));
  t = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(t1, t, _CMP_GT_OQ), t, t1);
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(t2, t, _CMP_GT_OQ), t, t2);
}
/* chunk_exact on 16 lanes (the same operations in the same order, so the same flags): the vector loops' read of
   the next chunk (LOSSY_AT) in every checked step. */
#define VLOSSY(DP, DG, DS)                                                         \
  static inline __attribute__((always_inline)) __mmask16 vlossy_##DP##DG##DS(    \
      const Arrays *a, int64_t e, const LossyK *x, int redo) {                     \
    const __m512 zero = _mm512_setzero_ps();                                       \
    __m512 v = vld_##DS(a->v, e, ALL_LANES), p = zero, gh;                         \
    const __m512 m = vld_##DS(a->m, e, ALL_LANES);                                 \
    __m512 m0 = m; /* 0 where the moments' m is 0 (a redo's: the undone one's numerator) */ \
    if (x->l2n || x->l2o) p = vld_##DP(a->p, e, ALL_LANES);                        \
    if (redo && x->pest)                                                           \
      p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(x->sso), m),  \
                                         _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), _mm512_set1_ps(x->bc2o)), \
                                                       _mm512_set1_ps(x->epso)))); \
    if (redo) {                                                                    \
      __m512 go = _mm512_mul_ps(vld_##DG(a->g, e, ALL_LANES), _mm512_set1_ps(x->gso)); \
      if (x->l2o) go = _mm512_add_ps(go, _mm512_mul_ps(p, _mm512_set1_ps(x->wdo))); \
      const __m512 u = _mm512_sub_ps(v, _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(x->omb2o), go), go)); \
      v = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(u, zero, _CMP_LT_OQ), u, zero);  \
      if (x->zok || x->l2n) m0 = _mm512_sub_ps(m, _mm512_mul_ps(_mm512_set1_ps(x->omb1o), go)); \
      gh = vld_##DG(a->g2, e, ALL_LANES);                                          \
    } else {                                                                       \
      gh = vld_##DG(a->g, e, ALL_LANES);                                           \
    }                                                                              \
    gh = _mm512_mul_ps(gh, _mm512_set1_ps(x->gsn));                                \
    if (x->l2n) gh = _mm512_add_ps(gh, _mm512_mul_ps(p, _mm512_set1_ps(x->wdn)));  \
    __m512 t = _mm512_mul_ps(_mm512_mul_ps(gh, gh), _mm512_set1_ps(x->c));         \
    if (x->l2t) t = vlossy_l2(t, gh, p, m0, v, x);                                 \
    if (redo) t = _mm512_mul_ps(t, _mm512_set1_ps(x->b2s));                        \
    const __m512 am = _mm512_abs_ps(m);                                            \
    const __m512 big = _mm512_set1_ps(FLT_MAX);                                    \
    __mmask16 over = _mm512_cmp_ps_mask(t, v, _CMP_NLE_UQ);                        \
    if (x->zok)                                                                    \
      over &= ~(_mm512_cmp_ps_mask(v, zero, _CMP_EQ_OQ) & _mm512_cmp_ps_mask(m0, zero, _CMP_EQ_OQ)); \
    return over | _mm512_cmp_ps_mask(t, big, _CMP_NLE_UQ) | _mm512_cmp_ps_mask(am, big, _CMP_NLE_UQ); \
  }
NATIVE_COMBOS(VLOSSY)
/* The next chunk's vector at e into bad by vlossy (redo: an undo+redo's), its lines prefetched ahead as SCAN_AT's. */
#define LOSSY_AT(DP, DG, DS, a, e, scan_end, bad, lx, redo)                        \
  if ((e) + CHUNK + 16 <= (scan_end)) {                                            \
    LOSSY_PREFETCH(DP, DG, DS, a, e, lx, redo);                                    \
    (bad) |= vlossy_##DP##DG##DS(&(a), (e) + CHUNK, &(lx), (redo));                \
  }
#define VSTEP(DP, DG, DS)                                                          \
  /* p, m, v of w vectors at e, in lanes l (the loops' full units: FULL_LANES; a range's last, partial unit:  \
     w UNIT and its lanes), loaded and stored (the step's and the inverse's) */                             \
  static inline __attribute__((always_inline)) void vld_pmv_##DP##DG##DS(         \
      const Arrays *a, int64_t e, int w, uint32_t l, __m512 *P, __m512 *M, __m512 *V) { \
    vldw_##DP(a->p, e, w, l, EO_##DP##DG##DS, P);                                  \
    vldw_##DS(a->m, e, w, l, EO_##DP##DG##DS, M);                                  \
    vldw_##DS(a->v, e, w, l, EO_##DP##DG##DS, V);                                  \
  }                                                                                \
  static inline __attribute__((always_inline)) void vst_pmv_##DP##DG##DS(         \
      const Arrays *a, int64_t e, int w, uint32_t l, const __m512 *P, const __m512 *M, const __m512 *V) { \
    __mmask16 sub = 0;                                                             \
    vstw_fast_##DP(a->po, e, w, l, EO_##DP##DG##DS, P, &sub);                      \
    vstw_fast_##DS(a->mo, e, w, l, EO_##DP##DG##DS, M, &sub);                      \
    vstw_fast_##DS(a->vo, e, w, l, EO_##DP##DG##DS, V, &sub);                      \
    if (__builtin_expect(sub != 0, 0)) {                                           \
      vstw_##DP(a->po, e, w, l, EO_##DP##DG##DS, P);                               \
      vstw_##DS(a->mo, e, w, l, EO_##DP##DG##DS, M);                               \
      vstw_##DS(a->vo, e, w, l, EO_##DP##DG##DS, V);                               \
    }                                                                              \
  }                                                                                \
  /* w (<= the loop's width) vectors at e: their loads, the step of each, their stores */ \
  static inline __attribute__((always_inline)) void vstep_at_##DP##DG##DS(        \
      const Arrays *a, const StepK *k, int rk, int64_t e, int w, uint32_t l) {     \
    __m512 P[MAX_WIDTH], G[MAX_WIDTH], M[MAX_WIDTH], V[MAX_WIDTH];                 \
    vld_pmv_##DP##DG##DS(a, e, w, l, P, M, V);                                     \
    vldw_##DG(a->g, e, w, l, EO_##DP##DG##DS, G);                                  \
    for (int i = 0; i < w; i++) step_vec(&P[i], G[i], &M[i], &V[i], k, rk);        \
    vst_pmv_##DP##DG##DS(a, e, w, l, P, M, V);                                     \
  }                                                                                \
  /* The step of j's range; with scan (a constant: 1 for a full chunk of vstep_scan) it also reads the next   \
     chunk's gradient, [j->end, scan_end), a vector per vector of this chunk, and returns 1 if it holds an  \
     inf or a nan (else 0) */                                                                               \
  static inline __attribute__((always_inline)) int vstep_run_##DP##DG##DS(       \
      const Job *j, int64_t scan_end, int scan, int fast, int rk) {                \
    enum { EO = EO_##DP##DG##DS, W = SWIDTH(EO_##DP##DG##DS), U = UNIT(EO_##DP##DG##DS) }; \
    const Arrays a = {j->p, j->g, j->m, j->v, 0, j->po, j->mo, j->vo};             \
    const StepK k = step_k(&j->s1, j->decoupled);                                  \
    const uint32_t lim = j->s1.lim[DG];                                            \
    const LossyK lx = lossy_k(j);                                                  \
    __mmask16 bad = 0;                                                             \
    (void)fast;                                                                    \
    int64_t e = j->begin; /* full widths and units with the constant FULL_LANES, then the partial unit */ \
    for (; e + 16 * W <= j->end; e += 16 * W) {                                    \
      for (int i = 0; i < W; i++) PREFETCH_ARRAYS(DP, DG, DS, a, e + 16 * i, 0);   \
      vstep_at_##DP##DG##DS(&a, &k, rk, e, W, FULL_LANES(EO));                     \
      if (scan) {                                                                  \
        for (int i = 0; i < W; i++) SCAN_AT(DG, a.g, e + 16 * i, scan_end, bad, lim) \
        for (int i = 0; i < W; i++) LOSSY_AT(DP, DG, DS, a, e + 16 * i, scan_end, bad, lx, 0) \
      }                                                                            \
    }                                                                              \
    for (; e + 16 * U <= j->end; e += 16 * U) {                                    \
      for (int i = 0; i < U; i++) PREFETCH_ARRAYS(DP, DG, DS, a, e + 16 * i, 0);   \
      vstep_at_##DP##DG##DS(&a, &k, rk, e, U, FULL_LANES(EO));                     \
      if (scan) {                                                                  \
        for (int i = 0; i < U; i++) SCAN_AT(DG, a.g, e + 16 * i, scan_end, bad, lim) \
        for (int i = 0; i < U; i++) LOSSY_AT(DP, DG, DS, a, e + 16 * i, scan_end, bad, lx, 0) \
      }                                                                            \
    }                                                                              \
    if (e < j->end) vstep_at_##DP##DG##DS(&a, &k, rk, e, U, unit_lanes_left(EO, j->end - e)); \
    return scan && (SCAN_RESULT(DG, a.g, j->begin, scan_end, bad, lim) || LOSSY_REST_BAD(j, j->begin, scan_end)); \
  }                                                                                \
  static void vstep_##DP##DG##DS(const Job *j, const Sqrt *sq) {                   \
    (void)BY_SQRT(STEP_SQ(sq), vstep_run_##DP##DG##DS, j, 0, 0);                   \
  }

/* x / b with the division's bits: div_by where its comment proves it exact, a true division elsewhere (fast 2
   in quot_vec: cpu's inverse where torch's square root is IEEE, REPLICA_IEEE, whose loops are bound by the
   one divider: with true divisions two square roots and four divisions per element of an undo+redo). div_by
   is exact for 0.5 <= b <= 2 (b and 1/b normal, the quotient of |x| >= 2^-78 normal; a negative b gives +0
   for +0 / b) and 2^-78 <= |x| < 2^126 (the quotient below 2^127: finite), and for x = +-0. The other lanes
   (tiny, huge, inf, nan: integer compares on 2|x|'s bits) are divided, a masked division where a vector has
   any; any other b divides every lane. tests/test_cpu_division.py compares it with x / b for every float32 x
   and eight b. Measured (benchmarks/RESULTS.md "Exact div_by in cpu's inverse with IEEE square roots"): the
   new-gradient undo+redo 0.81-0.92x in memory. The AVX2 loops keep true divisions for that kind: the same
   guard there (no mask registers: an unsigned min and two compares per quotient) made it 0.96-1.34x. */
/* The lanes with 0 < |x| < 2^-78, given twice = x's bits shifted left by one (the sign shifted out). */
static inline __attribute__((always_inline)) __mmask16 tiny_lanes(__m512i twice) {
  return _mm512_cmplt_epu32_mask(_mm512_sub_epi32(twice, _mm512_set1_epi32(1)),
                                 _mm512_set1_epi32((0x18800000 << 1) - 1)); /* 2^-78 */
}
static inline __attribute__((always_inline)) __m512 quot_exact_vec(__m512 x, float b, float rb) {
  if (!(b >= 0.5f && b <= 2.0f)) return _mm512_div_ps(x, _mm512_set1_ps(b));
  const __m512i twice = _mm512_slli_epi32(_mm512_castps_si512(x), 1);
  const __mmask16 off =
      tiny_lanes(twice) | _mm512_cmpge_epu32_mask(twice, _mm512_set1_epi32((int)(0x7E800000u << 1))); /* >= 2^126 */
  const __m512 q = div_by_vec(x, b, rb);
  if (__builtin_expect(off == 0, 1)) return q;
  return _mm512_mask_div_ps(q, off, x, _mm512_set1_ps(b));
}

/* fast 0: a true division; fast 2: quot_exact_vec (the same bits); fast 1: div_by, except that lanes with
   0 < |x| < 2^-78 (found by integer compares on 2|x|'s bits) are first scaled by 2^100 into div_by's exact range
   and the quotient by 2^-100 back: exactly x / b there unless the quotient is subnormal (rounded twice).
   Unscaled, such x (second moments decayed on rows without gradient for ~50k steps) made div_by's remainder
   subnormal, a microcode assist per lane: cpu_fast's inverse was 6x slower there. The compiler-vectorized loops
   (no AVX-512) keep plain div_by, whose bits differ there by up to an ulp: scaling in those loops, where every
   lane pays for both ways, made their inverse 2x slower. FAST_DIVIDER 1 (set by the build where measured faster:
   AMD Zen 5, whose 512-bit divider made cpu_fast's undo 13-35% faster in cache, its undo+redo 13-20%) takes a
   true division for fast 1 too: the reference's bits, no tiny lanes to scale. */
static inline __attribute__((always_inline)) __m512 quot_vec(__m512 x, float b, float rb, int fast) {
  if (!fast || FAST_DIVIDER) return _mm512_div_ps(x, _mm512_set1_ps(b));
  if (fast == 2) return quot_exact_vec(x, b, rb);
  const __mmask16 tiny = tiny_lanes(_mm512_slli_epi32(_mm512_castps_si512(x), 1));
  if (__builtin_expect(tiny == 0, 1)) return div_by_vec(x, b, rb);
  const __m512 q = div_by_vec(_mm512_mask_mul_ps(x, tiny, x, _mm512_set1_ps(0x1p100f)), b, rb);
  return _mm512_mask_mul_ps(q, tiny, q, _mm512_set1_ps(0x1p-100f));
}

/* undo_elem_d on 16 lanes; D = sqrt_vec(V) is taken here (not with have_p_old). */
static inline __attribute__((always_inline)) void undo_vec(__m512 *P, __m512 G, __m512 *M, __m512 *V,
                                                            const UndoK *k, int have_p_old, int fast, int rk) {
  __m512 g = _mm512_mul_ps(G, _mm512_set1_ps(k->gs));
  __m512 p = *P;
  if (!have_p_old) {
    const __m512 d = adam_denominator(*V, k->bc2, k->rbc2, k->eps, rk);
    p = quot_vec(_mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(k->ss), *M), d)), k->pdiv, k->rpdiv, fast);
  }
  if (k->l2) g = _mm512_fmadd_ps(p, _mm512_set1_ps(k->wd), g);
  const __m512 m = quot_vec(_mm512_sub_ps(*M, _mm512_mul_ps(_mm512_set1_ps(k->omb1), g)), k->b1, k->rb1, fast);
  const __m512 x = quot_vec(_mm512_sub_ps(*V, _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(k->omb2), g), g)),
                            k->b2, k->rb2, fast);
  *P = p;
  *M = m;
  *V = _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), _mm512_setzero_ps());
}

/* x as stored in bfloat16 and loaded back (round_bf16 on a vector). */
static inline __attribute__((always_inline)) __m512 vround_1(__m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(cvt_bf16_16(x)), 16));
}
static inline __m512 vround_0(__m512 x) { return x; }

/* The inverse (op OP_UNDO) or the fused undo+redo (OP_UNDO_REDO) on 16-lane vectors: undo_vec, the undone
   values rounded to their storage dtypes, step_vec with the new gradient. fast and rk as in undo_vec
   (cpu_fast: 1 and IEEE; cpu: 0 and MKL's square root). */
/* The inverse and the undo+redo take UNDO_WIDTH vectors at a time: all their loads, then each stage for every
   vector, then their stores (the in-place outputs alias their own vectors' inputs only, element for element),
   so that the chains of UNDO_WIDTH vectors interleave. Their chain (two square roots, two to five divisions)
   is longer than the out-of-order window covers one vector at a time: on the Zen 5 EPYC, in cache, cpu's
   undo+redo took 0.80-0.87 of the time of one vector at a time with 3, 0.84-0.88 with 2, 0.85-0.90 with 4
   (spills), cpu_fast's all-bf16 one 0.80 (kernel_compute.py --against, alternated). */
#ifndef UNDO_WIDTH
#define UNDO_WIDTH 3
#endif
_Static_assert(UNDO_WIDTH <= MAX_WIDTH, "widths up to MAX_WIDTH");
#define VUNDO(DP, DG, DS)                                                          \
  /* w (<= the loop's width) vectors at e, in lanes l, as vstep_at */               \
  static inline __attribute__((always_inline)) void vundo_at_##DP##DG##DS(        \
      const Arrays *a, const UndoK *u, const StepK *k, int have_p_old, int redo, int fast, \
      int rk, int64_t e, int w, uint32_t l) {                                      \
    __m512 P[MAX_WIDTH], G[MAX_WIDTH], M[MAX_WIDTH], V[MAX_WIDTH];                 \
    vld_pmv_##DP##DG##DS(a, e, w, l, P, M, V);                                     \
    vldw_##DG(a->g, e, w, l, EO_##DP##DG##DS, G);                                  \
    for (int i = 0; i < w; i++) undo_vec(&P[i], G[i], &M[i], &V[i], u, have_p_old, fast, rk); \
    if (redo) {                                                                    \
      for (int i = 0; i < w; i++) {                                                \
        P[i] = vround_##DP(P[i]);                                                  \
        M[i] = vround_##DS(M[i]);                                                  \
        V[i] = vround_##DS(V[i]);                                                  \
      }                                                                            \
      vldw_##DG(a->g2, e, w, l, EO_##DP##DG##DS, G);                               \
      for (int i = 0; i < w; i++) step_vec(&P[i], G[i], &M[i], &V[i], k, rk);      \
    }                                                                              \
    vst_pmv_##DP##DG##DS(a, e, w, l, P, M, V);                                     \
  }                                                                                \
  /* The inverse or the undo+redo of j's range; with scan (a constant: 1 for a full chunk of vredo_scan, an      \
     undo+redo) it also reads the next chunk's new gradient as vstep_run does the step's */                     \
  static inline __attribute__((always_inline)) int vundo_run_##DP##DG##DS(       \
      const Job *j, int64_t scan_end, int scan, int fast, int rk) {                \
    enum { EO = EO_##DP##DG##DS, W = UWIDTH(EO_##DP##DG##DS), U = UNIT(EO_##DP##DG##DS) }; \
    const int have_p_old = j->pold != 0, redo = scan || j->op == OP_UNDO_REDO;     \
    const Arrays a = {have_p_old ? j->pold : j->p, j->g, j->m, j->v, j->g2, j->po, j->mo, j->vo}; \
    const UndoK u = undo_k(&j->s1, j->decoupled);                                  \
    const StepK k = step_k(&j->s2, j->decoupled);                                  \
    const uint32_t lim = j->s2.lim[DG];                                            \
    const LossyK lx = lossy_k(j);                                                  \
    __mmask16 bad = 0;                                                             \
    int64_t e = j->begin;                                                          \
    for (; e + 16 * W <= j->end; e += 16 * W) {                                    \
      for (int i = 0; i < W; i++) PREFETCH_ARRAYS(DP, DG, DS, a, e + 16 * i, redo); \
      vundo_at_##DP##DG##DS(&a, &u, &k, have_p_old, redo, fast, rk, e, W, FULL_LANES(EO)); \
      if (scan) {                                                                  \
        for (int i = 0; i < W; i++) SCAN_AT(DG, a.g2, e + 16 * i, scan_end, bad, lim) \
        for (int i = 0; i < W; i++) LOSSY_AT(DP, DG, DS, a, e + 16 * i, scan_end, bad, lx, 1) \
      }                                                                            \
    }                                                                              \
    for (; e + 16 * U <= j->end; e += 16 * U) {                                    \
      for (int i = 0; i < U; i++) PREFETCH_ARRAYS(DP, DG, DS, a, e + 16 * i, redo); \
      vundo_at_##DP##DG##DS(&a, &u, &k, have_p_old, redo, fast, rk, e, U, FULL_LANES(EO)); \
      if (scan) {                                                                  \
        for (int i = 0; i < U; i++) SCAN_AT(DG, a.g2, e + 16 * i, scan_end, bad, lim) \
        for (int i = 0; i < U; i++) LOSSY_AT(DP, DG, DS, a, e + 16 * i, scan_end, bad, lx, 1) \
      }                                                                            \
    }                                                                              \
    if (e < j->end)                                                                \
      vundo_at_##DP##DG##DS(&a, &u, &k, have_p_old, redo, fast, rk, e, U, unit_lanes_left(EO, j->end - e)); \
    return scan && (SCAN_RESULT(DG, a.g2, j->begin, scan_end, bad, lim) || LOSSY_REST_BAD(j, j->begin, scan_end)); \
  }                                                                                \
  /* fast: 1 with sq 0 (cpu_fast), 0 or 2 with sq (cpu; see BY_SQRT) */           \
  static void vundo_##DP##DG##DS(const Job *j, int fast, const Sqrt *sq) {          \
    (void)fast;                                                                    \
    (void)BY_SQRT(sq, vundo_run_##DP##DG##DS, j, 0, 0);                            \
  }
#define VECTORS(DP, DG, DS) VSTEP(DP, DG, DS) VUNDO(DP, DG, DS)
NATIVE_COMBOS(VECTORS)
#define STEP_VECTORS(DP, DG, DS) vstep_##DP##DG##DS(j, 0); return;
/* cpu_fast's inverse: vundo for every storage dtype (with float32 storage the compiler's loop was 5%
   faster than vundo until the vector loops prefetched: 54.2-54.8 against 46.2-46.8 ms now for an
   undo+redo of 2^26 elements). */
#define UNDO_VECTORS(DP, DG, DS) vundo_##DP##DG##DS(j, 1, 0); return;
#define EXACT_VECTORS(DP, DG, DS)                                             \
  if (sq.replica) {                                                                \
    if (j->op == OP_STEP) vstep_##DP##DG##DS(j, &sq);                              \
    else vundo_##DP##DG##DS(j, 0, &sq);                                            \
    return;                                                                        \
  }
#elif defined(__AVX2__) && defined(__FMA__)
/* The same loops with explicit 8-lane AVX2 vectors (AVX2 CPUs without AVX-512: AMD Zen 2/3, Intel before
   Skylake-SP, and AVX-512 ones without bf16 conversion): the operations of step_vec / undo_vec in the same
   order (so the portable build's scalar loops' bits, and the AVX-512 loops' but for quotients of tiny
   values: see quot8), every stream prefetched as there, bfloat16 converted in registers by f32_to_bf16's
   integer formula (no conversion instruction). The compiler-vectorized loops they replace stayed well
   below the memory bandwidth: on a 2-core AMD EPYC (Zen 3) the float32 step at 2^26 elements took 65 ms
   against torch's fused AdamW's 45 (benchmarks/RESULTS.md "AVX2 vector loops"). cpu_fast's loops take
   IEEE square roots; cpu's torch's, MKL's: the same loops with an inline replica of it (sqrt8: of MKL's
   generic or AVX2 code path in AVX2 builds, of its AVX-512 one on 8 lanes in AVX-512 builds without bfloat16
   conversion) where it is in use, else xexact_* (below), which call MKL per chunk. A range's last, partial
   vector goes through a zero-padded local copy (TAIL8). */
typedef __m256 v8;
static inline v8 v8ld_0(const void *p, int64_t e) { return _mm256_loadu_ps((const float *)p + e); }
static inline v8 v8ld_1(const void *p, int64_t e) {
  const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + e));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
/* 8 floats -> bfloat16, f32_to_bf16's bits, each in the low half of a 32-bit lane: round-to-nearest-even
   on the integer bits, a nan quiet with its sign and upper payload. */
static inline __m256i bf16_bits8_rounded(__m256i u, __m256i hi) {
  const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
}
static inline __m256i bf16_bits8(v8 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i hi = _mm256_srli_epi32(u, 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(bf16_bits8_rounded(u, hi), _mm256_or_si256(hi, _mm256_set1_epi32(0x0040)), nan);
}
/* bf16_bits8 of a vector without a nan: the rounding alone */
static inline __m256i bf16_bits8_no_nan(v8 x) {
  const __m256i u = _mm256_castps_si256(x);
  return bf16_bits8_rounded(u, _mm256_srli_epi32(u, 16));
}
/* every lane < 2^16: packus keeps it; lanes 0-3 and 4-7 sit in qwords 0 and 2 */
static inline __m128i cvt_bf16_8(v8 x) {
  const __m256i h = bf16_bits8(x);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08));
}
static inline void v8st_0(void *p, int64_t e, v8 x) { _mm256_storeu_ps((float *)p + e, x); }
static inline void v8st_1(void *p, int64_t e, v8 x) {
  _mm_storeu_si128((__m128i *)((uint16_t *)p + e), cvt_bf16_8(x));
}
static inline v8 v8round_0(v8 x) { return x; }
static inline v8 v8round_1(v8 x) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(x), 16)); }
/* Two vectors at e: elements e..e+7 in x[0], e+8..e+15 in x[1] ("natural" order), or, with inlane, the
   order of the 256-bit unpack and pack instructions: x[0] holds e..e+3 and e+8..e+11, x[1] e+4..e+7 and
   e+12..e+15. Elementwise arithmetic does not care which, as long as every stream of a loop uses the same:
   the loops of all-bfloat16 jobs take inlane (no lane-crossing permute at all), the others natural. A
   bfloat16 pair costs one load, (a permute,) two unpacks; a store two conversions, one pack, (a permute,) one
   store: fewer operations than two single vectors (the bf16 step is bound by its arithmetic here). */
static inline void v8ld2_0(const void *p, int64_t e, v8 *x, int inlane) {
  (void)inlane;
  x[0] = _mm256_loadu_ps((const float *)p + e);
  x[1] = _mm256_loadu_ps((const float *)p + e + 8);
}
static inline void v8ld2_1(const void *p, int64_t e, v8 *x, int inlane) {
  __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + e));
  if (!inlane) h = _mm256_permute4x64_epi64(h, 0xD8);
  x[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), h));
  x[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), h));
}
static inline void v8st2_0(void *p, int64_t e, const v8 *x, int inlane) {
  (void)inlane;
  _mm256_storeu_ps((float *)p + e, x[0]);
  _mm256_storeu_ps((float *)p + e + 8, x[1]);
}
static inline void v8st2_1(void *p, int64_t e, const v8 *x, int inlane) {
  /* one test for a nan in either vector (rare) instead of a nan lane blend per vector */
  const v8 nan = _mm256_cmp_ps(x[0], x[1], _CMP_UNORD_Q);
  __m256i h = _mm256_testz_ps(nan, nan) ? _mm256_packus_epi32(bf16_bits8_no_nan(x[0]), bf16_bits8_no_nan(x[1]))
                                        : _mm256_packus_epi32(bf16_bits8(x[0]), bf16_bits8(x[1]));
  if (!inlane) h = _mm256_permute4x64_epi64(h, 0xD8);
  _mm256_storeu_si256((__m256i *)((uint16_t *)p + e), h);
}
/* w (1 or 2, a constant where these are inlined) vectors at e: v8ld_ / v8st_, or the pairs above. */
#define V8LDW(D, p, e, w, x, inlane)                                               \
  do {                                                                             \
    if ((w) == 2) v8ld2_##D((p), (e), (x), (inlane));                              \
    else (x)[0] = v8ld_##D((p), (e));                                              \
  } while (0)
#define V8STW(D, p, e, w, x, inlane)                                               \
  do {                                                                             \
    if ((w) == 2) v8st2_##D((p), (e), (x), (inlane));                              \
    else v8st_##D((p), (e), (x)[0]);                                               \
  } while (0)
/* inlane order for the jobs whose streams are all bfloat16 */
#define INLANE_000 0
#define INLANE_001 0
#define INLANE_100 0
#define INLANE_101 0
#define INLANE_110 0
#define INLANE_111 1
static inline v8 v8set(float x) { return _mm256_set1_ps(x); }

/* div_by on 8 lanes (the min returns its second operand where the first is nan, as minss). */
static inline __attribute__((always_inline)) v8 div_by8(v8 x, float b, float rb) {
  const v8 vrb = v8set(rb);
  const v8 q = _mm256_mul_ps(x, vrb);
  const v8 r = _mm256_min_ps(_mm256_fmsub_ps(q, v8set(b), x), v8set(FLT_MAX));
  return _mm256_fnmadd_ps(r, vrb, q);
}

/* step_pre, step_post and step_elem on 8 lanes. */
static inline __attribute__((always_inline)) void step_pre8(v8 *P, v8 G, v8 *M, v8 *V, const StepK *k) {
  v8 g = _mm256_mul_ps(G, v8set(k->gs));
  const v8 p = _mm256_mul_ps(*P, v8set(k->pmul));
  if (k->l2) g = _mm256_fmadd_ps(p, v8set(k->wd), g);
  *M = _mm256_fmadd_ps(v8set(k->coef), _mm256_sub_ps(g, *M), k->small ? *M : g);
  *V = _mm256_fmadd_ps(_mm256_mul_ps(v8set(k->c2), g), g, _mm256_mul_ps(*V, v8set(k->b2)));
  *P = p;
}
static inline __attribute__((always_inline)) v8 step_post8(v8 P, v8 M, v8 D, const StepK *k) {
  const v8 d = _mm256_add_ps(div_by8(D, k->bc2, k->rbc2), v8set(k->eps));
  return _mm256_add_ps(P, _mm256_div_ps(_mm256_mul_ps(v8set(k->nss), M), d));
}
/* The square roots of a vector: IEEE (sq 0) or torch's, MKL's (the replica: the exact path runs these loops only
   where a replica is in use, see EXACT_VECTORS, with sq one of the constants below). These 8-lane helpers
   are always inlined: with the replica in sqrt8 gcc stopped inlining some into the loops (its growth limits),
   which made cpu_fast's undo 2x slower in cache. */
static inline __attribute__((always_inline)) v8 sqrt8(v8 x, const Sqrt *sq) {
  if (!sq || sq->replica == REPLICA_IEEE) return _mm256_sqrt_ps(x);
#ifdef HW_RSQRT8
  if (sq->replica == REPLICA_AVX2) return mkl_avx2_replica8(x);
  return mkl_sqrt_replica8(x);
#else
  return mkl_avx512_path_replica8(x); /* REPLICA_AVX512, the only kind these loops take here */
#endif
}
/* The replicas the loops take, as the constants they are instanced with (sq: 0 for cpu_fast's IEEE square roots,
   else &OTHER8 or &AVX2_8, whose field sqrt8 reads is then known when the loop compiles; a job's own Sqrt would
   be read again after every vector store, which may alias it), and VECTOR_REPLICA8(r): whether cpu's loops run
   these loops with replica kind r (else xexact_*). AVX2 builds: MKL's generic code path (OTHER8; AMD CPUs) and
   its AVX2 one (AVX2_8; Intel CPUs without AVX-512). AVX-512 builds without bfloat16 conversion (these loops on
   Intel's AVX-512 CPUs before Cooper Lake: Skylake-SP, Cascade Lake, Ice Lake-SP): its AVX-512 one (OTHER8). */
#ifdef HW_RSQRT8
static const Sqrt OTHER8 = {0, 0, 0, REPLICA_GENERIC}, AVX2_8 = {0, 0, 0, REPLICA_AVX2};
#define VECTOR_REPLICA8(r) ((r) == REPLICA_GENERIC || (r) == REPLICA_AVX2 || (r) == REPLICA_IEEE)
#define AVX2_IN_LOOPS8 1
#else
static const Sqrt OTHER8 = {0, 0, 0, REPLICA_AVX512}, AVX2_8 __attribute__((unused)) = {0, 0, 0, REPLICA_AVX2};
#define VECTOR_REPLICA8(r) ((r) == REPLICA_AVX512 || (r) == REPLICA_IEEE)
#define AVX2_IN_LOOPS8 0
#endif
static const Sqrt IEEE8 = {0, 0, 0, REPLICA_IEEE}; /* cpu's inverse with IEEE square roots (its step: cpu_fast's) */
/* f(args..., fast, sq8) with constant fast and sq8 (the twin of the AVX-512 loops' BY_SQRT; a square root chosen
   per vector made cpu_fast's undo 2x slower in cache, benchmarks/kernel_compute.py): cpu_fast's (sq 0: fast 1,
   div_by in the inverse, IEEE square roots) or cpu's (fast 0, true divisions) with IEEE square roots (IEEE8),
   MKL's AVX2 path (AVX2_8, where these loops replicate it) or its other replicated path (OTHER8). */
#define BY_SQRT8(sq, f, ...)                                                       \
  (!(sq)                                             ? f(__VA_ARGS__, 1, 0)        \
   : (sq)->replica == REPLICA_IEEE                   ? f(__VA_ARGS__, 0, &IEEE8)   \
   : AVX2_IN_LOOPS8 && (sq)->replica == REPLICA_AVX2 ? f(__VA_ARGS__, 0, &AVX2_8)  \
                                                     : f(__VA_ARGS__, 0, &OTHER8))
static inline __attribute__((always_inline)) void step8(v8 *P, v8 G, v8 *M, v8 *V, const StepK *k, const Sqrt *sq) {
  step_pre8(P, G, M, V, k);
  *P = step_post8(*P, *M, sqrt8(*V, sq), k);
}

/* quot on 8 lanes: a true division (fast 0) or div_by (fast 1). Unlike quot_vec, tiny x (0 < |x| < 2^-78)
   is not scaled first: as in the compiler-vectorized loops, div_by's quotient may be an ulp off there. On
   the AMD EPYC (Zen 3) of benchmarks/RESULTS.md ("AVX2 vector loops") the test for such lanes alone, never
   taken, made the float32 undo 20% slower and the bfloat16 one 2x (inline, out of line, or branch-free),
   while unscaled tiny values cost that CPU less than the scaling did (an undo of moments ~1e-37: 86 ms
   against 150 at 2^26 elements). */
static inline __attribute__((always_inline)) v8 quot8(v8 x, float b, float rb, int fast) {
  return fast ? div_by8(x, b, rb) : _mm256_div_ps(x, v8set(b));
}

/* undo_elem_d on 8 lanes, given D = sqrt(v') (unused with have_p_old); undo8 takes sqrt8's. */
static inline __attribute__((always_inline)) void undo8_d(v8 *P, v8 G, v8 *M, v8 *V, v8 D, const UndoK *k,
                                                          int have_p_old, int fast) {
  v8 g = _mm256_mul_ps(G, v8set(k->gs));
  v8 p = *P;
  if (!have_p_old) {
    const v8 d = _mm256_add_ps(div_by8(D, k->bc2, k->rbc2), v8set(k->eps));
    p = quot8(_mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(v8set(k->ss), *M), d)), k->pdiv, k->rpdiv, fast);
  }
  if (k->l2) g = _mm256_fmadd_ps(p, v8set(k->wd), g);
  const v8 m = quot8(_mm256_sub_ps(*M, _mm256_mul_ps(v8set(k->omb1), g)), k->b1, k->rb1, fast);
  const v8 x = quot8(_mm256_sub_ps(*V, _mm256_mul_ps(_mm256_mul_ps(v8set(k->omb2), g), g)), k->b2, k->rb2, fast);
  *P = p;
  *M = m;
  *V = _mm256_max_ps(_mm256_setzero_ps(), x); /* x < 0 ? 0 : x, as maxps: -0 and nan x kept */
}
static inline __attribute__((always_inline)) void undo8(v8 *P, v8 G, v8 *M, v8 *V, const UndoK *k, int have_p_old,
                                                        int fast, const Sqrt *sq) {
  undo8_d(P, G, M, V, have_p_old ? *V : sqrt8(*V, sq), k, have_p_old, fast);
}

/* A range's last, partial vector (n < 8 elements at e): the inputs copied into zero-padded local arrays,
   fn (a vector function: the arrays, an element, its other arguments) run on those in place, the n
   results copied back. */
#define TAIL8(DP, DG, DS, a, e, n, with_g2, fn, ...)                               \
  do {                                                                             \
    float tp[8] = {0}, tg[8] = {0}, tm[8] = {0}, tv[8] = {0}, tg2[8] = {0};        \
    const size_t np = (size_t)(n) * ES_##DP, ng = (size_t)(n) * ES_##DG, ns = (size_t)(n) * ES_##DS; \
    memcpy(tp, (const char *)(a).p + (e) * ES_##DP, np);                           \
    memcpy(tg, (const char *)(a).g + (e) * ES_##DG, ng);                           \
    memcpy(tm, (const char *)(a).m + (e) * ES_##DS, ns);                           \
    memcpy(tv, (const char *)(a).v + (e) * ES_##DS, ns);                           \
    if (with_g2) memcpy(tg2, (const char *)(a).g2 + (e) * ES_##DG, ng);            \
    const Arrays t = {tp, tg, tm, tv, tg2, tp, tm, tv};                            \
    fn(&t, 0, __VA_ARGS__);                                                        \
    memcpy((char *)(a).po + (e) * ES_##DP, tp, np);                                \
    memcpy((char *)(a).mo + (e) * ES_##DS, tm, ns);                                \
    memcpy((char *)(a).vo + (e) * ES_##DS, tv, ns);                                \
  } while (0)

/* fn on the two vectors at e: as a pair (w = 2) where a stream is bfloat16 (see v8ld2_1), else one by one
   (w = 1; the float32 undo+redo ran ~5% slower as a pair, with more values live at once). */
#define TWO8(DP, DG, DS, fn, a, e, ...)                                            \
  do {                                                                             \
    if (DP || DG || DS) {                                                          \
      fn((a), (e), 2, __VA_ARGS__);                                                \
    } else {                                                                       \
      fn((a), (e), 1, __VA_ARGS__);                                                \
      fn((a), (e) + 8, 1, __VA_ARGS__);                                            \
    }                                                                              \
  } while (0)
/* Full vectors two at a time (TWO8; a line of each float32 stream, prefetched), then one (w = 1), then the
   partial one. */
#define LOOP8(DP, DG, DS, a, begin, end, with_g2, fn, ...)                         \
  do {                                                                             \
    int64_t e = (begin);                                                           \
    for (; e + 16 <= (end); e += 16) {                                             \
      PREFETCH_ARRAYS(DP, DG, DS, a, e, with_g2);                                  \
      TWO8(DP, DG, DS, fn, &(a), e, __VA_ARGS__);                                  \
    }                                                                              \
    if (e + 8 <= (end)) {                                                          \
      fn(&(a), e, 1, __VA_ARGS__);                                                 \
      e += 8;                                                                      \
    }                                                                              \
    if (e < (end)) TAIL8(DP, DG, DS, a, e, (end) - e, with_g2, fn, 1, __VA_ARGS__); \
  } while (0)

/* The step on the whole pairs of [begin, end) of a job with a bfloat16 stream, software-pipelined: pair k+1's
   loads, moments (stored) and square roots (vstep_a) are issued before pair k's division and parameter update
   (vstep_b), so that the out-of-order window, which one pair's long chain of dependent operations otherwise
   fills, holds independent work of two pairs (the all-bf16 step's arithmetic on the EPYC of
   benchmarks/RESULTS.md: 0.85 -> 0.70 ns per element per core). EXTRA, a statement, runs once per pair at pe
   (vstep_scan's look at the next chunk). Leaves pe (declared by the caller) past the last pair. */
#define PIPE8(DP, DG, DS, a, begin, end, k, sq, EXTRA)                             \
  do {                                                                             \
    v8 P_[2], M_[2], D_[2];                                                        \
    pe = (begin);                                                                  \
    if (pe + 16 > (end)) break;                                                    \
    vstep_a_##DP##DG##DS(&(a), pe, (k), (sq), P_, M_, D_);                         \
    EXTRA;                                                                         \
    for (pe += 16; pe + 16 <= (end); pe += 16) {                                   \
      v8 Pn_[2], Mn_[2], Dn_[2];                                                   \
      vstep_a_##DP##DG##DS(&(a), pe, (k), (sq), Pn_, Mn_, Dn_);                    \
      EXTRA;                                                                       \
      vstep_b_##DP##DG##DS(&(a), pe - 16, (k), P_, M_, D_);                        \
      for (int i_ = 0; i_ < 2; i_++) {                                             \
        P_[i_] = Pn_[i_];                                                          \
        M_[i_] = Mn_[i_];                                                          \
        D_[i_] = Dn_[i_];                                                          \
      }                                                                            \
    }                                                                              \
    vstep_b_##DP##DG##DS(&(a), pe - 16, (k), P_, M_, D_);                          \
  } while (0)
#define VSTEP8(DP, DG, DS)                                                         \
  static inline __attribute__((always_inline)) void vstep_at_##DP##DG##DS(        \
      const Arrays *a, int64_t e, int w, const StepK *k, const Sqrt *sq) {         \
    v8 P[2], G[2], M[2], V[2];                                                     \
    V8LDW(DP, a->p, e, w, P, INLANE_##DP##DG##DS);                                 \
    V8LDW(DG, a->g, e, w, G, INLANE_##DP##DG##DS);                                 \
    V8LDW(DS, a->m, e, w, M, INLANE_##DP##DG##DS);                                 \
    V8LDW(DS, a->v, e, w, V, INLANE_##DP##DG##DS);                                 \
    for (int i = 0; i < w; i++) step8(&P[i], G[i], &M[i], &V[i], k, sq);           \
    V8STW(DP, a->po, e, w, P, INLANE_##DP##DG##DS);                                \
    V8STW(DS, a->mo, e, w, M, INLANE_##DP##DG##DS);                                \
    V8STW(DS, a->vo, e, w, V, INLANE_##DP##DG##DS);                                \
  }                                                                                \
  /* the two stages of PIPE8 on the pair at e: loads, moments (stored), square roots; the update of p */     \
  static inline __attribute__((always_inline)) void vstep_a_##DP##DG##DS(         \
      const Arrays *a, int64_t e, const StepK *k, const Sqrt *sq, v8 *P, v8 *M, v8 *D) { \
    v8 G[2], V[2];                                                                 \
    PREFETCH_ARRAYS(DP, DG, DS, *a, e, 0);                                         \
    v8ld2_##DP(a->p, e, P, INLANE_##DP##DG##DS);                                   \
    v8ld2_##DG(a->g, e, G, INLANE_##DP##DG##DS);                                   \
    v8ld2_##DS(a->m, e, M, INLANE_##DP##DG##DS);                                   \
    v8ld2_##DS(a->v, e, V, INLANE_##DP##DG##DS);                                   \
    for (int i = 0; i < 2; i++) {                                                  \
      step_pre8(&P[i], G[i], &M[i], &V[i], k);                                     \
      D[i] = sqrt8(V[i], sq);                                                      \
    }                                                                              \
    v8st2_##DS(a->mo, e, M, INLANE_##DP##DG##DS);                                  \
    v8st2_##DS(a->vo, e, V, INLANE_##DP##DG##DS);                                  \
  }                                                                                \
  static inline __attribute__((always_inline)) void vstep_b_##DP##DG##DS(         \
      const Arrays *a, int64_t e, const StepK *k, const v8 *P, const v8 *M, const v8 *D) { \
    const v8 R[2] = {step_post8(P[0], M[0], D[0], k), step_post8(P[1], M[1], D[1], k)}; \
    v8st2_##DP(a->po, e, R, INLANE_##DP##DG##DS);                                  \
  }                                                                                \
  static inline __attribute__((always_inline)) void vstep_run_##DP##DG##DS(       \
      const Job *j, int fast, const Sqrt *sq) {                                    \
    (void)fast;                                                                    \
    const Arrays a = {j->p, j->g, j->m, j->v, 0, j->po, j->mo, j->vo};             \
    const StepK k = step_k(&j->s1, j->decoupled);                                  \
    int64_t pe = j->begin;                                                         \
    if (DP || DG || DS) PIPE8(DP, DG, DS, a, j->begin, j->end, &k, sq, (void)0);   \
    LOOP8(DP, DG, DS, a, pe, j->end, 0, vstep_at_##DP##DG##DS, &k, sq);            \
  }                                                                                \
  static void vstep_##DP##DG##DS(const Job *j, const Sqrt *sq) {                  \
    BY_SQRT8(STEP_SQ(sq), vstep_run_##DP##DG##DS, j);                              \
  }

/* undo8, the undone values rounded to their storage dtypes, step8 with the new gradient (redo). */
#define VUNDO8(DP, DG, DS)                                                         \
  static inline __attribute__((always_inline)) void vundo_at_##DP##DG##DS(        \
      const Arrays *a, int64_t e, int w, const UndoK *u, const StepK *k, int have_p_old, int redo, int fast, \
      const Sqrt *sq) {                                                            \
    v8 P[2], G[2], M[2], V[2], G2[2];                                              \
    V8LDW(DP, a->p, e, w, P, INLANE_##DP##DG##DS);                                 \
    V8LDW(DG, a->g, e, w, G, INLANE_##DP##DG##DS);                                 \
    V8LDW(DS, a->m, e, w, M, INLANE_##DP##DG##DS);                                 \
    V8LDW(DS, a->v, e, w, V, INLANE_##DP##DG##DS);                                 \
    if (redo) V8LDW(DG, a->g2, e, w, G2, INLANE_##DP##DG##DS);                     \
    for (int i = 0; i < w; i++) {                                                  \
      undo8(&P[i], G[i], &M[i], &V[i], u, have_p_old, fast, sq);                   \
      if (redo) {                                                                  \
        P[i] = v8round_##DP(P[i]);                                                 \
        M[i] = v8round_##DS(M[i]);                                                 \
        V[i] = v8round_##DS(V[i]);                                                 \
        step8(&P[i], G2[i], &M[i], &V[i], k, sq);                                  \
      }                                                                            \
    }                                                                              \
    V8STW(DP, a->po, e, w, P, INLANE_##DP##DG##DS);                                \
    V8STW(DS, a->mo, e, w, M, INLANE_##DP##DG##DS);                                \
    V8STW(DS, a->vo, e, w, V, INLANE_##DP##DG##DS);                                \
  }                                                                                \
  /* The undo+redo with a new gradient, software-pipelined in three stages a vector apart (vredo3; jobs with   \
     float32 states: cpu's all of them, cpu_fast's those with a bfloat16 stream): loads and sqrt(v'); the   \
     inverse, rounding, the redo's moments (stored) and square root; the parameter. Same operations as      \
     vundo_at. Its arithmetic per element per core (kernel_compute.py): cpu_fast's bf16 params + fp32      \
     states 1.76-1.90 -> 1.35-1.48 ns; cpu's (two replicas of MKL's square root: longer chains) float32    \
     -14-26%, bf16 params -7-23%. cpu_fast's float32 (2 threads a few % slower) and all-bf16 jobs (the     \
     pairs serve them better) keep the plain loop. */                                                      \
  static inline __attribute__((always_inline)) void vredo_a_##DP##DG##DS(         \
      const Arrays *a, int64_t e, v8 *S, const Sqrt *sq) {                         \
    S[0] = v8ld_##DP(a->p, e);                                                     \
    S[1] = v8ld_##DG(a->g, e);                                                     \
    S[2] = v8ld_##DS(a->m, e);                                                     \
    S[3] = v8ld_##DS(a->v, e);                                                     \
    S[4] = v8ld_##DG(a->g2, e);                                                    \
    S[5] = sqrt8(S[3], sq);                                                        \
  }                                                                                \
  static inline __attribute__((always_inline)) void vredo_b_##DP##DG##DS(         \
      const Arrays *a, int64_t e, const v8 *S, v8 *T, const UndoK *u, const StepK *k, int fast,        \
      const Sqrt *sq) {                                                            \
    v8 P = S[0], M = S[2], V = S[3];                                               \
    undo8_d(&P, S[1], &M, &V, S[5], u, 0, fast);                                   \
    P = v8round_##DP(P);                                                           \
    M = v8round_##DS(M);                                                           \
    V = v8round_##DS(V);                                                           \
    step_pre8(&P, S[4], &M, &V, k);                                                \
    v8st_##DS(a->mo, e, M);                                                        \
    v8st_##DS(a->vo, e, V);                                                        \
    T[0] = P;                                                                      \
    T[1] = M;                                                                      \
    T[2] = sqrt8(V, sq);                                                           \
  }                                                                                \
  static inline __attribute__((always_inline)) void vredo3_##DP##DG##DS(         \
      const Arrays *ap, int64_t begin, int64_t end, const UndoK *u, const StepK *k, int fast, \
      const Sqrt *sq) {                                                            \
    const Arrays a = *ap;                                                          \
    v8 S1[6], Sn[6], T0[3], Tn[3];                                                 \
    int64_t e = begin;                                                             \
    PREFETCH_ARRAYS(DP, DG, DS, a, e, 1);                                          \
    vredo_a_##DP##DG##DS(&a, e, Sn, sq);                                           \
    vredo_a_##DP##DG##DS(&a, e + 8, S1, sq);                                       \
    vredo_b_##DP##DG##DS(&a, e, Sn, T0, u, k, fast, sq);                           \
    for (e = begin + 16; e + 8 <= end; e += 8) {                                   \
      if (!((e - begin) & 8)) PREFETCH_ARRAYS(DP, DG, DS, a, e, 1);                \
      vredo_a_##DP##DG##DS(&a, e, Sn, sq);                                         \
      vredo_b_##DP##DG##DS(&a, e - 8, S1, Tn, u, k, fast, sq);                     \
      v8st_##DP(a.po, e - 16, step_post8(T0[0], T0[1], T0[2], k));                 \
      for (int i = 0; i < 6; i++) S1[i] = Sn[i];                                   \
      for (int i = 0; i < 3; i++) T0[i] = Tn[i];                                   \
    }                                                                              \
    vredo_b_##DP##DG##DS(&a, e - 8, S1, Tn, u, k, fast, sq);                       \
    v8st_##DP(a.po, e - 16, step_post8(T0[0], T0[1], T0[2], k));                   \
    v8st_##DP(a.po, e - 8, step_post8(Tn[0], Tn[1], Tn[2], k));                    \
    const int64_t rest = e; /* LOOP8 declares its own e */                        \
    if (rest < end) LOOP8(DP, DG, DS, a, rest, end, 1, vundo_at_##DP##DG##DS, u, k, 0, 1, fast, sq); \
  }                                                                                \
  static inline __attribute__((always_inline)) void vundo_run_##DP##DG##DS(       \
      const Job *j, int fast, const Sqrt *sq) {                                    \
    const int have_p_old = j->pold != 0, redo = j->op == OP_UNDO_REDO;             \
    const Arrays a = {have_p_old ? j->pold : j->p, j->g, j->m, j->v, j->g2, j->po, j->mo, j->vo}; \
    const UndoK u = undo_k(&j->s1, j->decoupled);                                  \
    const StepK k = step_k(&j->s2, j->decoupled);                                  \
    /* the loop per case, so that the flags are constants in it */                \
    if (redo && have_p_old) LOOP8(DP, DG, DS, a, j->begin, j->end, 1, vundo_at_##DP##DG##DS, &u, &k, 1, 1, fast, sq); \
    else if (redo && !DS && ((sq && sq->replica != REPLICA_IEEE) || DP || DG) && j->end - j->begin >= 24) \
      vredo3_##DP##DG##DS(&a, j->begin, j->end, &u, &k, fast, sq);                 \
    else if (redo) LOOP8(DP, DG, DS, a, j->begin, j->end, 1, vundo_at_##DP##DG##DS, &u, &k, 0, 1, fast, sq); \
    else if (have_p_old) LOOP8(DP, DG, DS, a, j->begin, j->end, 0, vundo_at_##DP##DG##DS, &u, &k, 1, 0, fast, sq); \
    else LOOP8(DP, DG, DS, a, j->begin, j->end, 0, vundo_at_##DP##DG##DS, &u, &k, 0, 0, fast, sq); \
  }                                                                                \
  static void vundo_##DP##DG##DS(const Job *j, int fast, const Sqrt *sq) {          \
    /* every caller pairs them so: cpu's (torch's square root, true divisions) or cpu_fast's (IEEE, div_by) */ \
    (void)fast;                                                                    \
    BY_SQRT8(sq, vundo_run_##DP##DG##DS, j);                                       \
  }
/* cpu's exact loops where MKL's square root has no inline replica in use (another MKL code path than the
   ones sqrt8 reproduces; also tests, with the replica switched off) with the vectors above: per
   chunk of XTILE elements, a vector pass from memory to memory up to
   the square roots (the inverse, given the chunk's sqrt(v'), and the redo's step_pre; m', v' stored, p',
   m', v' kept in local float arrays), one call of the routine on the chunk, then the parameter update.
   MKL's results do not depend on how an array is cut into calls, so the chunk is larger than TILE: a call
   costs ~0.1 us of its own. A chunk's partial vector goes through TAIL8's local copies, its parameter update
   through step_post (the same operations). */
#ifndef XTILE
#define XTILE 1024
#endif
#define SST_0(ptr, e, x) (((float *)(ptr))[e] = (x))
#define SST_1(ptr, e, x) (((uint16_t *)(ptr))[e] = f32_to_bf16(x))
/* The pass up to the square roots on the 8 elements at e: the inverse given D = sqrt(v') (not for a step;
   an undo stores its results and is done), the undone values rounded to their storage dtypes, step_pre with
   the step's gradient; m', v' stored, p', m', v' kept in PT, MT, VT (the chunk's local arrays at e). */
#define XPRE8(DP, DG, DS)                                                          \
  static inline __attribute__((always_inline)) void xpre_at_##DP##DG##DS(          \
      const Arrays *a, int64_t e, int w, float *PT, float *MT, float *VT, const float *D, const UndoK *u, \
      const StepK *k, int step, int redo, int have_p_old) {                        \
    v8 P[2], G[2], M[2], V[2];                                                     \
    V8LDW(DP, a->p, e, w, P, INLANE_##DP##DG##DS);                                 \
    V8LDW(DS, a->m, e, w, M, INLANE_##DP##DG##DS);                                 \
    V8LDW(DS, a->v, e, w, V, INLANE_##DP##DG##DS);                                 \
    if (!step) {                                                                   \
      V8LDW(DG, a->g, e, w, G, INLANE_##DP##DG##DS);                               \
      for (int i = 0; i < w; i++)                                                  \
        undo8_d(&P[i], G[i], &M[i], &V[i], _mm256_loadu_ps(D + 8 * i), u, have_p_old, 0); \
      if (!redo) {                                                                 \
        V8STW(DP, a->po, e, w, P, INLANE_##DP##DG##DS);                            \
        V8STW(DS, a->mo, e, w, M, INLANE_##DP##DG##DS);                            \
        V8STW(DS, a->vo, e, w, V, INLANE_##DP##DG##DS);                            \
        return;                                                                    \
      }                                                                            \
      for (int i = 0; i < w; i++) {                                                \
        P[i] = v8round_##DP(P[i]);                                                 \
        M[i] = v8round_##DS(M[i]);                                                 \
        V[i] = v8round_##DS(V[i]);                                                 \
      }                                                                            \
    }                                                                              \
    V8LDW(DG, step ? a->g : a->g2, e, w, G, INLANE_##DP##DG##DS);                  \
    for (int i = 0; i < w; i++) step_pre8(&P[i], G[i], &M[i], &V[i], k);           \
    V8STW(DS, a->mo, e, w, M, INLANE_##DP##DG##DS);                                \
    V8STW(DS, a->vo, e, w, V, INLANE_##DP##DG##DS);                                \
    for (int i = 0; i < w; i++) {                                                  \
      _mm256_storeu_ps(PT + 8 * i, P[i]);                                          \
      _mm256_storeu_ps(MT + 8 * i, M[i]);                                          \
      _mm256_storeu_ps(VT + 8 * i, V[i]);                                          \
    }                                                                              \
  }
NATIVE_COMBOS(XPRE8)
/* (defined below) */
#define XEXACT8_DECL(DP, DG, DS) static void xexact_##DP##DG##DS(const Job *j);
NATIVE_COMBOS(XEXACT8_DECL)
#define VECTORS8(DP, DG, DS) VSTEP8(DP, DG, DS) VUNDO8(DP, DG, DS)
NATIVE_COMBOS(VECTORS8)
#define STEP_VECTORS(DP, DG, DS) vstep_##DP##DG##DS(j, 0); return;
#define UNDO_VECTORS(DP, DG, DS) vundo_##DP##DG##DS(j, 1, 0); return;
/* cpu's loops: where an inline replica of torch's square root is in use (VECTOR_REPLICA8), the vector loops above
   with it and true divisions in the inverse; else xexact_* (MKL called per chunk). */
#define EXACT_VECTORS(DP, DG, DS)                                                  \
  if (VECTOR_REPLICA8(sq.replica)) {                                               \
    if (j->op == OP_STEP) vstep_##DP##DG##DS(j, &sq);                              \
    else vundo_##DP##DG##DS(j, 0, &sq);                                            \
    return;                                                                        \
  }                                                                                \
  xexact_##DP##DG##DS(j);                                                          \
  return;
#define AVX2_LOOPS 1
#else
#define STEP_VECTORS(DP, DG, DS)
#define UNDO_VECTORS(DP, DG, DS)
#define EXACT_VECTORS(DP, DG, DS)
#endif

#define FUSED(DP, DG, DS)                                                          \
  static void fused_##DP##DG##DS(const Job *j) {                                   \
    /* Local copies: stores through po/mo/vo could otherwise alias *j. */          \
    const void *p = j->p, *g = j->g, *m = j->m, *v = j->v, *g2 = j->g2;            \
    const void *pold = j->pold;                                                    \
    void *po = j->po, *mo = j->mo, *vo = j->vo;                                    \
    const int64_t begin = j->begin, end = j->end;                                  \
    float PT[FTILE], MT[FTILE], VT[FTILE];                                         \
    if (j->op == OP_STEP) {                                                        \
      STEP_VECTORS(DP, DG, DS)                                                     \
      const StepK k = step_k(&j->s1, j->decoupled);                                \
      for (int64_t off = begin; off < end; off += FTILE) {                         \
        const int n = (int)((end - off) < FTILE ? (end - off) : FTILE);            \
        /* float32 arrays: 16 elements (a line per stream) at a time, each line prefetched */\
        for (int i0 = 0; i0 < n && (DP || DG || DS || prefetch_lines(p, g, m, v, off + i0));                  \
             i0 += STEP_STRIDE(DP, DG, DS))                                        \
        IVDEP for (int i = i0, i1 = i0 + STEP_STRIDE(DP, DG, DS) < n ? i0 + STEP_STRIDE(DP, DG, DS) : n; i < i1; i++) {\
          const int64_t e = off + i;                                               \
          float P = LD_##DP(p, e), M = LD_##DS(m, e), V = LD_##DS(v, e);           \
          step_elem(&P, LD_##DG(g, e), &M, &V, &k);                                \
          TST_##DP(po, PT, e, i, P);                                               \
          TST_##DS(mo, MT, e, i, M);                                               \
          TST_##DS(vo, VT, e, i, V);                                               \
        }                                                                          \
        TFLUSH_##DP(po, off, PT, n);                                               \
        TFLUSH_##DS(mo, off, MT, n);                                               \
        TFLUSH_##DS(vo, off, VT, n);                                               \
      }                                                                            \
      return;                                                                      \
    }                                                                              \
    UNDO_VECTORS(DP, DG, DS)                                                       \
    const UndoK u = undo_k(&j->s1, j->decoupled);                                  \
    const StepK k = step_k(&j->s2, j->decoupled);                                  \
    const int redo = j->op == OP_UNDO_REDO;                                        \
    if (pold && redo) {                                                            \
      UNDO_LOOP(DP, DG, DS, pold, 1, 1)                                            \
    } else if (pold) {                                                             \
      UNDO_LOOP(DP, DG, DS, pold, 1, 0)                                            \
    } else if (redo) {                                                             \
      UNDO_LOOP(DP, DG, DS, p, 0, 1)                                               \
    } else {                                                                       \
      UNDO_LOOP(DP, DG, DS, p, 0, 0)                                               \
    }                                                                              \
  }

NATIVE_COMBOS(FUSED)

/* ---------------------------------------------------------------- exact path
   Bitwise torch: the square roots come from torch's own routine (Sqrt), called on chunks of
   TILE elements. Per chunk, everything before a square root and everything after it runs as
   one fused loop from memory to memory (stores of m', v' interleaved with the loads), so only
   the square-root call and the final parameter loop run without memory traffic. */
/* Stores of the exact loops go through TST/TFLUSH as in the fused loops: float32 arrays
   directly, bfloat16 ones after the loop by store_bf16. With a bfloat16 storage an undo+redo
   rounds the undone values by round_bf16 between two loops; with float32 storage it is one loop. */
#define EXACT_UNDO_LOOP(DP, DG, DS, PSRC, HAVE_P_OLD, REDO)                        \
  if (REDO && (DP || DS)) {                                                        \
    IVDEP for (int i = 0; i < n; i++) {                                            \
      const int64_t e = off + i;                                                   \
      float P = LD_##DP(PSRC, e), M = LD_##DS(m, e), V = LD_##DS(v, e);            \
      undo_elem_d(&P, LD_##DG(g, e), &M, &V, D[i], &u, HAVE_P_OLD, 0);             \
      PT[i] = P;                                                                   \
      MT[i] = M;                                                                   \
      VT[i] = V;                                                                   \
    }                                                                              \
    TRT_##DP(PT, n);                                                               \
    TRT_##DS(MT, n);                                                               \
    TRT_##DS(VT, n);                                                               \
    IVDEP for (int i = 0; i < n; i++) {                                            \
      const int64_t e = off + i;                                                   \
      float P = PT[i], M = MT[i], V = VT[i];                                       \
      step_pre(&P, LD_##DG(g2, e), &M, &V, &k);                                    \
      PT[i] = P;                                                                   \
      TST_##DS(mo, MT, e, i, M);                                                   \
      TST_##DS(vo, VT, e, i, V);                                                   \
      MT[i] = M;                                                                   \
      VT[i] = V;                                                                   \
    }                                                                              \
  } else {                                                                         \
    IVDEP for (int i = 0; i < n; i++) {                                            \
      const int64_t e = off + i;                                                   \
      float P = LD_##DP(PSRC, e), M = LD_##DS(m, e), V = LD_##DS(v, e);            \
      undo_elem_d(&P, LD_##DG(g, e), &M, &V, D[i], &u, HAVE_P_OLD, 0);             \
      if (REDO) {                                                                  \
        step_pre(&P, LD_##DG(g2, e), &M, &V, &k);                                  \
        PT[i] = P;                                                                 \
      } else {                                                                     \
        TST_##DP(po, PT, e, i, P);                                                 \
      }                                                                            \
      TST_##DS(mo, MT, e, i, M);                                                   \
      TST_##DS(vo, VT, e, i, V);                                                   \
      if (REDO) {                                                                  \
        MT[i] = M;                                                                 \
        VT[i] = V;                                                                 \
      }                                                                            \
    }                                                                              \
    if (!REDO) { TFLUSH_##DP(po, off, PT, n); }                                    \
  }                                                                                \
  TFLUSH_##DS(mo, off, MT, n);                                                     \
  TFLUSH_##DS(vo, off, VT, n);

#define EXACT(DP, DG, DS)                                                          \
  static void exact_##DP##DG##DS(const Job *j) {                                   \
    const void *p = j->p, *g = j->g, *m = j->m, *v = j->v, *g2 = j->g2;            \
    const void *pold = j->pold;                                                    \
    void *po = j->po, *mo = j->mo, *vo = j->vo;                                    \
    const Sqrt sq = j->sq;                                                         \
    const int redo = j->op == OP_UNDO_REDO;                                        \
    const StepK k = step_k(j->op == OP_STEP ? &j->s1 : &j->s2, j->decoupled);      \
    const UndoK u = undo_k(&j->s1, j->decoupled);                                  \
    float PT[TILE], MT[TILE], VT[TILE], D[TILE];                                   \
    EXACT_VECTORS(DP, DG, DS)                                                 \
    for (int64_t off = j->begin; off < j->end; off += TILE) {                      \
      const int n = (int)((j->end - off) < TILE ? (j->end - off) : TILE);          \
      if (j->op == OP_STEP) {                                                      \
        IVDEP for (int i = 0; i < n; i++) {                                        \
          const int64_t e = off + i;                                               \
          float P = LD_##DP(p, e), M = LD_##DS(m, e), V = LD_##DS(v, e);           \
          step_pre(&P, LD_##DG(g, e), &M, &V, &k);                                 \
          TST_##DS(mo, MT, e, i, M);                                               \
          TST_##DS(vo, VT, e, i, V);                                               \
          PT[i] = P;                                                               \
          MT[i] = M;                                                               \
          VT[i] = V;                                                               \
        }                                                                          \
        TFLUSH_##DS(mo, off, MT, n);                                               \
        TFLUSH_##DS(vo, off, VT, n);                                               \
      } else {                                                                     \
        if (pold) {                                                                \
          if (redo) {                                                              \
            EXACT_UNDO_LOOP(DP, DG, DS, pold, 1, 1)                                \
          } else {                                                                 \
            EXACT_UNDO_LOOP(DP, DG, DS, pold, 1, 0)                                \
          }                                                                        \
        } else {                                                                   \
          for (int i = 0; i < n; i++) VT[i] = LD_##DS(v, off + i);                 \
          sqrt_tile(D, VT, &sq, n);                                                \
          if (redo) {                                                              \
            EXACT_UNDO_LOOP(DP, DG, DS, p, 0, 1)                                   \
          } else {                                                                 \
            EXACT_UNDO_LOOP(DP, DG, DS, p, 0, 0)                                   \
          }                                                                        \
        }                                                                          \
        if (!redo) continue;                                                       \
      }                                                                            \
      sqrt_tile(D, VT, &sq, n);                                                    \
      IVDEP for (int i = 0; i < n; i++) {                                          \
        const float r = step_post(PT[i], MT[i], D[i], &k);                         \
        TST_##DP(po, PT, off + i, i, r);                                           \
      }                                                                            \
      TFLUSH_##DP(po, off, PT, n);                                                 \
    }                                                                              \
  }

NATIVE_COMBOS(EXACT)

typedef void (*fused_fn)(const Job *);

/* The fused (or exact) loop for this job's dtypes, or 0 (the tiled path handles every combination). */
static fused_fn fused_for(const Job *j, int exact) {
  if (j->g2 && j->dg2 != j->dg) return 0;
  if (j->pold && j->dpo != j->dp) return 0;
#define COMBO_CASE(DP, DG, DS) \
  case DP * 100 + DG * 10 + DS: return exact ? exact_##DP##DG##DS : fused_##DP##DG##DS;
  switch (j->dp * 100 + j->dg * 10 + j->ds) {
    NATIVE_COMBOS(COMBO_CASE)
    default: return 0;
  }
#undef COMBO_CASE
}

/* The new parameters of elements [begin, end) (in po, the step's output) converted to pc's dtype and
   stored in pc: the copy of the parameters into a second buffer (the model's, in another dtype) that
   the offload engine would otherwise make after the step with a pass of its own. run_range calls it
   per chunk right after the step of the chunk, so po is read from the cache; where the CPU has AVX-512
   the float32 and bfloat16 copies use streaming stores, which do not read pc's lines before writing
   them (a plain store does): the step plus this copy took 39.5-40.2 ms at 2^26 float32 elements
   against 47.8-48.6 for the step and then a copy (benchmarks/RESULTS.md "Fused parameter copy"). */
static void copy_params(const Job *j, int64_t begin, int64_t end) {
  int64_t e = begin;
#if defined(__AVX512F__)
  if (j->dpc == DT_F32 && j->dp == DT_F32) {
    const float *src = (const float *)j->po;
    float *dst = (float *)j->pc;
    for (; e < end && ((uintptr_t)(dst + e) & 63); e++) dst[e] = src[e];
    for (; e + 16 <= end; e += 16) _mm512_stream_ps(dst + e, _mm512_loadu_ps(src + e));
  } else if (j->dpc == DT_BF16 && j->dp == DT_BF16) {
    const uint16_t *src = (const uint16_t *)j->po;
    uint16_t *dst = (uint16_t *)j->pc;
    for (; e < end && ((uintptr_t)(dst + e) & 63); e++) dst[e] = src[e];
    for (; e + 32 <= end; e += 32) _mm512_stream_si512((__m512i *)(dst + e), _mm512_loadu_si512(src + e));
  }
#ifdef HW_BF16
  else if (j->dpc == DT_BF16 && j->dp == DT_F32) {
    const float *src = (const float *)j->po;
    uint16_t *dst = (uint16_t *)j->pc;
    for (; e < end && ((uintptr_t)(dst + e) & 31); e++) dst[e] = f32_to_bf16(src[e]);
    for (; e + 16 <= end; e += 16) _mm256_stream_si256((__m256i *)(dst + e), cvt_bf16_16(_mm512_loadu_ps(src + e)));
  }
#endif
#endif
  float T[TILE];
  for (; e < end; e += TILE) {
    const int n = (int)((end - e) < TILE ? (end - e) : TILE);
    load(T, j->po, j->dp, e, n);
    store(j->pc, j->dpc, e, T, n);
  }
}

/* The step of one full chunk (j: begin..end, CHUNK elements) by the vector loop, which also reads the
   gradient of the next chunk, [end, scan_end), a vector per vector of this chunk: 1 if it holds an inf
   or a nan. The next chunk's check then runs beside this chunk's four streams instead of as a pass of
   one stream before its step (GPT-2 small's update: the pass before cost ~6 ms of ~79). */
typedef int (*scan_step_fn)(const Job *, int, const Sqrt *, int64_t);
#ifdef HW_BF16
/* a full chunk (see scan_step_for): vstep_run / vundo_run with the next chunk's gradient read */
#define VSCAN(DP, DG, DS)                                                          \
  static int vstep_scan_##DP##DG##DS(const Job *j, int fast, const Sqrt *sq, int64_t scan_end) { \
    (void)fast;                                                                    \
    return BY_SQRT(STEP_SQ(sq), vstep_run_##DP##DG##DS, j, scan_end, 1);                    \
  }                                                                                \
  static int vredo_scan_##DP##DG##DS(const Job *j, int fast, const Sqrt *sq, int64_t scan_end) { \
    (void)fast;                                                                    \
    return BY_SQRT(sq, vundo_run_##DP##DG##DS, j, scan_end, 1);                    \
  }
NATIVE_COMBOS(VSCAN)
#endif
#ifdef AVX2_LOOPS
/* vstep_scan / vredo_scan with the AVX2 loops: 16 elements of the next chunk's gradient per 16 of this
   chunk's (two vectors), the lanes above lim collected in one vector. */
static inline __m256i vnonfinite8_0(const void *g, int64_t e, uint32_t lim) {
  const float *a = (const float *)g + e;
  const __m256i mag = _mm256_set1_epi32(0x7FFFFFFF), l = _mm256_set1_epi32((int)lim);
  const __m256i x0 = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)a), mag);
  const __m256i x1 = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(a + 8)), mag);
  return _mm256_or_si256(_mm256_cmpgt_epi32(x0, l), _mm256_cmpgt_epi32(x1, l)); /* both sides >= 0 */
}
static inline __m256i vnonfinite8_1(const void *g, int64_t e, uint32_t lim) {
  const __m256i x = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)((const uint16_t *)g + e)),
                                     _mm256_set1_epi16(0x7FFF));
  return _mm256_cmpgt_epi16(x, _mm256_set1_epi16((short)lim));
}
#define SCAN8_AT(DG, gs, e, scan_end, bad, lim)                                    \
  if ((e) + CHUNK + 16 <= (scan_end)) {                                            \
    _mm_prefetch((const char *)(gs) + ((e) + CHUNK) * ES_##DG + SCAN_PREFETCH, _MM_HINT_T0); \
    (bad) = _mm256_or_si256((bad), vnonfinite8_##DG((gs), (e) + CHUNK, (lim)));    \
  }
#define SCAN8_RESULT(DG, gs, begin, scan_end, bad, lim)                            \
  (!_mm256_testz_si256((bad), (bad)) || SCAN_REST_BAD(DG, gs, begin, scan_end, lim))
/* chunk_exact's L2 terms on 8 lanes (t: gh * gh * c; mb: m0). */
static inline __attribute__((always_inline)) v8 vlossy8_l2(v8 t, v8 gh, v8 p, v8 mb, v8 v, const LossyK *x) {
  const v8 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)), zero = _mm256_setzero_ps();
  const v8 mp = _mm256_add_ps(_mm256_mul_ps(mb, _mm256_set1_ps(x->r1)), _mm256_mul_ps(gh, _mm256_set1_ps(x->omb1n)));
  const v8 vp = _mm256_add_ps(_mm256_mul_ps(v, _mm256_set1_ps(x->r2)),
                              _mm256_mul_ps(_mm256_mul_ps(gh, _mm256_set1_ps(x->omb2n)), gh));
  const v8 q = _mm256_blendv_ps(_mm256_div_ps(_mm256_and_ps(mp, absm), _mm256_sqrt_ps(vp)), zero,
                                _mm256_cmp_ps(mp, zero, _CMP_EQ_OQ));
  const v8 ap = _mm256_and_ps(p, absm), ag = _mm256_and_ps(gh, absm);
  const v8 a = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(ap, _mm256_set1_ps(x->wa)),
                                           _mm256_mul_ps(q, _mm256_set1_ps(x->wka))), ag);
  const v8 b = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(ap, _mm256_set1_ps(x->wb)),
                                           _mm256_mul_ps(q, _mm256_set1_ps(x->wkb))), ag);
  const v8 t1 = _mm256_mul_ps(_mm256_mul_ps(a, ag), _mm256_set1_ps(x->cv));
  const v8 t2 = _mm256_mul_ps(_mm256_mul_ps(b, b), _mm256_set1_ps(x->cm));
  t = _mm256_blendv_ps(t, t1, _mm256_cmp_ps(t1, t, _CMP_GT_OQ));
  return _mm256_blendv_ps(t, t2, _mm256_cmp_ps(t2, t, _CMP_GT_OQ));
}
/* vlossy on the AVX2 loops' 8 lanes (the same operations, so the same flags), 16 elements per SCAN8L_AT. */
#define VLOSSY8(DP, DG, DS)                                                        \
  static inline __attribute__((always_inline)) __m256i vlossy8_##DP##DG##DS(     \
      const Arrays *a, int64_t e, const LossyK *x, int redo) {                     \
    const v8 zero = _mm256_setzero_ps();                                           \
    v8 v = v8ld_##DS(a->v, e), p = zero, gh;                                       \
    const v8 m = v8ld_##DS(a->m, e);                                               \
    v8 m0 = m; /* 0 where the moments' m is 0 (a redo's: the undone one's numerator) */ \
    if (x->l2n || x->l2o) p = v8ld_##DP(a->p, e);                                  \
    if (redo && x->pest)                                                           \
      p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(x->sso), m),  \
                                         _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), _mm256_set1_ps(x->bc2o)), \
                                                       _mm256_set1_ps(x->epso)))); \
    if (redo) {                                                                    \
      v8 go = _mm256_mul_ps(v8ld_##DG(a->g, e), _mm256_set1_ps(x->gso));           \
      if (x->l2o) go = _mm256_add_ps(go, _mm256_mul_ps(p, _mm256_set1_ps(x->wdo))); \
      const v8 u = _mm256_sub_ps(v, _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(x->omb2o), go), go)); \
      v = _mm256_blendv_ps(u, zero, _mm256_cmp_ps(u, zero, _CMP_LT_OQ));           \
      if (x->zok || x->l2n) m0 = _mm256_sub_ps(m, _mm256_mul_ps(_mm256_set1_ps(x->omb1o), go)); \
      gh = v8ld_##DG(a->g2, e);                                                    \
    } else {                                                                       \
      gh = v8ld_##DG(a->g, e);                                                     \
    }                                                                              \
    gh = _mm256_mul_ps(gh, _mm256_set1_ps(x->gsn));                                \
    if (x->l2n) gh = _mm256_add_ps(gh, _mm256_mul_ps(p, _mm256_set1_ps(x->wdn)));  \
    v8 t = _mm256_mul_ps(_mm256_mul_ps(gh, gh), _mm256_set1_ps(x->c));             \
    if (x->l2t) t = vlossy8_l2(t, gh, p, m0, v, x);                                \
    if (redo) t = _mm256_mul_ps(t, _mm256_set1_ps(x->b2s));                        \
    const v8 am = _mm256_and_ps(m, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))); \
    const v8 big = _mm256_set1_ps(FLT_MAX);                                        \
    v8 over = _mm256_cmp_ps(t, v, _CMP_NLE_UQ);                                    \
    if (x->zok)                                                                    \
      over = _mm256_andnot_ps(_mm256_and_ps(_mm256_cmp_ps(v, zero, _CMP_EQ_OQ), _mm256_cmp_ps(m0, zero, _CMP_EQ_OQ)), \
                              over);                                               \
    return _mm256_castps_si256(_mm256_or_ps(_mm256_or_ps(over, _mm256_cmp_ps(t, big, _CMP_NLE_UQ)), \
                                            _mm256_cmp_ps(am, big, _CMP_NLE_UQ))); \
  }
NATIVE_COMBOS(VLOSSY8)
/* SCAN8_AT and vlossy8 on the same 16 elements of the next chunk (their v, p, old gradient prefetched ahead as
   the gradient is). */
#define SCAN8L_AT(DP, DG, DS, a, gs, e, scan_end, bad, lim, lx, redo)              \
  SCAN8_AT(DG, gs, e, scan_end, bad, lim)                                          \
  if ((e) + CHUNK + 16 <= (scan_end)) {                                            \
    LOSSY_PREFETCH(DP, DG, DS, a, e, lx, redo);                                    \
    (bad) = _mm256_or_si256((bad), vlossy8_##DP##DG##DS(&(a), (e) + CHUNK, &(lx), (redo)));  \
    (bad) = _mm256_or_si256((bad), vlossy8_##DP##DG##DS(&(a), (e) + CHUNK + 8, &(lx), (redo))); \
  }
/* j is a full chunk (CHUNK elements, a multiple of 16): the loop leaves no remainder. */
#define VSCAN8(DP, DG, DS)                                                         \
  static inline __attribute__((always_inline)) int vstep_scan_run_##DP##DG##DS(  \
      const Job *j, int64_t scan_end, int fast, const Sqrt *sq) {                  \
    (void)fast;                                                                    \
    const Arrays a = {j->p, j->g, j->m, j->v, 0, j->po, j->mo, j->vo};             \
    const StepK k = step_k(&j->s1, j->decoupled);                                  \
    const uint32_t lim = j->s1.lim[DG];                                            \
    const LossyK lx = lossy_k(j);                                                  \
    __m256i bad = _mm256_setzero_si256();                                          \
    int64_t pe;                                                                    \
    if (DP || DG || DS) {                                                          \
      PIPE8(DP, DG, DS, a, j->begin, j->end, &k, sq, SCAN8L_AT(DP, DG, DS, a, a.g, pe, scan_end, bad, lim, lx, 0)); \
    } else {                                                                       \
      for (int64_t e = j->begin; e + 16 <= j->end; e += 16) {                     \
        PREFETCH_ARRAYS(DP, DG, DS, a, e, 0);                                      \
        TWO8(DP, DG, DS, vstep_at_##DP##DG##DS, &a, e, &k, sq);                    \
        SCAN8L_AT(DP, DG, DS, a, a.g, e, scan_end, bad, lim, lx, 0)                \
      }                                                                            \
    }                                                                              \
    return SCAN8_RESULT(DG, a.g, j->begin, scan_end, bad, lim) || LOSSY_REST_BAD(j, j->begin, scan_end); \
  }                                                                                \
  static int vstep_scan_##DP##DG##DS(const Job *j, int fast, const Sqrt *sq, int64_t scan_end) { \
    (void)fast;                                                                    \
    return BY_SQRT8(STEP_SQ(sq), vstep_scan_run_##DP##DG##DS, j, scan_end);         \
  }                                                                                \
  static inline __attribute__((always_inline)) int vredo_scan_run_##DP##DG##DS(  \
      const Job *j, int64_t scan_end, int fast, const Sqrt *sq) {                  \
    const int have_p_old = j->pold != 0;                                           \
    const Arrays a = {have_p_old ? j->pold : j->p, j->g, j->m, j->v, j->g2, j->po, j->mo, j->vo}; \
    const UndoK u = undo_k(&j->s1, j->decoupled);                                  \
    const StepK k = step_k(&j->s2, j->decoupled);                                  \
    const uint32_t lim = j->s2.lim[DG];                                            \
    const LossyK lx = lossy_k(j);                                                  \
    __m256i bad = _mm256_setzero_si256();                                          \
    for (int64_t e = j->begin; e + 16 <= j->end; e += 16) {                       \
      PREFETCH_ARRAYS(DP, DG, DS, a, e, 1);                                        \
      TWO8(DP, DG, DS, vundo_at_##DP##DG##DS, &a, e, &u, &k, have_p_old, 1, fast, sq); \
      SCAN8L_AT(DP, DG, DS, a, a.g2, e, scan_end, bad, lim, lx, 1)                 \
    }                                                                              \
    return SCAN8_RESULT(DG, a.g2, j->begin, scan_end, bad, lim) || LOSSY_REST_BAD(j, j->begin, scan_end); \
  }                                                                                \
  static int vredo_scan_##DP##DG##DS(const Job *j, int fast, const Sqrt *sq, int64_t scan_end) { \
    (void)fast; /* !sq, as in vundo */                                             \
    return BY_SQRT8(sq, vredo_scan_run_##DP##DG##DS, j, scan_end);                 \
  }
NATIVE_COMBOS(VSCAN8)
/* xexact_* (cpu's AVX2 loops). */
#define XEXACT8(DP, DG, DS)                                                        \
  static void xexact_##DP##DG##DS(const Job *j) {                                  \
    const int step = j->op == OP_STEP, redo = j->op == OP_UNDO_REDO, have_p_old = !step && j->pold; \
    const Arrays a = {have_p_old ? j->pold : j->p, j->g, j->m, j->v, j->g2, j->po, j->mo, j->vo}; \
    const UndoK u = undo_k(&j->s1, j->decoupled);                                  \
    const StepK k = step_k(step ? &j->s1 : &j->s2, j->decoupled);                  \
    float PT[XTILE], MT[XTILE], VT[XTILE], D[XTILE] = {0};                         \
    for (int64_t off = j->begin; off < j->end; off += XTILE) {                     \
      const int n = (int)((j->end - off) < XTILE ? (j->end - off) : XTILE), nv = n / 8 * 8; \
      /* vectors in pairs (see v8ld2_1: the local arrays hold a pair's elements in the order its loads give) */ \
      const int np = nv / 16 * 16;                                                 \
      if (!step && !have_p_old) {                                                  \
        for (int i = 0; i < np; i += 16) {                                         \
          v8 X[2];                                                                 \
          v8ld2_##DS(a.v, off + i, X, INLANE_##DP##DG##DS);                        \
          _mm256_storeu_ps(VT + i, X[0]);                                          \
          _mm256_storeu_ps(VT + i + 8, X[1]);                                      \
        }                                                                          \
        for (int i = np; i < nv; i += 8) _mm256_storeu_ps(VT + i, v8ld_##DS(a.v, off + i)); \
        for (int i = nv; i < n; i++) VT[i] = LD_##DS(a.v, off + i);                \
        sqrt_tile(D, VT, &j->sq, n);                                               \
      }                                                                            \
      for (int i = 0; i < np; i += 16) {                                           \
        PREFETCH_ARRAYS(DP, DG, DS, a, off + i, redo);                             \
        xpre_at_##DP##DG##DS(&a, off + i, 2, PT + i, MT + i, VT + i, D + i, &u, &k, step, redo, have_p_old); \
      }                                                                            \
      if (np < nv) {                                                               \
        PREFETCH_ARRAYS(DP, DG, DS, a, off + np, redo);                            \
        xpre_at_##DP##DG##DS(&a, off + np, 1, PT + np, MT + np, VT + np, D + np, &u, &k, step, redo, have_p_old); \
      }                                                                            \
      if (nv < n) /* the chunk's partial vector (its lanes past n are in the local arrays' range) */ \
        TAIL8(DP, DG, DS, a, off + nv, n - nv, redo, xpre_at_##DP##DG##DS, 1, PT + nv, MT + nv, VT + nv, \
              D + nv, &u, &k, step, redo, have_p_old);                             \
      if (!step && !redo) continue;                                                \
      sqrt_tile(D, VT, &j->sq, n);                                                 \
      for (int i = 0; i < np; i += 16) {                                           \
        const v8 R[2] = {step_post8(_mm256_loadu_ps(PT + i), _mm256_loadu_ps(MT + i), _mm256_loadu_ps(D + i), &k), \
                         step_post8(_mm256_loadu_ps(PT + i + 8), _mm256_loadu_ps(MT + i + 8),                  \
                                    _mm256_loadu_ps(D + i + 8), &k)};                                         \
        v8st2_##DP(a.po, off + i, R, INLANE_##DP##DG##DS);                         \
      }                                                                            \
      if (np < nv)                                                                 \
        v8st_##DP(a.po, off + np, step_post8(_mm256_loadu_ps(PT + np), _mm256_loadu_ps(MT + np),             \
                                             _mm256_loadu_ps(D + np), &k));       \
      for (int i = nv; i < n; i++) SST_##DP(a.po, off + i, step_post(PT[i], MT[i], D[i], &k)); \
    }                                                                              \
  }
NATIVE_COMBOS(XEXACT8)
#endif

/* The step (vstep_scan) or undo+redo (vredo_scan) of one chunk by the vector loop that also reads the
   gradient of the next chunk ([end, scan_end): the step's own, or the redo's new one), a vector per vector
   of this chunk, with a prefetch ahead: 1 if it holds an inf or a nan. The next chunk's check then runs
   beside this chunk's streams instead of as a pass of one stream before its step (GPT-2 small's update:
   that pass cost ~6 ms of ~79). For a job whose vector loop runs (cpu_fast's; cpu's where the inline
   square root is in use), with its loop's square root in *sq and division mode in *fast; 0 elsewhere. */
static scan_step_fn scan_step_for(const Job *j, const Sqrt **sq, int *fast) {
#ifdef HW_BF16
  if (j->op == OP_UNDO || (j->exact && !j->sq.replica) || !fused_for(j, j->exact)) return 0;
  *sq = j->exact ? &j->sq : 0;
  *fast = !j->exact;
#define COMBO_CASE(DP, DG, DS) \
  case DP * 100 + DG * 10 + DS: return j->op == OP_STEP ? vstep_scan_##DP##DG##DS : vredo_scan_##DP##DG##DS;
  switch (j->dp * 100 + j->dg * 10 + j->ds) {
    NATIVE_COMBOS(COMBO_CASE)
    default: return 0;
  }
#undef COMBO_CASE
#elif defined(AVX2_LOOPS)
  if (j->op == OP_UNDO || !fused_for(j, j->exact)) return 0;
  const int xexact = j->exact && !VECTOR_REPLICA8(j->sq.replica); /* else the vector loops (see EXACT_VECTORS) */
  if (xexact) return 0; /* (xexact reads no next chunk: chunk_finite's and chunk_exact's passes check it) */
  *sq = j->exact ? &j->sq : 0;
  *fast = !j->exact;
#define COMBO_CASE(DP, DG, DS) \
  case DP * 100 + DG * 10 + DS:  \
    return j->op == OP_STEP ? vstep_scan_##DP##DG##DS : vredo_scan_##DP##DG##DS;
  switch (j->dp * 100 + j->dg * 10 + j->ds) {
    NATIVE_COMBOS(COMBO_CASE)
    default: return 0;
  }
#undef COMBO_CASE
#else
  (void)j;
  (void)sq;
  (void)fast;
  return 0;
#endif
}

/* The job's elements [begin, end). With skip (a step, or an undo+redo: its new gradient): per chunk of
   CHUNK elements (counted from the block's start; begin is a multiple of CHUNK), the gradient is read
   before the chunk is written (in the previous chunk's vector loop where there is one, see vstep_scan,
   else in a pass of its own just before) and a chunk with an inf or a nan in it is left alone (nothing
   of it written: outputs, p_copy) and its flag set to 1. That spares the caller a pass over the gradient
   to learn whether the step can be undone algebraically: it snapshots the flagged chunks (still the old
   values) and steps them afterwards. */
static void run_listed(const Job *j);

static void run_range(const Job *j) {
  if (j->chunks) {
    run_listed(j);
    return;
  }
  fused_fn f = fused_for(j, j->exact);
  const int restore = (f && j->sq.fn && j->sq.local) ? j->sq.local(1) : -1;
  if (!j->pc && !j->skip) {
    if (f) f(j);
    else run_tiles(j);
  } else {
    Job part = *j;
    const Sqrt *ssq = 0;
    int sfast = 0;
    const scan_step_fn scan_step = j->skip ? scan_step_for(j, &ssq, &sfast) : 0;
    const void *checked = j->op == OP_UNDO_REDO ? j->g2 : j->g; /* the gradient of the step taken */
    const int dchecked = j->op == OP_UNDO_REDO ? j->dg2 : j->dg;
    const uint32_t lim = (j->op == OP_UNDO_REDO ? &j->s2 : &j->s1)->lim[dchecked];
    int next_bad = -1; /* the chunk's gradient as the previous chunk's loop found it; -1: not read yet */
    for (int64_t c = j->begin; c < j->end; c += CHUNK) {
      part.begin = c;
      part.end = j->end - c < CHUNK ? j->end : c + CHUNK;
      if (j->skip) {
        /* (the inverse's test first: it stops at the first tile with a lossy element, where a spike
           flags every chunk, and the finiteness pass then reads the gradient from cache) */
        const int bad = next_bad >= 0 ? next_bad
                                      : !chunk_exact(j, part.begin, part.end)
                                        || !chunk_finite(checked, dchecked, part.begin, part.end, lim);
        next_bad = -1;
        if (bad) {
          j->skip[c / CHUNK] = 1;
          continue;
        }
        if (scan_step && part.end - part.begin == CHUNK && part.end < j->end) {
          next_bad = scan_step(&part, sfast, ssq, j->end - part.end < CHUNK ? j->end : part.end + CHUNK);
          if (j->pc) copy_params(j, part.begin, part.end);
          continue;
        }
      }
      if (f) f(&part);
      else run_tiles(&part);
      if (j->pc) copy_params(j, part.begin, part.end);
    }
#if defined(__AVX512F__)
    if (j->pc) _mm_sfence(); /* the streaming stores are visible to other threads before this thread's part ends */
#endif
  }
  if (restore >= 0) j->sq.local(restore);
}

/* Bytes per element of dtype dt. */
static inline int64_t esize(int dt) { return dt == DT_F32 ? 4 : 2; }

/* bytes from src to dst (not overlapping) by streaming stores where the vector unit has them: the kept old
   values are not read again soon, and a store that does not read the line first leaves the memory's reads to
   the step (their copy costs a write stream, not a read and a write). The caller fences (_mm_sfence) before
   its job ends. */
static void copy_streaming(void *dst, const void *src, int64_t bytes) {
  char *d = (char *)dst;
  const char *s = (const char *)src;
  int64_t e = 0;
#if defined(__AVX512F__)
  const int64_t head = (int64_t)((64 - ((uintptr_t)d & 63)) & 63);
  if (head >= bytes) {
    memcpy(d, s, (size_t)bytes);
    return;
  }
  memcpy(d, s, (size_t)head);
  for (e = head; e + 64 <= bytes; e += 64) _mm512_stream_si512((__m512i *)(d + e), _mm512_loadu_si512(s + e));
#elif defined(__AVX2__)
  const int64_t head = (int64_t)((32 - ((uintptr_t)d & 31)) & 31);
  if (head >= bytes) {
    memcpy(d, s, (size_t)bytes);
    return;
  }
  memcpy(d, s, (size_t)head);
  for (e = head; e + 32 <= bytes; e += 32)
    _mm256_stream_si256((__m256i *)(d + e), _mm256_loadu_si256((const __m256i *)(s + e)));
#endif
  memcpy(d + e, s + e, (size_t)(bytes - e));
}

/* A job over listed chunks (sofx_adam_many's chunk table): its elements [begin, end) are positions in the
   concatenation of the listed chunks (ascending chunk indices of a block of leaf_n elements; begin a
   multiple of CHUNK). Adjacent listed chunks run as one range (one job of the ordinary kind: the checked
   step's reads of the next chunk in the vector loop), every array read and written at the range but p, m, v
   with packed (read at the range's positions). With kp, km, kv the listed chunks' p, m, v are copied there
   (at their positions) first, chunk by chunk, each chunk stepped right after its copy (still in cache). */
static void run_listed(const Job *j) {
  const int64_t ep = esize(j->dp), es = esize(j->ds);
  for (int64_t at = j->begin; at < j->end;) {
    const int64_t first = j->chunks[at / CHUNK], a = first * CHUNK;
    int64_t last = first, stop = at + CHUNK; /* the run: chunks first..last, positions [at, stop) */
    while (!j->kp && stop < j->end && j->chunks[stop / CHUNK] == last + 1) {
      last++;
      stop += CHUNK;
    }
    const int64_t len = ((last + 1) * CHUNK < j->leaf_n ? (last + 1) * CHUNK : j->leaf_n) - a;
    const int64_t from = j->packed ? at : a;
    Job part = *j;
    part.chunks = 0;
    part.kp = part.km = part.kv = 0;
    part.p = (const char *)j->p + from * ep;
    part.m = (const char *)j->m + from * es;
    part.v = (const char *)j->v + from * es;
    if (j->kp) {
      copy_streaming((char *)j->kp + at * ep, part.p, len * ep);
      copy_streaming((char *)j->km + at * es, part.m, len * es);
      copy_streaming((char *)j->kv + at * es, part.v, len * es);
    }
    part.g = (const char *)j->g + a * esize(j->dg);
    if (j->g2) part.g2 = (const char *)j->g2 + a * esize(j->dg2);
    if (j->pold) part.pold = (const char *)j->pold + a * esize(j->dpo);
    part.po = (char *)j->po + a * ep;
    part.mo = (char *)j->mo + a * es;
    part.vo = (char *)j->vo + a * es;
    if (j->pc) part.pc = (char *)j->pc + a * esize(j->dpc);
    if (j->skip) part.skip = j->skip + first;
    part.n = len;
    part.begin = 0;
    part.end = len;
    run_range(&part);
    at += len;
  }
#if defined(__AVX512F__) || defined(__AVX2__)
  if (j->kp) _mm_sfence(); /* the kept values' streaming stores visible before this thread's part ends */
#endif
}

#define MAX_THREADS 256

/* Memory of a call (sofx_overlap): one span per array, twice its start plus 1 if written, twice its end. */
typedef struct {
  uint64_t s2, e2;
  int64_t b;
  int col;
} Span;

static int span_order(const void *x, const void *y) {
  const uint64_t a = ((const Span *)x)->s2, b = ((const Span *)y)->s2;
  return a < b ? -1 : a > b;
}

/* Whether a written array of a sofx_adam_many call (its tables: count blocks, dtypes, ns, ptrs; every array
   contiguous) shares memory with another array of the call. Compared: p, g, m, v, g_new, p_old (read, but p,
   m, v written where the outputs are the inputs: ptrs p_out == p), p_copy and skip (written); outputs that are
   not the inputs are fresh. Returns 0 for none; 1 with out = {block, column, block, column} of a written
   array and one it overlaps (the written one first; of two written ones the first in the tables); -1 out of
   memory. */
int sofx_overlap(int64_t count, const int *dtypes, const int64_t *ns, void *const *ptrs, int64_t *out) {
  static const int cols[8] = {0, 1, 2, 3, 4, 5, 9, 10};
  static const int dcols[8] = {0, 1, 2, 2, 3, 4, 5, -1};
  Span *sp = (Span *)malloc((size_t)(count > 0 ? count : 1) * 8 * sizeof(Span));
  if (!sp) return -1;
  int64_t n = 0;
  for (int64_t b = 0; b < count; b++) {
    void *const *pt = ptrs + 11 * b;
    const int donated = pt[6] == pt[0];
    for (int k = 0; k < 8; k++) {
      const uint64_t ptr = (uint64_t)(uintptr_t)pt[cols[k]];
      if (!ptr) continue;
      const int64_t bytes = dcols[k] >= 0 ? ns[b] * (dtypes[6 * b + dcols[k]] == DT_F32 ? 4 : 2)
                                          : (ns[b] + CHUNK - 1) / CHUNK;
      if (bytes <= 0) continue;
      const int w = k >= 6 || ((k == 0 || k == 2 || k == 3) && donated);
      sp[n].s2 = 2 * ptr + (uint64_t)w;
      sp[n].e2 = 2 * (ptr + (uint64_t)bytes);
      sp[n].b = b;
      sp[n].col = cols[k];
      n++;
    }
  }
  qsort(sp, (size_t)n, sizeof(Span), span_order);
  uint64_t reach = 0, reach_w = 0;
  for (int64_t j = 0; j < n; j++) {
    const uint64_t w = sp[j].s2 & 1, s = sp[j].s2 - w;
    if (s < reach_w || (w && s < reach)) {
      for (int64_t i = 0; i < j; i++) {
        if (s < sp[i].e2 && (w || (sp[i].s2 & 1))) {
          const Span *x = &sp[j], *y = &sp[i];
          const int y_first = y->b < x->b || (y->b == x->b && y->col < x->col);
          if ((y_first && (y->s2 & 1)) || !(x->s2 & 1)) {
            const Span *t = x;
            x = y;
            y = t;
          }
          out[0] = x->b;
          out[1] = x->col;
          out[2] = y->b;
          out[3] = y->col;
          free(sp);
          return 1;
        }
      }
    }
    if (sp[j].e2 > reach) reach = sp[j].e2;
    if (w && sp[j].e2 > reach_w) reach_w = sp[j].e2;
  }
  free(sp);
  return 0;
}

/* The lanes of this build's explicit vector loops: 16 (the AVX-512 ones, HW_BF16), 8 (the AVX2 ones, which do
   not scale tiny quotients: see quot8), or 0 (the portable loops alone). */
int sofx_vector_width(void) {
#if defined(HW_BF16)
  return 16;
#elif defined(AVX2_LOOPS)
  return 8;
#else
  return 0;
#endif
}

/* The replicas of MKL's square root this build has, as a mask of their REPLICA_* kinds (AVX-512: its AVX-512,
   generic and AVX2 code paths; AVX2: the generic and AVX2 ones; both REPLICA_IEEE), else 0. */
int sofx_has_sqrt_replica(void) {
#if defined(HW_RSQRT14)
  return REPLICA_AVX512 | REPLICA_GENERIC | REPLICA_AVX2 | REPLICA_IEEE;
#elif defined(HW_RSQRT8)
  return REPLICA_GENERIC | REPLICA_AVX2 | REPLICA_IEEE;
#else
  return 0;
#endif
}

/* kind if it names a replica this build has, else 0 (no replica: the routine's calls). */
static int replica_kind(int kind) {
  return (kind == REPLICA_AVX512 || kind == REPLICA_GENERIC || kind == REPLICA_AVX2 || kind == REPLICA_IEEE) &&
                 (sofx_has_sqrt_replica() & kind)
             ? kind
             : 0;
}

/* out = the square roots of in[0..n) as the exact loops take them: sqrt_tile per TILE elements, with the
   given routine (see Sqrt; sqrt_fn 0: IEEE sqrtf) and replica kind (0: none). For the load-time check and tests. */
void sofx_sqrt(int64_t n, const float *in, float *out, void *sqrt_fn, int64_t sqrt_mode, int sqrt_replica) {
  Sqrt sq = {(vsqrt_fn)sqrt_fn, sqrt_mode, 0, replica_kind(sqrt_replica)};
  for (int64_t off = 0; off < n; off += TILE) {
    const int k = (int)((n - off) < TILE ? (n - off) : TILE);
    sqrt_tile(out + off, in + off, &sq, k);
  }
}

/* dst[0..n) = src[0..n) converted to dst's dtype, and the sum of squares of the values stored, in one pass
   over src: the offload engine's copy of a gradient into its block's buffer, whose sum of squares it needs
   next (clipping, the overflow check). Rows of 1024 elements are summed in float32 and the row sums in
   double, as sofx.transforms.sumsq does (relative error ~1e-7; not its bits: its rows are torch's
   reductions); a row whose float32 sum is not finite is summed again in double, so that the result is
   finite exactly when every element is. Streaming stores for a float32 destination where the CPU has
   AVX-512: the buffer's lines are not read before they are written (benchmarks/RESULTS.md "Gradient
   copies"). Returns the sum; -1 for a dtype it does not know (nothing written). */
#define SUMSQ_ROW 1024
double sofx_copy_sumsq(const void *src, int src_dt, void *dst, int dst_dt, int64_t n) {
  if (src_dt < DT_F32 || src_dt > DT_F16 || dst_dt < DT_F32 || dst_dt > DT_F16) return -1.0;
  if ((src_dt == DT_F16 || dst_dt == DT_F16) && !sofx_has_f16()) return -1.0;
  double total = 0.0;
  float T[SUMSQ_ROW];
  for (int64_t off = 0; off < n; off += SUMSQ_ROW) {
    const int k = (int)((n - off) < SUMSQ_ROW ? (n - off) : SUMSQ_ROW);
    load(T, src, src_dt, off, k);
    if (dst_dt == DT_BF16) round_bf16(T, k); /* the values stored */
#ifdef __FLT16_MAX__
    else if (dst_dt == DT_F16) for (int i = 0; i < k; i++) T[i] = (float)(_Float16)T[i];
#endif
    float acc[16] = {0};
    int i = 0;
    for (; i + 16 <= k; i += 16)
      for (int l = 0; l < 16; l++) acc[l] += T[i + l] * T[i + l];
    float row = 0.0f;
    for (int l = 0; l < 16; l++) row += acc[l];
    for (; i < k; i++) row += T[i] * T[i];
    if (row - row != 0.0f) { /* inf or nan: finite squares that overflowed float32, or a non-finite element */
      double d = 0.0;
      for (int j = 0; j < k; j++) d += (double)T[j] * (double)T[j];
      total += d;
    } else {
      total += (double)row;
    }
#if defined(__AVX512F__)
    if (dst_dt == DT_F32 && ((uintptr_t)((float *)dst + off) & 63) == 0 && k == SUMSQ_ROW) {
      for (int j = 0; j < k; j += 16) _mm512_stream_ps((float *)dst + off + j, _mm512_loadu_ps(T + j));
      continue;
    }
#endif
    store(dst, dst_dt, off, T, k);
  }
#if defined(__AVX512F__)
  _mm_sfence();
#endif
  return total;
}

/* One block of a call: its job (begin/end unset) and where its elements start among all the blocks'. */
typedef struct {
  const Job *jobs;
  const int64_t *starts;             /* starts[b]: the first element of block b in the blocks' concatenation */
  int64_t count, per;                /* blocks; elements per thread (the last thread takes the rest) */
} Parts;

/* Block b's local element where thread k's share of the concatenation begins: rounded up to a multiple of
   TILE (the exact loops' square-root chunks fall where a single thread would put them), of CHUNK where the
   block's chunks are checked (one thread per chunk), within [0, n]. */
static int64_t split_at(const Parts *ps, int64_t b, int64_t k) {
  int64_t local = k * ps->per - ps->starts[b];
  const int64_t n = ps->jobs[b].n;
  const int64_t align = ps->jobs[b].skip || ps->jobs[b].chunks ? CHUNK : TILE;
  if (local <= 0) return 0;
  local = (local + align - 1) / align * align;
  return local < n ? local : n;
}

/* Thread k's share: the part of every block between its splits k and k + 1, block after block. */
static void run_share(const Parts *ps, int64_t k) {
  for (int64_t b = 0; b < ps->count; b++) {
    Job part = ps->jobs[b];
    part.begin = split_at(ps, b, k);
    part.end = split_at(ps, b, k + 1);
    if (part.begin < part.end) run_range(&part);
  }
}

typedef struct {
  const Parts *ps;
  int64_t k;
} Share;

static void *run_share_thread(void *arg) {
  const Share *sh = (const Share *)arg;
  run_share(sh->ps, sh->k);
  return 0;
}

/* Shares 1..nt-1 on threads started for this call and joined before it returns (nothing runs on after it);
   share 0 on the calling thread. A thread that cannot be started has its share run here. */
static void run_on_started_threads(const Parts *ps, int nt) {
  pthread_t tids[MAX_THREADS];
  int started[MAX_THREADS];
  Share shares[MAX_THREADS];
  for (int k = 1; k < nt; k++) {
    shares[k].ps = ps;
    shares[k].k = k;
    started[k] = pthread_create(&tids[k], 0, run_share_thread, &shares[k]) == 0;
  }
  run_share(ps, 0);
  for (int k = 1; k < nt; k++) {
    if (started[k]) pthread_join(tids[k], 0);
    else run_share(ps, k);
  }
}

/* Entry point: `count` blocks in one call, each with its own dtypes, element count, pointers and
   scalars. Block b: dtypes[6b..6b+5] = {p, g, m/v, g_new, p_old, p_copy}; ptrs[11b..11b+10] = {p, g, m, v,
   g_new, p_old, p_out, m_out, v_out, p_copy, skip} (p_copy: 0, or a second buffer for the new parameters in
   its own dtype, see copy_params; skip: 0, or for a step or an undo+redo ceil(n / CHUNK) bytes of 0, see
   run_range); ns[b]
   its element count; s_old[b] (and s_new[b] for undo+redo) its S_COUNT
   scalars. exact: 1 for the reference's bits (the exact_* loops: sqrt_fn's square roots, true divisions
   in the inverse), 0 for the fused loops (IEEE sqrtf, div_by in the inverse).
   sqrt_fn/sqrt_mode/sqrt_local/sqrt_replica: see Sqrt (sqrt_fn 0: IEEE sqrtf).
   nthreads > 0: that many threads of the OpenMP runtime (in a build with OpenMP); nthreads < 0: -nthreads
   threads started for this call and joined before it returns (sofx.kernels.threads).
   The threads share the blocks' elements evenly (a model's many small tensors cost one parallel region,
   not one each); thread k runs its part of each block in turn, split inside a block at a multiple of
   TILE. chunk_tab: 0, or 6 entries per block, {chunks, count, packed, kp, km, kv}: chunks 0 for a block
   of its ns[b] elements, else a step or an undo+redo on `count` listed chunks of CHUNK elements of it (an
   int64 array of ascending chunk indices; see run_listed). Every block is checked first: returns 0 on
   success, or -(1 + 4b) - reason for block b's bad argument (reason 0: op or count, 1: a dtype, 2: float16
   without _Float16, 3: its chunk list), nothing written. */
int sofx_adam_many(int op, int decoupled, int64_t count, const int *dtypes, const int64_t *ns,
                   void *const *ptrs, const double *const *s_old, const double *const *s_new, int nthreads,
                   int exact, void *sqrt_fn, int64_t sqrt_mode, void *sqrt_local, int sqrt_replica,
                   const int64_t *chunk_tab) {
  if (op < OP_STEP || op > OP_UNDO_REDO || count < 0) return -1;
  for (int64_t b = 0; b < count; b++) {
    if (ns[b] < 0) return (int)(-(1 + 4 * b));
    for (int k = 0; k < 6; k++) {
      const int dt = dtypes[6 * b + k];
      if (dt < DT_F32 || dt > DT_F16) return (int)(-(1 + 4 * b) - 1);
      if (dt == DT_F16 && !sofx_has_f16()) return (int)(-(1 + 4 * b) - 2);
    }
    const int64_t *ct = chunk_tab ? chunk_tab + 6 * b : 0;
    if (ct && ct[0]) {
      const int64_t *list = (const int64_t *)(uintptr_t)ct[0], last = (ns[b] + CHUNK - 1) / CHUNK;
      if (op == OP_UNDO || ct[1] < 0) return (int)(-(1 + 4 * b) - 3);
      for (int64_t i = 0; i < ct[1]; i++)
        if (list[i] < 0 || list[i] >= last || (i > 0 && list[i] <= list[i - 1])) return (int)(-(1 + 4 * b) - 3);
    }
  }
  Job one;
  Job *jobs = count == 1 ? &one : (Job *)malloc((size_t)count * sizeof(Job));
  int64_t starts_one;
  int64_t *starts = count == 1 ? &starts_one : (int64_t *)malloc((size_t)count * sizeof(int64_t));
  if (!jobs || !starts) {
    if (jobs != &one) free(jobs);
    if (starts != &starts_one) free(starts);
    return -1000000000; /* out of memory: nothing written */
  }
  int64_t total = 0;
  for (int64_t b = 0; b < count; b++) {
    const int *dt = dtypes + 6 * b;
    void *const *pt = ptrs + 11 * b;
    Job *job = &jobs[b];
    memset(job, 0, sizeof *job);
    job->op = op;
    job->decoupled = decoupled;
    job->dp = dt[0]; job->dg = dt[1]; job->ds = dt[2]; job->dg2 = dt[3]; job->dpo = dt[4];
    job->n = ns[b];
    job->p = pt[0]; job->g = pt[1]; job->m = pt[2]; job->v = pt[3]; job->g2 = pt[4]; job->pold = pt[5];
    job->po = pt[6]; job->mo = pt[7]; job->vo = pt[8];
    job->pc = pt[9]; job->dpc = dt[5];
    job->skip = op != OP_UNDO ? (uint8_t *)pt[10] : 0;
    job->sq.fn = (vsqrt_fn)sqrt_fn;
    job->sq.mode = sqrt_mode;
    job->sq.local = (local_threads_fn)sqrt_local;
    job->sq.replica = replica_kind(sqrt_replica);
    job->exact = exact != 0;
    job->s1 = make_sc(s_old[b]);
    if (op == OP_UNDO_REDO) job->s2 = make_sc(s_new[b]);
    const int64_t *ct = chunk_tab ? chunk_tab + 6 * b : 0;
    if (ct && ct[0]) {
      job->chunks = (const int64_t *)(uintptr_t)ct[0];
      job->leaf_n = ns[b];
      job->n = ct[1] ? (ct[1] - 1) * CHUNK + (ns[b] - job->chunks[ct[1] - 1] * CHUNK < CHUNK
                                               ? ns[b] - job->chunks[ct[1] - 1] * CHUNK : CHUNK) : 0;
      job->packed = ct[2] != 0;
      job->kp = (void *)(uintptr_t)ct[3];
      job->km = (void *)(uintptr_t)ct[4];
      job->kv = (void *)(uintptr_t)ct[5];
    }
    starts[b] = total;
    total += job->n;
  }
  const int started_threads = nthreads < 0;
  int nt = started_threads ? -nthreads : nthreads;
  if (nt < 1) nt = 1;
  if (nt > MAX_THREADS) nt = MAX_THREADS;
  if (total / MIN_PER_THREAD < nt) nt = (int)(total / MIN_PER_THREAD);
  if (nt < 1) nt = 1;
  Parts ps = {jobs, starts, count, (total + nt - 1) / nt};
  if (nt == 1) {
    run_share(&ps, 0);
#ifdef _OPENMP
  } else if (!started_threads) {
    /* torch's own OpenMP runtime (libgomp.so.1 is already loaded by torch, so this library binds
       to it): the threads of torch's last parallel region are still spinning for work and take
       these shares at once. Threads of a second runtime (or pthreads) would fight them for the
       cores for milliseconds after every torch operation; but the runtime's threads spin on after
       this region too, which a caller that wants the cores back at once avoids with nthreads < 0. */
#pragma omp parallel for num_threads(nt) schedule(static, 1)
    for (int k = 0; k < nt; k++) run_share(&ps, k);
#endif
  } else {
    run_on_started_threads(&ps, nt);
  }
  if (jobs != &one) free(jobs);
  if (starts != &starts_one) free(starts);
  return 0;
}
""".replace("@FINITE_CHUNK@", str(FINITE_CHUNK))
assert FINITE_CHUNK % 1024 == 0  # XTILE (see CHUNK in SOURCE)

# Keep in sync with the enum in SOURCE.
(S_GRAD_SCALE, S_DECAY_FACTOR, S_WD, S_ONE_MINUS_B1, S_B1, S_B2, S_ONE_MINUS_B2,
 S_BC2_SQRT, S_EPS, S_STEP_SIZE, S_HAS_GRAD_SCALE, S_HAS_DECAY, S_LIMIT_F32, S_LIMIT_BF16, S_LIMIT_F16,
 S_LOSSY, S_L2_CV, S_L2_CM, S_L2_WA, S_L2_WB, S_L2_WKA, S_L2_WKB, S_P_KEPT, S_COUNT) = range(24)
OP_STEP, OP_UNDO, OP_UNDO_REDO = 0, 1, 2
DT_F32, DT_BF16, DT_F16 = 0, 1, 2
