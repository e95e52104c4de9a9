// Decode attention (flash-decoding): one query token per row against a KV cache with per-row valid
// lengths read on the device. Pass 1 splits each row's valid prefix [0, len) evenly over a fixed number of
// blocks per KV head (so the grid is static for graph capture, and time follows len, not the cache size);
// each block serves all G query heads of its KV head and keeps an online softmax. Pass 2 merges the splits
// and applies Qwen3.5's sigmoid output gate when one is given.
//
// The prologue kernel does what the model's attention code does between the projections and attention for
// one new token: per-head q/k RMSNorm, rotary embedding on the first R features, key and value written into
// the cache at the row's position -- one launch instead of ~20 small torch kernels per layer and step.
#include "common.cuh"

namespace segki {
namespace {

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
  const int len = min(lengths[b], s_max);
  const int chunk = (len + splits - 1) / splits;
  const int s0 = min(len, split * chunk), s1 = min(len, s0 + chunk);
  const int per_warp = (s1 - s0 + kWarps - 1) / kWarps;
  const int w0 = min(s1, s0 + warp * per_warp), w1 = min(s1, w0 + per_warp);

  float qf[MAXG][E], acc[MAXG][E], m[MAXG], l[MAXG];
#pragma unroll
  for (int h = 0; h < MAXG; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[h][e] = 0.f;
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
    for (int p0 = w0; p0 < w1; p0 += kPos) {
      float kf[kPos][E], vf[kPos][E];
#pragma unroll
      for (int i = 0; i < kPos; ++i)
        if (p0 + i < w1) {
          load_row<T, E>(kc + base + (size_t)(p0 + i) * D, kf[i]);
          load_row<T, E>(vc + base + (size_t)(p0 + i) * D, vf[i]);
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
  // merge the warps of this block through shared memory
  __shared__ float sm_acc[kWarps][MAXG][D];
  __shared__ float sm_m[kWarps][MAXG], sm_l[kWarps][MAXG];
#pragma unroll
  for (int h = 0; h < MAXG; ++h) {
    if (h >= g) break;
#pragma unroll
    for (int e = 0; e < E; ++e) sm_acc[warp][h][lane * E + e] = acc[h][e];
    if (lane == 0) {
      sm_m[warp][h] = m[h];
      sm_l[warp][h] = l[h];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < g * D; idx += blockDim.x) {
    const int h = idx / D, d = idx % D;
    float mm = -INFINITY;
    for (int w = 0; w < kWarps; ++w) mm = fmaxf(mm, sm_m[w][h]);
    float ll = 0.f, aa = 0.f;
    if (mm > -INFINITY)
      for (int w = 0; w < kWarps; ++w) {
        const float c = __expf(sm_m[w][h] - mm);
        ll += sm_l[w][h] * c;
        aa += sm_acc[w][h][d] * c;
      }
    const size_t o = ((size_t)b * hq + kvh * g + h) * splits + split;
    part_acc[o * D + d] = aa;
    if (d == 0) {
      part_m[o] = mm;
      part_l[o] = ll;
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
  const T* w = is_q ? q_w : k_w;
  const T* vr = is_q ? nullptr : v + (size_t)b * v_ld + (size_t)kvh * D;  // a key head's value row
  // Every read is requested up front: the norm weight, the rotary tables, the position and the value row no
  // longer wait for the statistics, the shared-memory exchange or each other (a chain of four round trips
  // before, in the SASS). The value row is only pulled into L1 here: held in registers it spilled (fp16, D=256).
  if (!is_q) asm volatile("prefetch.global.L1 [%0];" ::"l"(vr + lane * E));
  float f[E], wf[E] = {}, c[E] = {}, sn[E] = {};
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int i = lane * E + e;
    f[e] = to_float<T>(src[i]);
    if (w != nullptr) wf[e] = to_float<T>(w[i]);
    if (i < r) {
      c[e] = to_float<T>(cos[(size_t)b * r + i]);
      sn[e] = to_float<T>(sin[(size_t)b * r + i]);
    }
  }
  const int64_t pos = is_q ? 0 : positions[b];
  if (w != nullptr) {  // per-head RMSNorm, fp32 statistics
    float ss = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) ss += f[e] * f[e];
    const float inv = rsqrtf(warp_sum(ss) / D + eps);
#pragma unroll
    for (int e = 0; e < E; ++e)
      f[e] = unit_offset ? round_to<T>(f[e] * inv * (1.f + wf[e])) : round_to<T>(wf[e] * round_to<T>(f[e] * inv));
  }
#pragma unroll
  for (int e = 0; e < E; ++e) feat[warp][lane * E + e] = f[e];
  __syncwarp();
  const int half = r / 2;
#pragma unroll
  for (int e = 0; e < E; ++e) {  // rotate-half RoPE on features [0, r)
    const int i = lane * E + e;
    if (i < r) {
      const float other = i < half ? -feat[warp][i + half] : feat[warp][i - half];
      f[e] = round_to<T>(round_to<T>(__fmul_rn(f[e], c[e])) + round_to<T>(__fmul_rn(other, sn[e])));
    }
  }
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
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const bool batched = batched_attention(bsz * hkv);
  const int per_sm = batched ? 4 : 2;  // blocks per SM the splits aim for
  const int splits =
      std::max(1, std::min({(per_sm * sms + bsz * hkv - 1) / (bsz * hkv), kMaxSplits, (s_max + 15) / 16}));
  auto fopt = q.options().dtype(at::kFloat);
  auto part_acc = at::empty({bsz, hq, splits, d}, fopt);
  auto part_m = at::empty({bsz, hq, splits}, fopt);
  auto part_l = at::empty({bsz, hq, splits}, fopt);
  auto stream = at::cuda::getCurrentCUDAStream();
  auto lens = lengths.to(at::kInt).contiguous();
  SEGKI_DISPATCH_HALF(q.scalar_type(), op, [&] {
    auto run = [&](auto d_const, auto g_const) {
      constexpr int DD = decltype(d_const)::value, GG = decltype(g_const)::value;
      auto partial = batched ? attn_partial_kernel<T, DD, GG, true> : attn_partial_kernel<T, DD, GG, false>;
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
    auto by_g = [&](auto d_const) {
      if (g == 1) run(d_const, std::integral_constant<int, 1>{});
      else if (g == 2) run(d_const, std::integral_constant<int, 2>{});
      else if (g <= 4) run(d_const, std::integral_constant<int, 4>{});
      else run(d_const, std::integral_constant<int, 8>{});
    };
    with_head_dim(d, by_g);
  });
  return out;
}

at::Tensor attention_prologue(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                              const at::Tensor& sin, const c10::optional<at::Tensor>& q_w,
                              const c10::optional<at::Tensor>& k_w, at::Tensor k_cache, at::Tensor v_cache,
                              const at::Tensor& positions, double eps, bool unit_offset, bool gated) {
  const char* op = "segki::attention_prologue";
  const auto dt = q.scalar_type();
  const int64_t q_ld = check_rows_half(q, op, "q", dt), k_ld = check_rows_half(k, op, "k", dt);
  const int64_t v_ld = check_rows_half(v, op, "v", dt);
  const std::initializer_list<const at::Tensor*> inputs = {&cos, &sin, &k_cache, &v_cache};
  for (const at::Tensor* t : inputs) check_cuda_half(*t, op, "input", dt);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), op,
              ": caches must be [B, Hkv, S, D] of one shape, got ", k_cache.sizes(), " and ", v_cache.sizes());
  const int bsz = (int)k_cache.size(0), hkv = (int)k_cache.size(1), s_max = (int)k_cache.size(2);
  const int d = (int)k_cache.size(3), qw = gated ? 2 * d : d;
  TORCH_CHECK(d == 64 || d == 128 || d == 256, op, ": head_dim must be 64, 128 or 256, got ", d);
  TORCH_CHECK(q.dim() == 2 && q.size(0) == bsz && q.size(1) % qw == 0, op, ": q ", q.sizes(),
              " must be [B, Hq*", qw, "] for B = ", bsz);
  TORCH_CHECK(k.sizes() == v.sizes() && k.dim() == 2 && k.size(0) == bsz && k.size(1) == hkv * d, op, ": k ",
              k.sizes(), " and v ", v.sizes(), " must be [", bsz, ", ", hkv * d, "]");
  const int r = (int)cos.size(-1);
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == bsz && r % 2 == 0 && r <= d, op,
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
  const int hq = (int)(q.size(1) / qw);
  auto query = at::empty({bsz, hq, d}, q.options());
  if (bsz == 0) return query;
  c10::cuda::CUDAGuard guard(q.device());
  const int blocks = (bsz * (hq + hkv) + kWarps - 1) / kWarps;
  SEGKI_DISPATCH_HALF(dt, op, [&] {
    auto run = [&](auto d_const) {
      constexpr int DD = decltype(d_const)::value;
      launch_pdl(attn_prologue_kernel<T, DD>, dim3(blocks), dim3(kWarps * 32), at::cuda::getCurrentCUDAStream(),
          dim3(1), reinterpret_cast<const T*>(q.data_ptr()), reinterpret_cast<const T*>(k.data_ptr()),
          reinterpret_cast<const T*>(v.data_ptr()), reinterpret_cast<const T*>(cos.data_ptr()),
          reinterpret_cast<const T*>(sin.data_ptr()),
          q_w.has_value() ? reinterpret_cast<const T*>(q_w->data_ptr()) : nullptr,
          k_w.has_value() ? reinterpret_cast<const T*>(k_w->data_ptr()) : nullptr,
          reinterpret_cast<T*>(k_cache.data_ptr()), reinterpret_cast<T*>(v_cache.data_ptr()),
          positions.data_ptr<int64_t>(), reinterpret_cast<T*>(query.data_ptr()), bsz, hq, hkv, s_max, r, qw, q_ld,
          k_ld, v_ld, (float)eps, unit_offset);
    };
    with_head_dim(d, run);
  });
  return query;
}

}  // namespace

TORCH_LIBRARY_IMPL(segki, CUDA, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("attention_prologue", &attention_prologue);
}

}  // namespace segki
