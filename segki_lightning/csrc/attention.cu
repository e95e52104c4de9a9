// Decode attention (flash-decoding): one query token per row against a KV cache with per-row valid
// lengths read on the device. Pass 1 splits each row's valid prefix [0, len) evenly over a fixed number of
// blocks per KV head (so the grid is static for graph capture, and time follows len, not the cache size);
// each block serves all G query heads of its KV head and keeps an online softmax. Pass 2 merges the splits
// and applies Qwen3.5's sigmoid output gate when one is given.
//
// The prologue kernel does what the model's attention code does between the projections and attention for
// one new token: per-head q/k RMSNorm, rotary embedding on the first R features, key and value written into
// the cache at the row's position -- one launch instead of ~20 small torch kernels per layer and step.
//
// decode_attention_step runs both for one decode step. Where rows x KV heads are few and the cache short, it is
// one launch (attn_step_kernel): each cluster of blocks serves one (row, KV head), every block runs the prologue
// of its heads, attends over its split and the cluster merges the splits through distributed shared memory --
// the arithmetic of the three kernels with the cluster's blocks as the splits. Elsewhere it launches the three.
#include <cooperative_groups.h>

#include "common.cuh"
#include "timeline.cuh"

namespace segki {
namespace {

namespace cg = cooperative_groups;

constexpr int kWarps = 4;
constexpr int kPos = 4;  // positions whose K and V rows a warp loads before using them

// E consecutive half values of a row (E = D / 32 per lane), kept packed until used.
template <typename T, int E>
__device__ __forceinline__ uint4 load_raw(const T* p) {
  if constexpr (E == 8) {
    return ld_cached(p);
  } else if constexpr (E == 4) {
    const uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
    return make_uint4(u.x, u.y, 0, 0);
  } else {
    return make_uint4(__ldg(reinterpret_cast<const unsigned int*>(p)), 0, 0, 0);
  }
}

template <typename T, int E>
__device__ __forceinline__ void unpack_raw(const uint4& r, float f[E]) {
  const T* h = reinterpret_cast<const T*>(&r);
#pragma unroll
  for (int i = 0; i < E; ++i) f[i] = to_float<T>(h[i]);
}

template <typename T, int E>
__device__ __forceinline__ void load_row(const T* p, float f[E]) {
  unpack_raw<T, E>(load_raw<T, E>(p), f);
}

// One round of the batched variant (SEGKI_ATTN=batched): the scores of KP positions for all heads are
// reduced together (independent shuffles) and folded into the online softmax with one rescale per head.
// Heads >= g have zero queries: their scores are 0 and their accumulators are never stored.
template <typename T, int E, int MAXG, int KP>
__device__ __forceinline__ void attn_round_batched(const T* kc, const T* vc, size_t base, int p0, int w1, int g,
                                                   const float qf[MAXG][E], float acc[MAXG][E], float m[MAXG],
                                                   float l[MAXG]) {
  constexpr int D = E * 32;
  uint4 kr[KP], vr[KP];
#pragma unroll
  for (int i = 0; i < KP; ++i) {
    const bool in = p0 + i < w1;
    kr[i] = in ? load_raw<T, E>(kc + base + (size_t)(p0 + i) * D) : make_uint4(0, 0, 0, 0);
    vr[i] = in ? load_raw<T, E>(vc + base + (size_t)(p0 + i) * D) : make_uint4(0, 0, 0, 0);
  }
  float p[MAXG][KP];
#pragma unroll
  for (int i = 0; i < KP; ++i) {
    float kf[E];
    unpack_raw<T, E>(kr[i], kf);
#pragma unroll
    for (int h = 0; h < MAXG; ++h) {
      float sc = 0.f;
#pragma unroll
      for (int e = 0; e < E; ++e) sc = fmaf(qf[h][e], kf[e], sc);
      p[h][i] = sc;
    }
  }
#pragma unroll
  for (int h = 0; h < MAXG; ++h)
#pragma unroll
    for (int i = 0; i < KP; ++i) p[h][i] = warp_sum(p[h][i]);
#pragma unroll
  for (int h = 0; h < MAXG; ++h) {
    if (h >= g) break;
    float mx = m[h];
#pragma unroll
    for (int i = 0; i < KP; ++i) mx = p0 + i < w1 ? fmaxf(mx, p[h][i]) : mx;
    const float corr = __expf(m[h] - mx);
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < KP; ++i) {
      p[h][i] = p0 + i < w1 ? __expf(p[h][i] - mx) : 0.f;
      sum += p[h][i];
    }
    l[h] = l[h] * corr + sum;
    m[h] = mx;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[h][e] *= corr;
  }
#pragma unroll
  for (int i = 0; i < KP; ++i) {
    float vf[E];
    unpack_raw<T, E>(vr[i], vf);
#pragma unroll
    for (int h = 0; h < MAXG; ++h)
#pragma unroll
      for (int e = 0; e < E; ++e) acc[h][e] = fmaf(p[h][i], vf[e], acc[h][e]);
  }
}

// Positions [lo, hi) of a valid prefix: split `split` of `splits` (equal ceil-sized chunks of [0, len)), and warp
// `warp`'s share of a split (equal ceil-sized parts over `warps`). The partial and the step kernel split alike.
struct Range {
  int lo, hi;
};

__device__ __forceinline__ Range split_range(int len, int split, int splits) {
  const int chunk = (len + splits - 1) / splits;
  const int lo = min(len, split * chunk);
  return {lo, min(len, lo + chunk)};
}

__device__ __forceinline__ Range warp_range(Range r, int warp, int warps) {
  const int per_warp = (r.hi - r.lo + warps - 1) / warps;
  const int lo = min(r.hi, r.lo + warp * per_warp);
  return {lo, min(r.hi, lo + per_warp)};
}

// An empty online softmax per head: no maximum, nothing summed.
template <int MAXG, int E>
__device__ __forceinline__ void softmax_start(float (&acc)[MAXG][E], float (&m)[MAXG], float (&l)[MAXG]) {
#pragma unroll
  for (int h = 0; h < MAXG; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[h][e] = 0.f;
  }
}

// The warp's positions [w0, w1) one at a time into its online softmax (acc, m, l of each of the g heads):
// scores q . k, then the rescaled sums of v. FRESH: position `fresh` takes its key and value rows from shared
// memory (fresh_k, fresh_v [D], as floats) instead of the cache -- the token this launch writes there.
template <typename T, int E, int MAXG, bool FRESH = false>
__device__ __forceinline__ void attend_online(const T* kc, const T* vc, size_t base, int w0, int w1, int g,
                                              const float (&qf)[MAXG][E], float (&acc)[MAXG][E], float (&m)[MAXG],
                                              float (&l)[MAXG], int64_t fresh = -1, const float* fresh_k = nullptr,
                                              const float* fresh_v = nullptr) {
  constexpr int D = E * 32;
  const int lane = threadIdx.x & 31;
  for (int p0 = w0; p0 < w1; p0 += kPos) {
    float kf[kPos][E], vf[kPos][E];
#pragma unroll
    for (int i = 0; i < kPos; ++i)
      if (p0 + i < w1) {
        if (FRESH && p0 + i == fresh) {
#pragma unroll
          for (int e = 0; e < E; ++e) {
            kf[i][e] = fresh_k[lane * E + e];
            vf[i][e] = fresh_v[lane * E + e];
          }
        } else {
          load_row<T, E>(kc + base + (size_t)(p0 + i) * D, kf[i]);
          load_row<T, E>(vc + base + (size_t)(p0 + i) * D, vf[i]);
        }
      }
#pragma unroll
    for (int i = 0; i < kPos; ++i) {
      if (p0 + i >= w1) break;
#pragma unroll
      for (int h = 0; h < MAXG; ++h) {
        if (h >= g) break;
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) s = fmaf(qf[h][e], kf[i][e], s);
        s = warp_sum(s);
        const float m_new = fmaxf(m[h], s);
        const float corr = __expf(m[h] - m_new), p = __expf(s - m_new);
        l[h] = l[h] * corr + p;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[h][e] = fmaf(p, vf[i][e], acc[h][e] * corr);
        m[h] = m_new;
      }
    }
  }
}

// A block's WARPS warps' softmax partials in shared memory, merged per (head, feature) into the block's split.
template <int WARPS, int MAXG, int D>
struct WarpParts {
  float acc[WARPS][MAXG][D];
  float m[WARPS][MAXG], l[WARPS][MAXG];

  template <int E>
  __device__ __forceinline__ void put(const float (&a)[MAXG][E], const float (&mx)[MAXG], const float (&sum)[MAXG],
                                      int g) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int h = 0; h < MAXG; ++h) {
      if (h >= g) break;
#pragma unroll
      for (int e = 0; e < E; ++e) acc[warp][h][lane * E + e] = a[h][e];
      if (lane == 0) {
        m[warp][h] = mx[h];
        l[warp][h] = sum[h];
      }
    }
  }
  // (max, sum, acc) of head h's feature d over the warps, in warp order
  __device__ __forceinline__ float3 merged(int h, int d) const {
    float mm = -INFINITY;
    for (int w = 0; w < WARPS; ++w) mm = fmaxf(mm, m[w][h]);
    float ll = 0.f, aa = 0.f;
    if (mm > -INFINITY)
      for (int w = 0; w < WARPS; ++w) {
        const float c = __expf(m[w][h] - mm);
        ll += l[w][h] * c;
        aa += acc[w][h][d] * c;
      }
    return make_float3(mm, ll, aa);
  }
};

// grid (splits, Hkv, B); partial results [B, Hq, splits, D] (+ max and sum [B, Hq, splits]).
template <typename T, int D, int MAXG, bool BATCHED>
__global__ void __launch_bounds__(kWarps * 32) attn_partial_kernel(
    const T* __restrict__ q, const T* __restrict__ kc, const T* __restrict__ vc, const int* __restrict__ lengths,
    float* __restrict__ part_acc, float* __restrict__ part_m, float* __restrict__ part_l, int hq, int hkv, int s_max,
    int g, float scale) {
  pdl_start();  // everything below reads what earlier kernels wrote
  constexpr int E = D / 32;
  const int split = blockIdx.x, splits = gridDim.x, kvh = blockIdx.y, b = blockIdx.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const Range pos = warp_range(split_range(min(lengths[b], s_max), split, splits), warp, kWarps);
  const int w0 = pos.lo, w1 = pos.hi;

  float qf[MAXG][E], acc[MAXG][E], m[MAXG], l[MAXG];
  softmax_start(acc, m, l);
#pragma unroll
  for (int h = 0; h < MAXG; ++h) {
#pragma unroll
    for (int e = 0; e < E; ++e) qf[h][e] = 0.f;
    if (h < g) {
      load_row<T, E>(q + ((size_t)b * hq + kvh * g + h) * D + lane * E, qf[h]);
#pragma unroll
      for (int e = 0; e < E; ++e) qf[h][e] *= scale;
    }
  }
  const size_t base = ((size_t)b * hkv + kvh) * s_max * D + lane * E;
  if constexpr (BATCHED) {
    constexpr int KP = MAXG * E <= 16 ? 8 : 4;  // positions per round, as registers allow
    for (int p0 = w0; p0 < w1; p0 += KP) attn_round_batched<T, E, MAXG, KP>(kc, vc, base, p0, w1, g, qf, acc, m, l);
  } else {
    attend_online<T, E, MAXG>(kc, vc, base, w0, w1, g, qf, acc, m, l);
  }
  __shared__ WarpParts<kWarps, MAXG, D> parts;
  parts.put(acc, m, l, g);
  __syncthreads();
  for (int idx = threadIdx.x; idx < g * D; idx += blockDim.x) {
    const int h = idx / D, d = idx % D;
    const float3 r = parts.merged(h, d);
    const size_t o = ((size_t)b * hq + kvh * g + h) * splits + split;
    part_acc[o * D + d] = r.z;
    if (d == 0) {
      part_m[o] = r.x;
      part_l[o] = r.y;
    }
  }
}

// grid (Hq, B), D threads: out = sum_s acc_s e^{m_s - M} / sum_s l_s e^{m_s - M}, times sigmoid(gate) when
// a gate [B, Hq, D] (strides gate_sb, gate_sh; last dim contiguous) is given, with the roundings of the
// unfused model (attention output and sigmoid each rounded to T, then their product).
// The splits' maxima and sums are read in one parallel round into shared memory, and each thread's partial
// values are requested kSplitGroup splits at a time: a loop that read part_m, then branched, then read part_l
// and part_acc, split after split, cost ~0.16 us per split (kernels.py: ~21 us at 132 splits whatever the valid
// length). An unrolled loop over the splits was not enough: ptxas kept only 2-4 of its loads in flight (13 us
// left at 132 splits, `results/bulk_grid/combine/`, in a grid of only Hq x B blocks), so each group's values are
// loaded into an array first. The sums run in split order as before: the same bits.
constexpr int kMaxSplits = 256;
constexpr int kSplitGroup = 16;

template <typename T, int D>
__global__ void attn_combine_kernel(const float* __restrict__ part_acc, const float* __restrict__ part_m,
                                    const float* __restrict__ part_l, T* __restrict__ out, int hq, int splits,
                                    const T* __restrict__ gate, int64_t gate_sb, int64_t gate_sh) {
  __shared__ float sm_m[kMaxSplits], sm_l[kMaxSplits], scratch[32];
  pdl_start();  // everything below reads what earlier kernels wrote
  const int h = blockIdx.x, b = blockIdx.y, d = threadIdx.x;
  const size_t o = ((size_t)b * hq + h) * splits;
  float mm = -INFINITY;
  for (int s = d; s < splits; s += D) {
    sm_m[s] = part_m[o + s];
    sm_l[s] = part_l[o + s];
    mm = fmaxf(mm, sm_m[s]);
  }
  mm = block_max(mm, scratch);  // its barriers also publish sm_m and sm_l
  float ll = 0.f, aa = 0.f;
  for (int s0 = 0; s0 < splits; s0 += kSplitGroup) {
    float part[kSplitGroup];  // all requested before the first is used
#pragma unroll
    for (int i = 0; i < kSplitGroup; ++i)  // allocated for every split; used only where it was written
      part[i] = s0 + i < splits ? part_acc[(o + s0 + i) * D + d] : 0.f;
#pragma unroll
    for (int i = 0; i < kSplitGroup; ++i) {
      const int s = s0 + i;
      if (s >= splits) break;
      const float ms = sm_m[s];
      if (ms == -INFINITY) continue;
      const float c = __expf(ms - mm);
      ll += sm_l[s] * c;
      aa += part[i] * c;
    }
  }
  float y = aa / ll;
  if (gate != nullptr) {
    const float g = to_float<T>(gate[b * gate_sb + h * gate_sh + d]);
    y = round_to<T>(y) * round_to<T>(sigmoid(g));
  }
  out[((size_t)b * hq + h) * D + d] = from_float<T>(y);
}

// ---- prologue. One warp per (row, head): heads [0, Hq) are queries, [Hq, Hq + Hkv) keys (whose warp also
// copies the value row into the cache). Lane l holds features [l*E, (l+1)*E); RoPE's partner feature comes
// through shared memory. Roundings follow the unfused model: norm output rounded to T, then each RoPE
// product and their sum. The rows of q, k and v lie q_ld / k_ld / v_ld elements apart (column slices of one
// product over packed q|k|v weights, or contiguous).

// One warp's prologue of one head: lane l's features [l*E, (l+1)*E) of `src` through the per-head RMSNorm (when
// w is given; fp32 statistics) and the rotate-half RoPE on features [0, r) (cos, sin: the row's tables), into f.
// Every read is requested up front: the norm weight and the rotary tables do not wait for the statistics or the
// shared-memory exchange (a chain of round trips before, in the SASS). feat [D]: the warp's scratch.
template <typename T, int D>
__device__ __forceinline__ void head_prologue(const T* src, const T* w, const T* cos, const T* sin, int r, float eps,
                                              bool unit_offset, float* feat, float (&f)[D / 32]) {
  constexpr int E = D / 32;
  const int lane = threadIdx.x & 31;
  float wf[E] = {}, c[E] = {}, sn[E] = {};
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int i = lane * E + e;
    f[e] = to_float<T>(src[i]);
    if (w != nullptr) wf[e] = to_float<T>(w[i]);
    if (i < r) {
      c[e] = to_float<T>(cos[i]);
      sn[e] = to_float<T>(sin[i]);
    }
  }
  if (w != nullptr) {
    float ss = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) ss += f[e] * f[e];
    const float inv = rsqrtf(warp_sum(ss) / D + eps);
#pragma unroll
    for (int e = 0; e < E; ++e)
      f[e] = unit_offset ? round_to<T>(f[e] * inv * (1.f + wf[e])) : round_to<T>(wf[e] * round_to<T>(f[e] * inv));
  }
  __syncwarp();  // the warp's previous head has read its partners
#pragma unroll
  for (int e = 0; e < E; ++e) feat[lane * E + e] = f[e];
  __syncwarp();
  const int half = r / 2;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int i = lane * E + e;
    if (i < r) {
      const float other = i < half ? -feat[i + half] : feat[i - half];
      f[e] = round_to<T>(round_to<T>(__fmul_rn(f[e], c[e])) + round_to<T>(__fmul_rn(other, sn[e])));
    }
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kWarps * 32) attn_prologue_kernel(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ cos,
    const T* __restrict__ sin, const T* __restrict__ q_w, const T* __restrict__ k_w, T* __restrict__ kc,
    T* __restrict__ vc, const int64_t* __restrict__ positions, T* __restrict__ query, int bsz, int hq, int hkv,
    int s_max, int r, int q_head_stride, int64_t q_ld, int64_t k_ld, int64_t v_ld, float eps, bool unit_offset) {
  pdl_start();  // everything below reads what earlier kernels wrote
  constexpr int E = D / 32;
  __shared__ float feat[kWarps][D];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int heads = hq + hkv, item = blockIdx.x * kWarps + warp;
  if (item >= bsz * heads) return;  // whole warps only: no block-wide barrier below
  const int b = item / heads, h = item % heads;
  const bool is_q = h < hq;
  const int kvh = h - hq;
  const T* src = is_q ? q + (size_t)b * q_ld + (size_t)h * q_head_stride : k + (size_t)b * k_ld + (size_t)kvh * D;
  const T* vr = is_q ? nullptr : v + (size_t)b * v_ld + (size_t)kvh * D;  // a key head's value row
  // The value row is only pulled into L1 here: held in registers it spilled (fp16, D=256).
  if (!is_q) asm volatile("prefetch.global.L1 [%0];" ::"l"(vr + lane * E));
  const int64_t pos = is_q ? 0 : positions[b];
  float f[E];
  head_prologue<T, D>(src, is_q ? q_w : k_w, cos + (size_t)b * r, sin + (size_t)b * r, r, eps, unit_offset,
                      feat[warp], f);
  if (is_q) {
#pragma unroll
    for (int e = 0; e < E; ++e) query[((size_t)b * hq + h) * D + lane * E + e] = from_float<T>(f[e]);
    return;
  }
  if (pos < 0 || pos >= s_max) return;  // the caller keeps positions inside the cache
  T vv[E];  // L1 hits, all requested before the first store
#pragma unroll
  for (int e = 0; e < E; ++e) vv[e] = vr[lane * E + e];
  const size_t dst = (((size_t)b * hkv + kvh) * s_max + pos) * D;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    kc[dst + lane * E + e] = from_float<T>(f[e]);
    vc[dst + lane * E + e] = vv[e];
  }
}

// ---- the step in one launch. The arguments of attn_step_kernel: those of the prologue and of the attention.
constexpr int kStepMaxSplits = 16;  // blocks per cluster where the device takes 16 (max_cluster_blocks)
template <typename T>
struct StepArgs {
  const T *q, *k, *v, *cos, *sin, *q_w, *k_w;  // q_w / k_w: nullptr without q/k norms
  T *kc, *vc, *out;                             // caches [B, Hkv, S, D]; out [B, Hq, D]
  const int64_t* positions;                     // [B]: where row b's new key and value go
  const int* lengths;                           // [B]: positions attended, the new one included
  int hq, hkv, s_max, r, qw;                    // qw: a query head's columns in q (2D when gated)
  int64_t q_ld, k_ld, v_ld;
  float eps, scale;
  bool unit_offset, gated;
  unsigned long long* stamps;  // the timeline's buffer (the STAMP instantiation), and this launch's id there
  int launch_id;
};

// grid (S, Hkv, B) in clusters of S blocks (the splits of one row's KV head), WARPS warps each. A block runs the
// prologue of the G query heads of its KV head and of the head's new key (the prologue kernel's arithmetic; block 0
// writes the key and value into the cache), attends over its split of [0, len) as the partial kernel does -- the
// new position from shared memory, never from the cache row this launch writes -- and keeps its merged partials in
// shared memory. Block `rank` then combines every S-th of the G x D outputs over the cluster's blocks, in split
// order (the combine kernel's arithmetic), and applies the output gate. STAMP: the timeline's instantiation
// (timeline.cuh; thread 0 of each block writes its record).
template <typename T, int D, int MAXG, int WARPS, bool STAMP>
__global__ void __launch_bounds__(WARPS * 32) attn_step_kernel(const StepArgs<T> a) {
  Stamps st{};
  mark_start<STAMP>(st);
  constexpr int E = D / 32;
  __shared__ float feat[WARPS][D], sq[MAXG][D], fresh_k[D], fresh_v[D], res_m[MAXG], res_l[MAXG];
  __shared__ WarpParts<WARPS, MAXG, D> parts;  // parts.acc[0] becomes the block's merged split
  const int split = blockIdx.x, splits = gridDim.x, kvh = blockIdx.y, b = blockIdx.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = a.hq / a.hkv;
  const size_t base = ((size_t)b * a.hkv + kvh) * a.s_max * D;
  {  // before the wait: the split's cache rows into L2, by the length as it reads now (a hint: a stale length
     // warms other rows; the rows attended follow the length read after the wait)
    const Range r = split_range(min(max(a.lengths[b], 0), a.s_max), split, splits);
    constexpr int kLines = D * (int)sizeof(T) / 128;  // 128-byte lines per row
    for (int i = threadIdx.x; i < (r.hi - r.lo) * kLines * 2; i += blockDim.x) {
      const int row = r.lo + i / (2 * kLines), line = i % (2 * kLines);
      const T* cache = line < kLines ? a.kc : a.vc;
      prefetch_l2(cache + base + (size_t)row * D + (line % kLines) * (128 / sizeof(T)));
    }
  }
  pdl_launch_dependents();
  pdl_wait();  // everything below reads what earlier kernels wrote
  mark<STAMP>(st, kWaited);
  const int len = min(a.lengths[b], a.s_max);
  const int64_t pos = a.positions[b];
  // the prologue: items [0, g) the query heads, item g the key head and its value row
  for (int item = warp; item <= g; item += WARPS) {
    const bool is_q = item < g;
    const T* src = is_q ? a.q + (size_t)b * a.q_ld + (size_t)(kvh * g + item) * a.qw
                        : a.k + (size_t)b * a.k_ld + (size_t)kvh * D;
    T vv[E];  // a key head's value row, requested with its key (not a round trip after the norm and RoPE)
    if (!is_q) {
      const T* vr = a.v + (size_t)b * a.v_ld + (size_t)kvh * D;
#pragma unroll
      for (int e = 0; e < E; ++e) vv[e] = vr[lane * E + e];
    }
    float f[E];
    head_prologue<T, D>(src, is_q ? a.q_w : a.k_w, a.cos + (size_t)b * a.r, a.sin + (size_t)b * a.r, a.r, a.eps,
                        a.unit_offset, feat[warp], f);
    if (is_q) {
#pragma unroll
      for (int e = 0; e < E; ++e) sq[item][lane * E + e] = f[e] * a.scale;  // the stored query, scaled
      continue;
    }
#pragma unroll
    for (int e = 0; e < E; ++e) {  // f is rounded to T: the cache's values exactly
      fresh_k[lane * E + e] = f[e];
      fresh_v[lane * E + e] = to_float<T>(vv[e]);
    }
    if (split == 0 && pos >= 0 && pos < a.s_max) {
      const size_t dst = base + (size_t)pos * D + lane * E;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        a.kc[dst + e] = from_float<T>(f[e]);
        a.vc[dst + e] = vv[e];
      }
    }
  }
  __syncthreads();
  mark<STAMP>(st, kLoaded);
  // the split, as the partial kernel attends over it
  const Range mine = split_range(len, split, splits), own = warp_range(mine, warp, WARPS);
  float qf[MAXG][E], acc[MAXG][E], m[MAXG], l[MAXG];
  softmax_start(acc, m, l);
#pragma unroll
  for (int h = 0; h < MAXG; ++h)
#pragma unroll
    for (int e = 0; e < E; ++e) qf[h][e] = h < g ? sq[h][lane * E + e] : 0.f;
  attend_online<T, E, MAXG, true>(a.kc, a.vc, base + lane * E, own.lo, own.hi, g, qf, acc, m, l, pos, fresh_k,
                                  fresh_v);
  parts.put(acc, m, l, g);
  __syncthreads();
  mark<STAMP>(st, kReduced);
  for (int idx = threadIdx.x; idx < g * D; idx += blockDim.x) {  // each thread rewrites only what it read
    const int h = idx / D, d = idx % D;
    const float3 r = parts.merged(h, d);
    parts.acc[0][h][d] = r.z;
    if (d == 0) {
      res_m[h] = r.x;
      res_l[h] = r.y;
    }
  }
  // the combine over the cluster's splits: each thread requests every split's m, l and partial value at once, not
  // in turn (with the value row read beside its key above: 0.8B decode b=1 +1.0 %, 4B +0.5 %, results/next_l2/)
  mark<STAMP>(st, kStaged);
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every block's split is in its shared memory
  mark<STAMP>(st, kFirst);
  const int rank = (int)cluster.block_rank();
  for (int idx = rank * blockDim.x + threadIdx.x; idx < g * D; idx += splits * blockDim.x) {
    const int h = idx / D, d = idx % D;
    float ms[kStepMaxSplits], ls[kStepMaxSplits], ps[kStepMaxSplits];  // every split's, requested at once
#pragma unroll
    for (int s = 0; s < kStepMaxSplits; ++s) {
      if (s < splits) {
        ms[s] = *cluster.map_shared_rank(&res_m[h], s);
        ls[s] = *cluster.map_shared_rank(&res_l[h], s);
        ps[s] = *cluster.map_shared_rank(&parts.acc[0][h][d], s);
      }
    }
    float mm = -INFINITY;
#pragma unroll
    for (int s = 0; s < kStepMaxSplits; ++s)
      if (s < splits) mm = fmaxf(mm, ms[s]);
    float ll = 0.f, aa = 0.f;
#pragma unroll
    for (int s = 0; s < kStepMaxSplits; ++s) {
      if (s >= splits || ms[s] == -INFINITY) continue;
      const float c = __expf(ms[s] - mm);
      ll += ls[s] * c;
      aa += ps[s] * c;
    }
    const int hg = kvh * g + h;
    float y = aa / ll;
    if (a.gated) {
      const float gt = to_float<T>(a.q[(size_t)b * a.q_ld + (size_t)hg * a.qw + D + d]);
      y = round_to<T>(y) * round_to<T>(sigmoid(gt));
    }
    a.out[((size_t)b * a.hq + hg) * D + d] = from_float<T>(y);
  }
  mark<STAMP>(st, kLast);
  cluster.sync();  // no block leaves while another reads its shared memory
  if constexpr (STAMP) {
    if (threadIdx.x == 0) write_stamps(a.stamps, a.launch_id, st, mine.hi - mine.lo);
  }
}

// The batched-softmax partial kernel (with twice the splits) once rows x KV heads reach 64, the per-position
// online softmax below. Measured on the H200 (`benchmarks/results/attn_rows/`, 128-384 valid positions):
// 0.8B at 32 rows (64 row-heads) 12.4 -> 11.4 us at 128 valid and 23.6 -> 17.1 at 384, decode 1.637 -> 1.613
// ms a step; 4B at 16 rows (64) 12.2 -> 11.2 and 23.4 -> 17.0; but 0.8B at 16 rows (32) 9.7 -> 11.4 at 128
// valid, and at one row online wins below ~8k valid. SEGKI_ATTN=online / batched forces one variant (read on every
// call, so one process can compare both).
constexpr int kBatchedRowHeads = 64;
inline bool batched_attention(int row_heads) {
  if (env_is("SEGKI_ATTN", "batched")) return true;
  if (env_is("SEGKI_ATTN", "online")) return false;
  return row_heads >= kBatchedRowHeads;
}

// Splits of each (row, KV head)'s positions: enough for `per_sm` blocks per SM (the batched kernel 4, the online one
// 2), but never past one wave of the kernel's resident blocks (`wave`): a block past it runs after one of the first
// wave has ended, doubling the launch's time for a few blocks (the 4B at 16 rows: 9 splits made 576 blocks of the
// batched kernel against 528 resident). At least one, at most kMaxSplits, and one per 16 cache positions.
int attention_splits(int per_sm, int sms, int wave, int row_heads, int s_max) {
  const int aim = (per_sm * sms + row_heads - 1) / row_heads;
  return std::max(1, std::min({aim, wave / row_heads, kMaxSplits, (s_max + 15) / 16}));
}

// Run `f(D, MAXG)` (integral constants) for head dimension d and a kernel instantiated for up to MAXG query heads
// per KV head that covers g (1, 2, 4 or 8).
template <typename F>
void with_group_size(int d, int g, F&& f) {
  auto by_g = [&](auto d_const) {
    if (g == 1) f(d_const, std::integral_constant<int, 1>{});
    else if (g == 2) f(d_const, std::integral_constant<int, 2>{});
    else if (g <= 4) f(d_const, std::integral_constant<int, 4>{});
    else f(d_const, std::integral_constant<int, 8>{});
  };
  with_head_dim(d, by_g);
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                            const at::Tensor& lengths, double scale, const c10::optional<at::Tensor>& gate) {
  const char* op = "segki::decode_attention";
  check_cuda_half(q, op, "q", q.scalar_type());
  check_cuda_half(kc, op, "k_cache", q.scalar_type());
  check_cuda_half(vc, op, "v_cache", q.scalar_type());
  TORCH_CHECK(q.dim() == 3 && kc.dim() == 4 && kc.sizes() == vc.sizes(), op,
              ": expected q [B, Hq, D] and caches [B, Hkv, S, D], got ", q.sizes(), " and ", kc.sizes());
  const int bsz = (int)q.size(0), hq = (int)q.size(1), d = (int)q.size(2);
  const int hkv = (int)kc.size(1), s_max = (int)kc.size(2);
  TORCH_CHECK(kc.size(0) == bsz && kc.size(3) == d && hq % hkv == 0, op, ": q ", q.sizes(), " and cache ",
              kc.sizes(), " do not match (GQA needs Hq % Hkv == 0)");
  const int g = hq / hkv;
  TORCH_CHECK(g <= 8, op, ": at most 8 query heads per KV head, got ", g);
  TORCH_CHECK(d == 64 || d == 128 || d == 256, op, ": head_dim must be 64, 128 or 256, got ", d);
  TORCH_CHECK(lengths.is_cuda() && lengths.dim() == 1 && lengths.size(0) == bsz &&
                  (lengths.scalar_type() == at::kInt || lengths.scalar_type() == at::kLong),
              op, ": lengths must be a CUDA int32/int64 tensor [B]");
  if (gate.has_value()) {
    TORCH_CHECK(gate->is_cuda() && gate->scalar_type() == q.scalar_type() && gate->sizes() == q.sizes() &&
                    gate->stride(2) == 1,
                op, ": gate must be a CUDA ", q.scalar_type(), " tensor ", q.sizes(),
                " whose last dimension is contiguous, got ", gate->sizes(), " with strides ", gate->strides());
  }
  auto out = at::empty_like(q);
  if (bsz == 0) return out;
  c10::cuda::CUDAGuard guard(q.device());
  const int sms = sm_count();
  const bool batched = batched_attention(bsz * hkv);
  auto fopt = q.options().dtype(at::kFloat);
  auto stream = at::cuda::getCurrentCUDAStream();
  auto lens = lengths.to(at::kInt).contiguous();
  SEGKI_DISPATCH_HALF(q.scalar_type(), op, [&] {
    auto run = [&](auto d_const, auto g_const) {
      constexpr int DD = decltype(d_const)::value, GG = decltype(g_const)::value;
      constexpr auto online_kernel = attn_partial_kernel<T, DD, GG, false>;
      constexpr auto batched_kernel = attn_partial_kernel<T, DD, GG, true>;
      const auto partial = batched ? batched_kernel : online_kernel;
      const int wave = batched ? first_wave_blocks<batched_kernel>(kWarps * 32, 0)
                               : first_wave_blocks<online_kernel>(kWarps * 32, 0);
      const int splits = attention_splits(batched ? 4 : 2, sms, wave, bsz * hkv, s_max);
      auto part_acc = at::empty({bsz, hq, splits, DD}, fopt);
      auto part_m = at::empty({bsz, hq, splits}, fopt);
      auto part_l = at::empty({bsz, hq, splits}, fopt);
      launch_pdl(partial, dim3(splits, hkv, bsz), dim3(kWarps * 32), stream, dim3(1),
          reinterpret_cast<const T*>(q.data_ptr()), reinterpret_cast<const T*>(kc.data_ptr()),
          reinterpret_cast<const T*>(vc.data_ptr()), lens.data_ptr<int>(), part_acc.data_ptr<float>(),
          part_m.data_ptr<float>(), part_l.data_ptr<float>(), hq, hkv, s_max, g, (float)scale);
      launch_pdl(attn_combine_kernel<T, DD>, dim3(hq, bsz), dim3(DD), stream, dim3(1),
          part_acc.data_ptr<float>(), part_m.data_ptr<float>(), part_l.data_ptr<float>(),
          reinterpret_cast<T*>(out.data_ptr()), hq, splits,
          gate.has_value() ? reinterpret_cast<const T*>(gate->data_ptr()) : nullptr,
          gate.has_value() ? gate->stride(0) : 0, gate.has_value() ? gate->stride(1) : 0);
    };
    with_group_size(d, g, run);
  });
  return out;
}

// The prologue's operands, checked: the rows' strides and the sizes the kernels take.
struct PrologueShape {
  int64_t q_ld, k_ld, v_ld;
  int bsz, hq, hkv, s_max, d, qw, r;
};

PrologueShape check_prologue(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& cos, const at::Tensor& sin, const c10::optional<at::Tensor>& q_w,
                             const c10::optional<at::Tensor>& k_w, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& positions, bool gated) {
  const auto dt = q.scalar_type();
  PrologueShape p{};
  p.q_ld = check_rows_half(q, op, "q", dt);
  p.k_ld = check_rows_half(k, op, "k", dt);
  p.v_ld = check_rows_half(v, op, "v", dt);
  const std::initializer_list<const at::Tensor*> inputs = {&cos, &sin, &k_cache, &v_cache};
  for (const at::Tensor* t : inputs) check_cuda_half(*t, op, "input", dt);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), op,
              ": caches must be [B, Hkv, S, D] of one shape, got ", k_cache.sizes(), " and ", v_cache.sizes());
  p.bsz = (int)k_cache.size(0), p.hkv = (int)k_cache.size(1), p.s_max = (int)k_cache.size(2);
  p.d = (int)k_cache.size(3), p.qw = gated ? 2 * p.d : p.d;
  const int d = p.d, bsz = p.bsz;
  TORCH_CHECK(d == 64 || d == 128 || d == 256, op, ": head_dim must be 64, 128 or 256, got ", d);
  TORCH_CHECK(q.dim() == 2 && q.size(0) == bsz && q.size(1) % p.qw == 0, op, ": q ", q.sizes(),
              " must be [B, Hq*", p.qw, "] for B = ", bsz);
  TORCH_CHECK(k.sizes() == v.sizes() && k.dim() == 2 && k.size(0) == bsz && k.size(1) == p.hkv * d, op, ": k ",
              k.sizes(), " and v ", v.sizes(), " must be [", bsz, ", ", p.hkv * d, "]");
  p.r = (int)cos.size(-1);
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == bsz && p.r % 2 == 0 && p.r <= d, op,
              ": cos/sin must be [B, R] with R even and <= ", d, ", got ", cos.sizes(), " and ", sin.sizes());
  TORCH_CHECK(q_w.has_value() == k_w.has_value(), op, ": give both q and k norm weights or neither");
  if (q_w.has_value()) {
    check_cuda_half(*q_w, op, "q_norm weight", dt);
    check_cuda_half(*k_w, op, "k_norm weight", dt);
    TORCH_CHECK(q_w->numel() == d && k_w->numel() == d, op, ": norm weights must have head_dim = ", d, " elements");
  }
  TORCH_CHECK(positions.is_cuda() && positions.scalar_type() == at::kLong && positions.dim() == 1 &&
                  positions.size(0) == bsz && positions.is_contiguous(),
              op, ": positions must be a contiguous CUDA int64 tensor [", bsz, "]");
  p.hq = (int)(q.size(1) / p.qw);
  return p;
}

template <typename T>
const T* ptr_or_null(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? reinterpret_cast<const T*>(t->data_ptr()) : nullptr;
}

// The prologue kernel on checked operands; returns the query [B, Hq, D].
at::Tensor launch_prologue(const char* op, const PrologueShape& p, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                           const c10::optional<at::Tensor>& q_w, const c10::optional<at::Tensor>& k_w,
                           at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& positions, double eps,
                           bool unit_offset) {
  auto query = at::empty({p.bsz, p.hq, p.d}, q.options());
  if (p.bsz == 0) return query;
  c10::cuda::CUDAGuard guard(q.device());
  const int blocks = (p.bsz * (p.hq + p.hkv) + kWarps - 1) / kWarps;
  SEGKI_DISPATCH_HALF(q.scalar_type(), op, [&] {
    auto run = [&](auto d_const) {
      constexpr int DD = decltype(d_const)::value;
      launch_pdl(attn_prologue_kernel<T, DD>, dim3(blocks), dim3(kWarps * 32), at::cuda::getCurrentCUDAStream(),
          dim3(1), reinterpret_cast<const T*>(q.data_ptr()), reinterpret_cast<const T*>(k.data_ptr()),
          reinterpret_cast<const T*>(v.data_ptr()), reinterpret_cast<const T*>(cos.data_ptr()),
          reinterpret_cast<const T*>(sin.data_ptr()), ptr_or_null<T>(q_w), ptr_or_null<T>(k_w),
          reinterpret_cast<T*>(k_cache.data_ptr()), reinterpret_cast<T*>(v_cache.data_ptr()),
          positions.data_ptr<int64_t>(), reinterpret_cast<T*>(query.data_ptr()), p.bsz, p.hq, p.hkv, p.s_max, p.r,
          p.qw, p.q_ld, p.k_ld, p.v_ld, (float)eps, unit_offset);
    };
    with_head_dim(p.d, run);
  });
  return query;
}

at::Tensor attention_prologue(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                              const at::Tensor& sin, const c10::optional<at::Tensor>& q_w,
                              const c10::optional<at::Tensor>& k_w, at::Tensor k_cache, at::Tensor v_cache,
                              const at::Tensor& positions, double eps, bool unit_offset, bool gated) {
  const char* op = "segki::attention_prologue";
  const PrologueShape p = check_prologue(op, q, k, v, cos, sin, q_w, k_w, k_cache, v_cache, positions, gated);
  return launch_prologue(op, p, q, k, v, cos, sin, q_w, k_w, k_cache, v_cache, positions, eps, unit_offset);
}

// The step in one launch where its clusters (rows x KV heads) are at most kStepRowHeads and the cache holds at
// most kStepMaxCache positions. Measured on the H200 (`benchmarks/results/attn_step/`, 392-position cache, decode
// tok/s against the three launches): 0.8B one row (2 clusters) +1.9 %, 4B one row (4) +0.8 %; 0.8B at 4 rows (8)
// -3.2 %, 4B at 4 rows (16) -4.0 %, where the three launches spread the positions over more blocks.
// SEGKI_ATTN_STEP=split / fused: always three launches / one wherever it can run (int32 lengths).
constexpr int kStepRowHeads = 4;
constexpr int kStepMaxCache = 2048;
constexpr int kStepMinChunk = 16;   // cache positions per split, at least
constexpr int kStepWarpFloats = 1024;  // MAXG x D per warp up to which a block has 8 warps (else 4: shared memory)

// The most blocks a cluster of `kernel` takes on the current device: 16 (a non-portable size, allowed here) where
// the device can place such a cluster of `block`-thread blocks, else 8 (the portable size). Found once per device.
template <auto kernel>
int max_cluster_blocks(dim3 block) {
  static std::atomic<uint64_t> known{0}, large{0};  // bit d: device d asked / takes 16
  const uint64_t bit = device_bit();
  if (bit == 0) return 8;
  if ((known.load(std::memory_order_relaxed) & bit) == 0) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(16);
    cfg.blockDim = block;
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = 16;
    attr.val.clusterDim.y = attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess) (void)cudaGetLastError();
    if (clusters > 0) large.fetch_or(bit, std::memory_order_relaxed);
    known.fetch_or(bit, std::memory_order_relaxed);
  }
  return (large.load(std::memory_order_relaxed) & bit) != 0 ? 16 : 8;
}

bool step_in_one_launch(int row_heads, int s_max, const at::Tensor& lengths) {
  if (env_is("SEGKI_ATTN_STEP", "split") || lengths.scalar_type() != at::kInt || !lengths.is_contiguous())
    return false;
  return env_is("SEGKI_ATTN_STEP", "fused") || (row_heads <= kStepRowHeads && s_max <= kStepMaxCache);
}

at::Tensor decode_attention_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& cos, const at::Tensor& sin, const c10::optional<at::Tensor>& q_w,
                                 const c10::optional<at::Tensor>& k_w, at::Tensor k_cache, at::Tensor v_cache,
                                 const at::Tensor& positions, const at::Tensor& lengths, double eps,
                                 bool unit_offset, bool gated, double scale) {
  const char* op = "segki::decode_attention_step";
  const PrologueShape p = check_prologue(op, q, k, v, cos, sin, q_w, k_w, k_cache, v_cache, positions, gated);
  TORCH_CHECK(p.hq % p.hkv == 0 && p.hq / p.hkv <= 8, op, ": Hq = ", p.hq, " must be a multiple of Hkv = ", p.hkv,
              " with at most 8 query heads per KV head");
  TORCH_CHECK(lengths.is_cuda() && lengths.dim() == 1 && lengths.size(0) == p.bsz &&
                  (lengths.scalar_type() == at::kInt || lengths.scalar_type() == at::kLong),
              op, ": lengths must be a CUDA int32/int64 tensor [", p.bsz, "]");
  if (!step_in_one_launch(p.bsz * p.hkv, p.s_max, lengths)) {
    const at::Tensor query =
        launch_prologue(op, p, q, k, v, cos, sin, q_w, k_w, k_cache, v_cache, positions, eps, unit_offset);
    c10::optional<at::Tensor> gate;  // the second half of each query head's columns, read in place
    if (gated) gate = q.as_strided({p.bsz, p.hq, p.d}, {p.q_ld, p.qw, 1}, q.storage_offset() + p.d);
    return decode_attention(query, k_cache, v_cache, lengths, scale, gate);
  }
  auto out = at::empty({p.bsz, p.hq, p.d}, q.options());
  if (p.bsz == 0) return out;
  c10::cuda::CUDAGuard guard(q.device());
  const int want = std::max(1, std::min(kStepMaxSplits, (p.s_max + kStepMinChunk - 1) / kStepMinChunk));
  const int g = p.hq / p.hkv;
  SEGKI_DISPATCH_HALF(q.scalar_type(), op, [&] {
    StepArgs<T> a{};
    a.q = reinterpret_cast<const T*>(q.data_ptr());
    a.k = reinterpret_cast<const T*>(k.data_ptr());
    a.v = reinterpret_cast<const T*>(v.data_ptr());
    a.cos = reinterpret_cast<const T*>(cos.data_ptr());
    a.sin = reinterpret_cast<const T*>(sin.data_ptr());
    a.q_w = ptr_or_null<T>(q_w);
    a.k_w = ptr_or_null<T>(k_w);
    a.kc = reinterpret_cast<T*>(k_cache.data_ptr());
    a.vc = reinterpret_cast<T*>(v_cache.data_ptr());
    a.out = reinterpret_cast<T*>(out.data_ptr());
    a.positions = positions.data_ptr<int64_t>();
    a.lengths = lengths.data_ptr<int>();
    a.hq = p.hq, a.hkv = p.hkv, a.s_max = p.s_max, a.r = p.r, a.qw = p.qw;
    a.q_ld = p.q_ld, a.k_ld = p.k_ld, a.v_ld = p.v_ld;
    a.eps = (float)eps, a.scale = (float)scale;
    a.unit_offset = unit_offset, a.gated = gated;
    auto run = [&](auto d_const, auto g_const) {
      constexpr int DD = decltype(d_const)::value, GG = decltype(g_const)::value;
      constexpr int WARPS = GG * DD <= kStepWarpFloats ? 8 : 4;
      constexpr auto plain = attn_step_kernel<T, DD, GG, WARPS, false>;
      constexpr auto stamping = attn_step_kernel<T, DD, GG, WARPS, true>;  // the timeline's, while it stamps
      const bool stamps = stamp_state().buf != nullptr;
      const int splits = std::min(want, stamps ? max_cluster_blocks<stamping>(dim3(WARPS * 32))
                                               : max_cluster_blocks<plain>(dim3(WARPS * 32)));
      const StampTarget stamp = stamp_target(kAttentionStep, {p.bsz, p.d, p.hq, gated ? 1 : 0,
                                                              splits * p.hkv * p.bsz, splits, p.hkv});
      a.stamps = stamp.buf;
      a.launch_id = stamp.id;
      launch_pdl(stamp.buf ? stamping : plain, dim3(splits, p.hkv, p.bsz), dim3(WARPS * 32),
                 at::cuda::getCurrentCUDAStream(), dim3(splits, 1, 1), a);
    };
    with_group_size(p.d, g, run);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(segki, CUDA, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("attention_prologue", &attention_prologue);
  m.impl("decode_attention_step", &decode_attention_step);
}

}  // namespace segki
