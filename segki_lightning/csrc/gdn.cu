// Fused Gated-DeltaNet decode step (after the input projections), two kernels (or one, below) instead of the ~15
// ops transformers runs per layer and token (gdn_decode_step), or the second alone (gdn_recurrent_step) when
// the conv ran in the in-projection's epilogue (gemv.cu, gdn_in_proj_conv):
//   1. conv: shift the conv state left by one, append the new q|k|v token, depthwise conv + SiLU.
//   2. recurrence: per (row, value head, 32 columns): q/k L2-norm, gates, delta-rule update of the fp32
//      state in place (Dk/4 entries of one column per thread, in registers), output, gated RMSNorm.
// Rounding points follow ops/reference/gdn.py (the conv output, the core output and the normed value are
// rounded to the activation dtype exactly where the reference does). Where the (row, value head) items are fewer
// than the SMs and a key head's value heads fit one cluster, the conv runs inside the recurrence's cluster kernel
// instead (one launch; SEGKI_GDN_CONV=split keeps two). The recurrence of Dk = Dv = 128 heads runs
// as resident blocks looping over the (row, head) items where there are at least as many as SMs
// (gdn_recurrent_pipe_kernel): the same arithmetic with the states streamed in and out by the copy engine, and
// the conv of a block's items as its prologue while the first state lands (conv_block_items).
#include "bulk.cuh"
#include "common.cuh"
#include "timeline.cuh"

namespace segki {
namespace {

// The cluster's blocks (a 1-D cluster along x): this block's rank and their count.
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

__device__ __forceinline__ unsigned cluster_blocks() {
  unsigned n;
  asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
  return n;
}

// The cluster barrier in two halves, every thread of the cluster: arrive (relaxed: it publishes nothing but the
// mbarrier's initialization, which fence.mbarrier_init orders before it) and, later, wait.
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}

__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }

// Stores v at `local`'s address in the shared memory of the cluster's block `rank`, counted (4 bytes) on that
// block's mbarrier at `bar`'s address: the receiver waits on its barrier, no cluster barrier on either side.
__device__ __forceinline__ void store_to_block(float* local, float v, uint64_t* bar, unsigned rank) {
  unsigned dst, dst_bar;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(dst) : "r"(smem_addr(local)), "r"(rank));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(dst_bar) : "r"(smem_addr(bar)), "r"(rank));
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(dst),
               "r"(__float_as_uint(v)), "r"(dst_bar)
               : "memory");
}

// Row strides (elements) of the step's inputs: each may be a column slice of one product over packed weights.
struct RowStrides {
  int64_t mixed, z, b, a;
};

// The step's conv alone, where the recurrence does not run it inside (common.cuh: conv_token). STAMP: the
// timeline's instantiation (thread 0 of each block writes its record into `stamps`).
template <typename T, bool STAMP>
__global__ void gdn_conv_kernel(const T* __restrict__ qkv, int64_t qkv_ld, T* __restrict__ conv_state,
                                const T* __restrict__ w, const T* __restrict__ bias, T* __restrict__ mixed,
                                int c_total, int width, unsigned long long* stamps, int launch_id) {
  Stamps st{};
  mark_start<STAMP>(st);
  pdl_start();  // everything below reads what earlier kernels wrote
  mark<STAMP>(st, kWaited);
  const int c = blockIdx.x * blockDim.x + threadIdx.x, b = blockIdx.y;
  if (c >= c_total) return;  // never thread 0: the grid's blocks start within c_total
  const size_t o = (size_t)b * c_total + c;
  const float x = to_float<T>(qkv[(size_t)b * qkv_ld + c]);
  mixed[o] = from_float<T>(conv_token<T>(conv_state + o * width, w, bias, c, x, width));
  mark_until<STAMP>(st, kLoaded, kLast);
  if constexpr (STAMP) {
    if (threadIdx.x == 0) write_stamps(stamps, launch_id, st, 1);
  }
}

// What a (row b, value head h) item reads besides its state, for the thread's state column j: its value, z and
// norm weight and the head's gate inputs, and the thread's share of q and k (the block's THREADS threads take the
// DK elements in turn), which stash_qk() puts in shared memory. Loading and stashing apart lets a block have the
// next item's loads in flight while it finishes the current one.
template <typename T, int DK, int THREADS>
struct ItemIn {
  static constexpr int N = (DK + THREADS - 1) / THREADS;
  T v_raw, z_raw, nw_raw, a_raw, b_raw;
  float dt_b, a_lg, qq, kk;
  T q_raw[N], k_raw[N];
};

// The item's parameters: A_log and dt_bias (of its head; as stored, or the launch's fp32 copies) and the gated
// norm's weight (of its column).
template <typename T, int DK, int THREADS>
__device__ __forceinline__ void load_params(ItemIn<T, DK, THREADS>& in, const void* a_log, const void* dt_bias,
                                            bool gates_fp32, const T* __restrict__ norm_w, int h, int j) {
  auto param = [&](const void* p) {  // A_log / dt_bias are stored in fp32 or in the activation dtype
    return gates_fp32 ? static_cast<const float*>(p)[h] : to_float<T>(static_cast<const T*>(p)[h]);
  };
  in.dt_b = param(dt_bias);
  in.a_lg = param(a_log);
  in.nw_raw = norm_w[j];
}

// The item's activations besides q|k|v: z and the gate inputs.
template <typename T, int DK, int THREADS>
__device__ __forceinline__ void load_gates(ItemIn<T, DK, THREADS>& in, const T* __restrict__ z,
                                           const T* __restrict__ bgate, const T* __restrict__ agate, RowStrides ld,
                                           int dv, int b, int h, int j) {
  in.a_raw = agate[(size_t)b * ld.a + h];
  in.b_raw = bgate[(size_t)b * ld.b + h];
  in.z_raw = z[(size_t)b * ld.z + h * dv + j];
}

// The item's v and the thread's share of q and k from mixed (q|k|v after the conv).
template <typename T, int DK, int THREADS>
__device__ __forceinline__ void load_qkv(ItemIn<T, DK, THREADS>& in, const T* __restrict__ mixed, RowStrides ld,
                                         int hk, int hv, int dv, int b, int h, int j) {
  const int kh = h / (hv / hk);
  const T* row = mixed + (size_t)b * ld.mixed;
  in.v_raw = row[2 * hk * DK + h * dv + j];
#pragma unroll
  for (int n = 0; n < in.N; ++n) {
    const int i = threadIdx.x + n * THREADS;
    if (i < DK) {
      in.q_raw[n] = row[kh * DK + i];
      in.k_raw[n] = row[hk * DK + kh * DK + i];
    }
  }
}

template <typename T, int DK, int THREADS>
__device__ __forceinline__ ItemIn<T, DK, THREADS> load_item(
    const T* __restrict__ mixed, const T* __restrict__ z, const T* __restrict__ bgate, const T* __restrict__ agate,
    RowStrides ld, const void* a_log, const void* dt_bias, bool gates_fp32, const T* __restrict__ norm_w, int hk,
    int hv, int dv, int b, int h, int j) {
  ItemIn<T, DK, THREADS> in;
  load_qkv(in, mixed, ld, hk, hv, dv, b, h, j);
  load_gates(in, z, bgate, agate, ld, dv, b, h, j);
  load_params(in, a_log, dt_bias, gates_fp32, norm_w, h, j);
  return in;
}

// The conv of the step inside the recurrence (gdn_decode_step at few rows, Qwen3.5's width 4 with 8-byte aligned
// windows and taps): `mixed` is then q|k|v before the conv, `state` the windows [B, C, 4] rewritten in place,
// `w` the taps [C, 4], `bias` [C] or nullptr.
template <typename T>
struct ConvArgs {
  T* state;
  const T* w;
  const T* bias;
  int channels;
};

// One channel's conv: taps and bias (parameters: before the PDL wait), then its old window and new token.
template <typename T>
struct ConvIn {
  uint2 window, taps;
  float bias;
  T x;

  __device__ __forceinline__ void load_taps(const ConvArgs<T>& c, int ch) {
    taps = *reinterpret_cast<const uint2*>(c.w + (size_t)ch * 4);
    bias = c.bias ? to_float<T>(c.bias[ch]) : 0.f;
  }
  __device__ __forceinline__ void load_token(const ConvArgs<T>& c, const T* row, int b, int ch) {
    window = *reinterpret_cast<const uint2*>(c.state + ((size_t)b * c.channels + ch) * 4);
    x = row[ch];
  }
  // conv_token's output: SiLU(taps . shifted window + bias), rounded to T as the conv kernel stores it
  __device__ __forceinline__ T value(const ConvArgs<T>& c) const {
    float acc = conv4_sum<T>(window, taps, to_float<T>(x));
    if (c.bias) acc += bias;
    return from_float<T>(silu(acc));
  }
  __device__ __forceinline__ void store_window(const ConvArgs<T>& c, int b, int ch) const {
    *reinterpret_cast<uint2*>(c.state + ((size_t)b * c.channels + ch) * 4) = conv4_shifted<T>(window, x);
  }
};

// The streamed recurrence's conv: a block's items all at once, while its first state lands. Its items come in
// groups of a key head's value heads (`group` = Hv / Hk; group g: row g / Hk, key head g % Hk), the block's groups
// `first`, `first + stride`, ...; per group its q then k channels, then each value head's v channels, through the
// conv (ConvIn: conv_token's sums, the conv kernel's bits) into vals [groups][2 Dk + group Dv]. Each window is
// rewritten by the thread that read it: the block alone reads its groups' channels.
template <typename T, int DK, int DV>
__device__ __forceinline__ void conv_block_items(const ConvArgs<T>& c, const T* __restrict__ qkv, int64_t ld, int hk,
                                                 int group, int first, int stride, int groups, T* vals) {
  constexpr int kAtOnce = 4;  // channels a thread has in flight
  const int per = 2 * DK + group * DV, total = groups * per;
  auto channel = [&](int i, int& b) {
    const int g = first + (i / per) * stride, e = i % per, kh = g % hk;
    b = g / hk;
    return e < 2 * DK ? (e < DK ? kh * DK + e : hk * DK + kh * DK + e - DK)
                      : 2 * hk * DK + (kh * group + (e - 2 * DK) / DV) * DV + (e - 2 * DK) % DV;
  };
  for (int i0 = threadIdx.x; i0 < total; i0 += kAtOnce * blockDim.x) {
    ConvIn<T> in[kAtOnce];
    int ch[kAtOnce], b[kAtOnce];
#pragma unroll
    for (int u = 0; u < kAtOnce; ++u) {
      const int i = i0 + u * blockDim.x;
      if (i < total) {
        ch[u] = channel(i, b[u]);
        in[u].load_taps(c, ch[u]);
        in[u].load_token(c, qkv + (size_t)b[u] * ld, b[u], ch[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kAtOnce; ++u) {
      const int i = i0 + u * blockDim.x;
      if (i < total) {
        vals[i] = in[u].value(c);
        in[u].store_window(c, b[u], ch[u]);
      }
    }
  }
}

// q and k into shared memory (sq, sk [DK]), with the thread's partial sums of their squares.
template <typename T, int DK, int THREADS>
__device__ __forceinline__ void stash_qk(ItemIn<T, DK, THREADS>& in, float* sq, float* sk) {
  in.qq = 0.f;
  in.kk = 0.f;
#pragma unroll
  for (int n = 0; n < in.N; ++n) {
    const int i = threadIdx.x + n * THREADS;
    if (i < DK) {
      const float qv = to_float<T>(in.q_raw[n]), kv = to_float<T>(in.k_raw[n]);
      sq[i] = qv;
      sk[i] = kv;
      in.qq += qv * qv;
      in.kk += kv * kv;
    }
  }
}

// The block's sums of the q and k squares in two halves around a barrier the caller has anyway: put_qk_norms()
// before it (each warp's sums into norms[warp]), qk_scales() after it (each thread sums the warps' in warp
// order). The sums of two block_sum() calls in the same order, with one barrier instead of four.
template <typename In>
__device__ __forceinline__ void put_qk_norms(const In& in, float2* norms /* [warps] */) {
  const float q = warp_sum(in.qq), k = warp_sum(in.kk);
  if ((threadIdx.x & 31) == 0) norms[threadIdx.x >> 5] = make_float2(q, k);
}

// (q_scale, k_scale): 1 / (|q| sqrt(DK)) and 1 / |k|, each norm with 1e-6 under the root.
template <int DK>
__device__ __forceinline__ float2 qk_scales(const float2* norms) {
  const int lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
  const float2 v = lane < nwarps ? norms[lane] : make_float2(0.f, 0.f);
  return make_float2(rsqrtf(warp_sum(v.x) + 1e-6f) * rsqrtf((float)DK), rsqrtf(warp_sum(v.y) + 1e-6f));
}

// The delta rule on the thread's R state entries s of one column (rows ty*R ..): gates, decay, the key's dot
// product (the column's four row groups summed through red[0] [4][32]), the update and the query's dot product
// (through red[1]: no barrier between reading the first sums and writing the second). Returns the column's
// output, rounded to T.
template <typename T, int R, typename In>
__device__ __forceinline__ float delta_rule(float (&s)[R], const In& in, const float* sq, const float* sk,
                                            float q_scale, float k_scale, float (*red)[4][32], int ty, int jl) {
  const float v = to_float<T>(in.v_raw);
  const float x = to_float<T>(in.a_raw) + in.dt_b;
  const float g = -expf(in.a_lg) * (x > 20.f ? x : log1pf(expf(x)));
  const float beta = round_to<T>(sigmoid(to_float<T>(in.b_raw)));
  const float decay = expf(g);

  float part = 0.f;
#pragma unroll
  for (int i = 0; i < R; ++i) {
    s[i] *= decay;
    part += s[i] * (sk[ty * R + i] * k_scale);
  }
  red[0][ty][jl] = part;
  __syncthreads();
  const float delta = (v - (red[0][0][jl] + red[0][1][jl] + red[0][2][jl] + red[0][3][jl])) * beta;
  part = 0.f;
#pragma unroll
  for (int i = 0; i < R; ++i) {
    s[i] += sk[ty * R + i] * k_scale * delta;
    part += s[i] * (sq[ty * R + i] * q_scale);
  }
  red[1][ty][jl] = part;
  __syncthreads();
  return round_to<T>(red[1][0][jl] + red[1][1][jl] + red[1][2][jl] + red[1][3][jl]);
}

// The gated RMSNorm of output o, given the sum of squares of its head's Dv outputs: weight * norm * SiLU(z).
template <typename T, typename In>
__device__ __forceinline__ T gated_norm(float o, float total, int dv, float eps, const In& in) {
  const float n = round_to<T>(o * rsqrtf(total / dv + eps));
  const float t = round_to<T>(to_float<T>(in.nw_raw) * n);
  const float zz = to_float<T>(in.z_raw);
  return from_float<T>(t * silu(zz));
}

constexpr int kMaxCluster = 8;  // blocks per cluster (the portable limit)

// grid (Hv * tiles, B), block 128 threads: a block owns 32 state columns of a value head; thread (ty, jl) keeps rows
// [ty*Dk/4, (ty+1)*Dk/4) of column tile*32 + jl in registers. Clusters of `tiles` blocks (one value head), or with
// CONV of all the value heads of one key head: the conv runs here, each block computing the q and k channels of
// its key head (as every block of the cluster does) and its own v channels from the old windows, and the cluster's
// block 0 rewriting the q and k windows once every block has read them. The gated RMSNorm over a head's Dv outputs
// adds its tiles' squares, which every block stores into every block of the cluster (st.async onto an mbarrier):
// the sums of the split conv kernel and recurrence, in the same order (the same bits). STAMP: the timeline's
// instantiation (timeline.cuh; thread 0 of each block writes its record into `stamps`).
template <typename T, int DK, bool CONV, bool STAMP>
__global__ void __launch_bounds__(128) gdn_recurrent_kernel(
    const T* __restrict__ mixed, const T* __restrict__ z, const T* __restrict__ bgate, const T* __restrict__ agate,
    RowStrides ld, float* __restrict__ state, const void* __restrict__ a_log, const void* __restrict__ dt_bias,
    bool gates_fp32, const T* __restrict__ norm_w, T* __restrict__ out, int hk, int hv, int dv, float eps,
    ConvArgs<T> conv, unsigned long long* stamps, int launch_id) {
  Stamps st{};
  mark_start<STAMP>(st);
  constexpr int R = DK / 4;
  using In = ItemIn<T, DK, 128>;
  const int tiles = dv / 32;
  const int h = blockIdx.x / tiles, tile = blockIdx.x % tiles, b = blockIdx.y, kh = h / (hv / hk);
  const int jl = threadIdx.x & 31, ty = threadIdx.x >> 5, j = tile * 32 + jl;
  const unsigned rank = cluster_rank(), blocks = cluster_blocks();
  __shared__ float sq[DK], sk[DK], red[2][4][32], parts[kMaxCluster];
  __shared__ float2 norms[4];
  __shared__ __align__(8) uint64_t parts_in;
  float* state_col = state + (((size_t)b * hv + h) * DK + ty * R) * dv + j;
  const int ch_q = kh * DK, ch_k = hk * DK + kh * DK, ch_v = 2 * hk * DK + h * dv + j;
  ConvIn<T> cq[In::N], ck[In::N], cv;
  // before the wait: the exchange's mbarrier and the cluster arrival, L2 prefetches of what kernels write (the
  // state slice, one 128-byte row piece per thread; the conv windows) and the conv's taps (A_log and dt_bias wait:
  // they may be this call's fp32 copies)
  if (threadIdx.x == 0) {
    mbar_init(&parts_in);
    mbar_expect(&parts_in, blocks * 4);  // one float from every block of the cluster
    bulk_fence_init();                   // the initialization, before the cluster arrival below
  }
  cluster_arrive_relaxed();  // waited on before the first store into another block, long after
  for (int r = threadIdx.x; r < DK; r += 128) prefetch_l2(state + (((size_t)b * hv + h) * DK + r) * dv + tile * 32);
  if constexpr (CONV) {
    const T* windows = conv.state + (size_t)b * conv.channels * 4;
    if (threadIdx.x < DK / 16) {  // 16 windows of 8 bytes per line
      prefetch_l2(windows + (size_t)(ch_q + threadIdx.x * 16) * 4);
      prefetch_l2(windows + (size_t)(ch_k + threadIdx.x * 16) * 4);
    }
    if (threadIdx.x < 2) prefetch_l2(windows + (size_t)(ch_v - jl + threadIdx.x * 16) * 4);
#pragma unroll
    for (int n = 0; n < In::N; ++n) {
      const int i = threadIdx.x + n * 128;
      if (i < DK) {
        cq[n].load_taps(conv, ch_q + i);
        ck[n].load_taps(conv, ch_k + i);
      }
    }
    cv.load_taps(conv, ch_v);
  }
  pdl_launch_dependents();
  pdl_wait();  // everything below reads what earlier kernels wrote
  mark<STAMP>(st, kWaited);
  // the state slice (the bulk of the bytes) is requested first; the q/k norms below overlap its latency
  float s[R];
#pragma unroll
  for (int i = 0; i < R; ++i) s[i] = state_col[(size_t)i * dv];
  // every other read of the step requested now too: behind the block barriers below each was a round trip of its
  // own (ptxas does not move loads across them)
  In in;
  load_params(in, a_log, dt_bias, gates_fp32, norm_w, h, j);
  if constexpr (CONV) {
    const T* row = mixed + (size_t)b * ld.mixed;
#pragma unroll
    for (int n = 0; n < In::N; ++n) {
      const int i = threadIdx.x + n * 128;
      if (i < DK) {
        cq[n].load_token(conv, row, b, ch_q + i);
        ck[n].load_token(conv, row, b, ch_k + i);
      }
    }
    cv.load_token(conv, row, b, ch_v);
    load_gates(in, z, bgate, agate, ld, dv, b, h, j);
#pragma unroll
    for (int n = 0; n < In::N; ++n) {
      if (threadIdx.x + n * 128 < DK) {
        in.q_raw[n] = cq[n].value(conv);
        in.k_raw[n] = ck[n].value(conv);
      }
    }
    in.v_raw = cv.value(conv);
  } else {
    load_qkv(in, mixed, ld, hk, hv, dv, b, h, j);
    load_gates(in, z, bgate, agate, ld, dv, b, h, j);
  }
  stash_qk(in, sq, sk);
  put_qk_norms(in, norms);
  __syncthreads();
  mark<STAMP>(st, kLoaded);
  const float2 sc = qk_scales<DK>(norms);
  const float o = delta_rule<T, R>(s, in, sq, sk, sc.x, sc.y, red, ty, jl);
  // the new state's stores drain while the cluster exchanges the norm's sums
#pragma unroll
  for (int i = 0; i < R; ++i) state_col[(size_t)i * dv] = s[i];
  mark<STAMP>(st, kReduced);
  // the tile's share of its head's squares, into every block of the cluster (each has read its windows: its
  // delta rule's barriers are behind it); then the shares of this block's head, in tile order
  cluster_wait();  // every block's mbarrier is initialized
  const int head0 = (int)(rank / tiles) * tiles;
  float total = 0.f;
  if (ty == 0) {
    const float w = warp_sum(o * o);
    if (jl == 0)
      for (unsigned r = 0; r < blocks; ++r) store_to_block(&parts[rank], w, &parts_in, r);
  }
  mbar_wait<true>(&parts_in, 0);
  for (int t = 0; t < tiles; ++t) total += parts[head0 + t];
  mark<STAMP>(st, kStaged);
  if constexpr (STAMP) st.clock[kFirst] = st.clock[kStaged];  // no units: first is staged
  if (ty == 0) out[((size_t)b * hv + h) * dv + j] = gated_norm<T>(o, total, dv, eps, in);
  if constexpr (CONV) {
    if (ty == 0) cv.store_window(conv, b, ch_v);  // read by this block alone, before its barriers
    if (rank == 0) {  // the key head's windows: every block of the cluster has stored its share, so has read them
#pragma unroll
      for (int n = 0; n < In::N; ++n) {
        const int i = threadIdx.x + n * 128;
        if (i < DK) {
          cq[n].store_window(conv, b, ch_q + i);
          ck[n].store_window(conv, b, ch_k + i);
        }
      }
    }
  }
  mark<STAMP>(st, kLast);
  if constexpr (STAMP) {
    if (threadIdx.x == 0) write_stamps(stamps, launch_id, st, 1);
  }
}

// The recurrence of gdn_recurrent_kernel for Dk = Dv = 128 where there are at least as many (row, value head) items
// as SMs: one block of 512 threads per SM that stays resident and loops over the items, its memory traffic off the
// warps. Two 64 KB state slots, item k in slot k % 2: the block reads item k's state from its slot, writes the new
// state back into it and has the copy engine store it (no store instruction per element, so no warp waits on a
// full store queue), while item k+1's state streams into the other slot and item k+1's other inputs are loaded
// before item k's state is stored -- instead of loading, computing and storing in lockstep waves of small blocks.
// Thread (tile, ty, jl) holds what thread (ty, jl) of the per-tile kernel's block `tile` holds, and the gated
// RMSNorm sums the tiles' squares in tile order through shared memory instead of a cluster: the same arithmetic in
// the same order (the same bits). Measured (`results/gdn_stream/`): decode at 32 rows 1.775 -> 1.657 ms (0.8B),
// 4.71 -> 4.446 ms (4B). CONV: the step's conv inside (`mixed` is q|k|v before it): the block takes a key head's
// value heads as consecutive items and computes the conv of all its items into shared memory (conv_block_items,
// after the slots) while its first state lands, so that one block reads and rewrites its channels' windows and the
// items' path is the one without the conv. STAMP: the timeline's instantiation (thread 0 of each block writes its
// record).
template <typename T, bool CONV, bool STAMP>
__global__ void __launch_bounds__(512, 1) gdn_recurrent_pipe_kernel(
    const T* __restrict__ mixed, const T* __restrict__ z, const T* __restrict__ bgate, const T* __restrict__ agate,
    RowStrides ld, float* __restrict__ state, const void* __restrict__ a_log, const void* __restrict__ dt_bias,
    bool gates_fp32, const T* __restrict__ norm_w, T* __restrict__ out, int hk, int hv, float eps, int items,
    ConvArgs<T> conv, unsigned long long* stamps, int launch_id) {
  Stamps st{};
  mark_start<STAMP>(st);
  constexpr int DK = 128, DV = 128, THREADS = 512, TILES = DV / 32, R = DK / 4, SLOT = DK * DV, BYTES = SLOT * 4;
  using In = ItemIn<T, DK, THREADS>;
  extern __shared__ __align__(16) float slots[];   // [2][DK * DV]
  __shared__ float sq[DK], sk[DK], red[TILES][2][4][32], sq_tile[TILES];
  __shared__ float2 norms[THREADS / 32];
  __shared__ __align__(8) uint64_t bar[2];
  const int tile = threadIdx.x >> 7, ty = (threadIdx.x >> 5) & 3, jl = threadIdx.x & 31, j = tile * 32 + jl;
  // the block's k-th item: groups of `group` consecutive items (with the conv, a key head's value heads), a group
  // every gridDim.x in turn
  const int group = CONV ? hv / hk : 1;
  auto item_at = [&](int k) { return (blockIdx.x + k / group * gridDim.x) * group + k % group; };
  pdl_launch_dependents();
  const int first = item_at(0);
  if (first >= items) return;  // with the conv, fewer groups than blocks
  // before the wait only an L2 prefetch of the first item's state (safe whatever kernel wrote it last: writes
  // land in L2, a prefetch only warms it): one 128-byte line per thread
  prefetch_l2(state + (size_t)first * SLOT + threadIdx.x * 32);
  if (threadIdx.x == 0) {
    mbar_init(&bar[0]);
    mbar_init(&bar[1]);
    bulk_fence_init();
  }
  pdl_wait();  // everything below reads what earlier kernels wrote
  __syncthreads();
  mark<STAMP>(st, kWaited);
  auto request = [&](int item, int slot) {  // thread 0: the item's state into the slot
    const float* src = state + (size_t)item * SLOT;
    mbar_expect(&bar[slot], BYTES);
    bulk_load(slots + slot * SLOT, src, BYTES / 2, &bar[slot]);
    bulk_load(slots + slot * SLOT + SLOT / 2, src + SLOT / 2, BYTES / 2, &bar[slot]);
  };
  T* vals = reinterpret_cast<T*>(slots + 2 * SLOT);  // with the conv: its outputs [groups][2 Dk + group Dv]
  auto load = [&](int item, int k, In& in) {  // the block's k-th item
    const int b = item / hv, h = item % hv;
    if constexpr (CONV) {
      const T* v = vals + (size_t)(k / group) * (2 * DK + group * DV);
      in.v_raw = v[2 * DK + (k % group) * DV + j];
      if (threadIdx.x < DK) {
        in.q_raw[0] = v[threadIdx.x];
        in.k_raw[0] = v[DK + threadIdx.x];
      }
      load_gates(in, z, bgate, agate, ld, DV, b, h, j);
      load_params(in, a_log, dt_bias, gates_fp32, norm_w, h, j);
    } else {
      in = load_item<T, DK, THREADS>(mixed, z, bgate, agate, ld, a_log, dt_bias, gates_fp32, norm_w, hk, hv, DV, b,
                                     h, j);
    }
  };
  if (threadIdx.x == 0) request(first, 0);
  if constexpr (CONV) {
    const int groups = items / group, mine = (groups - (first / group) + gridDim.x - 1) / gridDim.x;
    conv_block_items<T, DK, DV>(conv, mixed, ld.mixed, hk, group, first / group, gridDim.x, mine, vals);
    __syncthreads();
  }
  In in;
  load(first, 0, in);
  stash_qk(in, sq, sk);
  put_qk_norms(in, norms);
  __syncthreads();
  int k = 0;
  for (int item = first; item < items; item = item_at(++k)) {
    const int b = item / hv, h = item % hv, slot = k & 1, next = item_at(k + 1);
    float* cur = slots + slot * SLOT + (ty * R) * DV + j;
    mbar_wait(&bar[slot], (k >> 1) & 1);
    if (k == 0) mark_until<STAMP>(st, kLoaded, kFirst);
    float s[R];
#pragma unroll
    for (int i = 0; i < R; ++i) s[i] = cur[i * DV];
    const float2 sc = qk_scales<DK>(norms);
    // the other slot: every thread's reads and writes of it were before item k-1's barriers; its store (item k-1's
    // state) must have read it out too
    if (threadIdx.x == 0 && next < items) {
      bulk_wait<false>();
      bulk_fence_reuse();
      request(next, slot ^ 1);
    }
    const float o = delta_rule<T, R>(s, in, sq, sk, sc.x, sc.y, red[tile], ty, jl);
    // the next item's inputs requested now: their round trip overlaps this item's store and norm
    In nxt = in;
    if (next < items) load(next, k + 1, nxt);
#pragma unroll
    for (int i = 0; i < R; ++i) cur[i * DV] = s[i];
    bulk_fence_reuse();  // this thread's writes of the slot, before the copy engine reads them
    if (ty == 0) {
      const float w = warp_sum(o * o);
      if (jl == 0) sq_tile[tile] = w;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float* dst = state + (size_t)item * SLOT;
      bulk_store(dst, slots + slot * SLOT, BYTES / 2);
      bulk_store(dst + SLOT / 2, slots + slot * SLOT + SLOT / 2, BYTES / 2);
      bulk_commit();
    }
    float total = 0.f;
#pragma unroll
    for (int r = 0; r < TILES; ++r) total += sq_tile[r];
    if (ty == 0) out[((size_t)b * hv + h) * DV + j] = gated_norm<T>(o, total, DV, eps, in);
    if (next < items) {  // every read of sq, sk and norms for this item was before delta_rule's barriers
      stash_qk(nxt, sq, sk);
      put_qk_norms(nxt, norms);
    }
    in = nxt;
    __syncthreads();  // red and sq_tile are the next item's; sq, sk and norms hold its q and k
  }
  mark<STAMP>(st, kLast);
  if (threadIdx.x == 0) bulk_wait<true>();   // the last states written before the block's shared memory goes
  if constexpr (STAMP) {
    if (threadIdx.x == 0) write_stamps(stamps, launch_id, st, k);
  }
}

struct GdnDims {
  int bsz, c_total, hk, dk, dv, hv;
  RowStrides ld;
};

// Checks of the recurrence's inputs (`mixed` is q|k|v after the conv, or before it for gdn_decode_step): mixed,
// z, b and a contiguous or matrices of contiguous rows (slices of one product over the packed projections).
GdnDims check_recurrence(const char* op, const at::Tensor& mixed, const at::Tensor& z, const at::Tensor& b,
                         const at::Tensor& a, const at::Tensor& recurrent_state, const at::Tensor& a_log,
                         const at::Tensor& dt_bias, const at::Tensor& norm_weight, int64_t num_k_heads,
                         int64_t head_k_dim, int64_t head_v_dim) {
  const auto dt = mixed.scalar_type();
  const RowStrides ld{check_rows_half(mixed, op, "qkv", dt), check_rows_half(z, op, "z", dt),
                      check_rows_half(b, op, "b", dt), check_rows_half(a, op, "a", dt)};
  check_cuda_half(norm_weight, op, "norm_weight", dt);
  TORCH_CHECK(recurrent_state.is_cuda() && recurrent_state.scalar_type() == at::kFloat &&
                  recurrent_state.is_contiguous(), op, ": recurrent_state must be a contiguous fp32 CUDA tensor");
  TORCH_CHECK(mixed.dim() == 2 && z.dim() == 2 && b.dim() == 2 && a.dim() == 2, op,
              ": qkv, z, b and a must be [B, width] matrices");
  GdnDims d{(int)mixed.size(0), (int)mixed.size(1), (int)num_k_heads, (int)head_k_dim, (int)head_v_dim, 0, ld};
  d.hv = (int)(z.size(1) / d.dv);
  TORCH_CHECK(d.c_total == 2 * d.hk * d.dk + d.hv * d.dv, op, ": qkv width ", d.c_total, " != 2*Hk*Dk + Hv*Dv");
  TORCH_CHECK(recurrent_state.sizes() == at::IntArrayRef({d.bsz, d.hv, d.dk, d.dv}), op, ": recurrent_state ",
              recurrent_state.sizes(), " != [B, Hv, Dk, Dv]");
  TORCH_CHECK(d.dk == 64 || d.dk == 128 || d.dk == 256, op, ": head_k_dim must be 64, 128 or 256");
  TORCH_CHECK(d.dv % 32 == 0 && d.dv <= 256 && d.hv % d.hk == 0, op,
              ": head_v_dim must be a multiple of 32 up to 256 (one cluster of Dv/32 <= 8 blocks per head)");
  TORCH_CHECK(a_log.is_cuda() && dt_bias.is_cuda(), op, ": A_log and dt_bias must be CUDA tensors");
  return d;
}

// Whether the recurrence streams its (row, value head) items through resident blocks (gdn_recurrent_pipe_kernel):
// 128 x 128 heads, as many items as SMs or more.
bool streamed(const GdnDims& d) {
  return d.dk == 128 && d.dv == 128 && d.bsz * d.hv >= sm_count();
}

// The step's conv inside the recurrence (gdn_decode_step): Qwen3.5's width 4 with 8-byte aligned windows and taps,
// and where the items are fewer than the SMs, the value heads of a key head within one cluster.
// SEGKI_GDN_CONV=split keeps the conv kernel before the recurrence.
struct ConvTensors {
  at::Tensor& state;
  const at::Tensor& weight;
  const c10::optional<at::Tensor>& bias;
};

constexpr int kPipeSlotBytes = 2 * 128 * 128 * 4;  // the streamed recurrence's two state slots
constexpr int kPipeConvBytes = 64 * 1024;          // and the most room it takes for its conv's outputs

// The streamed recurrence's conv outputs in a block (bytes, half types): its groups of a key head's value heads,
// at most ceil(groups / SMs), of 2 Dk + (Hv / Hk) Dv values each (conv_block_items).
int streamed_conv_bytes(const GdnDims& d) {
  const int sms = sm_count(), groups = d.bsz * d.hk;
  return (groups + sms - 1) / sms * (2 * d.dk + d.hv / d.hk * d.dv) * 2;
}

bool conv_inside(const GdnDims& d, const ConvTensors& c) {
  static const bool split = env_is("SEGKI_GDN_CONV", "split");
  const auto aligned = [](const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 8 == 0; };
  const bool room = streamed(d) ? streamed_conv_bytes(d) <= kPipeConvBytes
                                : d.bsz * d.hv < sm_count() && (d.hv / d.hk) * (d.dv / 32) <= kMaxCluster;
  return !split && c.state.size(2) == 4 && aligned(c.state) && aligned(c.weight) && room;
}

// Launches the recurrence on `mixed` (after the conv; with `conv`, before it: the conv runs inside); returns
// [B, Hv*Dv].
at::Tensor launch_recurrence(const char* op, const GdnDims& d, const at::Tensor& mixed, const at::Tensor& z,
                             const at::Tensor& b, const at::Tensor& a, at::Tensor& recurrent_state,
                             const at::Tensor& a_log, const at::Tensor& dt_bias, const at::Tensor& norm_weight,
                             double norm_eps, const ConvTensors* conv = nullptr) {
  const auto dt = mixed.scalar_type();
  // Read the gate parameters where they are (no per-step cast kernels) when both share fp32 or the
  // activation dtype; any other mix is converted once per call.
  const auto pdt = a_log.scalar_type();
  const bool direct = pdt == dt_bias.scalar_type() && (pdt == at::kFloat || pdt == dt) && a_log.is_contiguous() &&
                      dt_bias.is_contiguous();
  const auto a_log_p = direct ? a_log : a_log.to(at::kFloat).contiguous();
  const auto dt_bias_p = direct ? dt_bias : dt_bias.to(at::kFloat).contiguous();
  const bool gates_fp32 = a_log_p.scalar_type() == at::kFloat;
  auto out = at::empty({d.bsz, d.hv * d.dv}, mixed.options());
  if (d.bsz == 0) return out;
  RowStrides ld = d.ld;
  ld.mixed = mixed.is_contiguous() ? d.c_total : mixed.stride(0);   // gdn_decode_step: the conv's own output
  c10::cuda::CUDAGuard guard(mixed.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  const int sms = sm_count(), items = d.bsz * d.hv;
  SEGKI_DISPATCH_HALF(dt, op, [&] {
    ConvArgs<T> ca{};
    if (conv) {
      ca.state = reinterpret_cast<T*>(conv->state.data_ptr());
      ca.w = reinterpret_cast<const T*>(conv->weight.data_ptr());
      ca.bias = conv->bias ? reinterpret_cast<const T*>(conv->bias->data_ptr()) : nullptr;
      ca.channels = d.c_total;
    }
    if (streamed(d)) {
      const StampTarget stamp = stamp_target(kGdnPipe, {d.bsz, d.dk, d.hv * d.dv, conv ? 1 : 0, sms, items, d.hv});
      const int bytes = kPipeSlotBytes + (conv ? streamed_conv_bytes(d) : 0);
      auto pick = [&](auto conv_const, auto stamp_const) {
        constexpr bool C = decltype(conv_const)::value, S = decltype(stamp_const)::value;
        allow_dynamic_smem<gdn_recurrent_pipe_kernel<T, C, S>>(kPipeSlotBytes + (C ? kPipeConvBytes : 0));
        return gdn_recurrent_pipe_kernel<T, C, S>;
      };
      auto stamped_or_not = [&](auto conv_const) {
        return stamp.buf ? pick(conv_const, std::true_type{}) : pick(conv_const, std::false_type{});
      };
      const auto kernel = conv ? stamped_or_not(std::true_type{}) : stamped_or_not(std::false_type{});
      launch_pdl_smem(kernel, dim3(sms), dim3(512), bytes, stream, dim3(1),
          reinterpret_cast<const T*>(mixed.data_ptr()), reinterpret_cast<const T*>(z.data_ptr()),
          reinterpret_cast<const T*>(b.data_ptr()), reinterpret_cast<const T*>(a.data_ptr()), ld,
          recurrent_state.data_ptr<float>(), static_cast<const void*>(a_log_p.data_ptr()),
          static_cast<const void*>(dt_bias_p.data_ptr()), gates_fp32,
          reinterpret_cast<const T*>(norm_weight.data_ptr()), reinterpret_cast<T*>(out.data_ptr()), d.hk, d.hv,
          (float)norm_eps, items, ca, stamp.buf, stamp.id);
      return;
    }
    auto launch = [&](auto dk_const) {
      constexpr int DK = decltype(dk_const)::value;
      // clusters of Dv/32 blocks, one per (value head, row), or with the conv of all a key head's value heads;
      // the timeline's instantiation while it stamps
      const dim3 grid(d.hv * (d.dv / 32), d.bsz), cluster((conv ? d.hv / d.hk : 1) * (d.dv / 32));
      const StampTarget stamp = stamp_target(kGdnRecurrence, {d.bsz, d.dk, d.hv * d.dv, conv ? 1 : 0,
                                                              grid.x * grid.y, d.dv / 32, d.hv});
      auto kernel = conv ? (stamp.buf ? gdn_recurrent_kernel<T, DK, true, true>
                                      : gdn_recurrent_kernel<T, DK, true, false>)
                         : (stamp.buf ? gdn_recurrent_kernel<T, DK, false, true>
                                      : gdn_recurrent_kernel<T, DK, false, false>);
      launch_pdl(kernel, grid, dim3(128), stream, cluster, reinterpret_cast<const T*>(mixed.data_ptr()),
          reinterpret_cast<const T*>(z.data_ptr()), reinterpret_cast<const T*>(b.data_ptr()),
          reinterpret_cast<const T*>(a.data_ptr()), ld, recurrent_state.data_ptr<float>(),
          static_cast<const void*>(a_log_p.data_ptr()), static_cast<const void*>(dt_bias_p.data_ptr()), gates_fp32,
          reinterpret_cast<const T*>(norm_weight.data_ptr()), reinterpret_cast<T*>(out.data_ptr()), d.hk, d.hv, d.dv,
          (float)norm_eps, ca, stamp.buf, stamp.id);
    };
    with_head_dim(d.dk, launch);
  });
  return out;
}

at::Tensor gdn_decode_step(const at::Tensor& qkv, const at::Tensor& z, const at::Tensor& b, const at::Tensor& a,
                           at::Tensor& conv_state, const at::Tensor& conv_weight,
                           const c10::optional<at::Tensor>& conv_bias, at::Tensor& recurrent_state,
                           const at::Tensor& a_log, const at::Tensor& dt_bias, const at::Tensor& norm_weight,
                           double norm_eps, int64_t num_k_heads, int64_t head_k_dim, int64_t head_v_dim) {
  const char* op = "segki::gdn_decode_step";
  const auto d = check_recurrence(op, qkv, z, b, a, recurrent_state, a_log, dt_bias, norm_weight, num_k_heads,
                                  head_k_dim, head_v_dim);
  const auto dt = qkv.scalar_type();
  check_cuda_half(conv_weight, op, "input", dt);
  check_cuda_half(conv_state, op, "conv_state", dt);
  if (conv_bias) check_cuda_half(*conv_bias, op, "conv_bias", dt);
  const int width = (int)conv_state.size(2);
  TORCH_CHECK(width <= kMaxConvWidth && conv_weight.size(0) == d.c_total && conv_weight.size(1) == width, op,
              ": conv weight ", conv_weight.sizes(), " / state ", conv_state.sizes(), " mismatch (width <= 8)");
  TORCH_CHECK(conv_state.sizes() == at::IntArrayRef({d.bsz, d.c_total, width}), op, ": conv_state ",
              conv_state.sizes(), " != [B, C, width]: one conv window per row of qkv and channel");
  const ConvTensors conv{conv_state, conv_weight, conv_bias};
  if (d.bsz > 0 && conv_inside(d, conv))
    return launch_recurrence(op, d, qkv, z, b, a, recurrent_state, a_log, dt_bias, norm_weight, norm_eps, &conv);
  auto mixed = at::empty(qkv.sizes(), qkv.options());   // contiguous, whatever qkv's row stride
  if (d.bsz > 0) {
    c10::cuda::CUDAGuard guard(qkv.device());
    const dim3 grid((d.c_total + 255) / 256, d.bsz);
    const StampTarget stamp = stamp_target(kGdnConv, {d.bsz, width, d.c_total, 0, grid.x * grid.y, 0, 0});
    SEGKI_DISPATCH_HALF(dt, op, [&] {
      launch_pdl(stamp.buf ? gdn_conv_kernel<T, true> : gdn_conv_kernel<T, false>, grid, dim3(256),
          at::cuda::getCurrentCUDAStream(), dim3(1),
          reinterpret_cast<const T*>(qkv.data_ptr()), d.ld.mixed, reinterpret_cast<T*>(conv_state.data_ptr()),
          reinterpret_cast<const T*>(conv_weight.data_ptr()),
          conv_bias ? reinterpret_cast<const T*>(conv_bias->data_ptr()) : nullptr,
          reinterpret_cast<T*>(mixed.data_ptr()), d.c_total, width, stamp.buf, stamp.id);
    });
  }
  return launch_recurrence(op, d, mixed, z, b, a, recurrent_state, a_log, dt_bias, norm_weight, norm_eps);
}

at::Tensor gdn_recurrent_step(const at::Tensor& mixed, const at::Tensor& z, const at::Tensor& b, const at::Tensor& a,
                              at::Tensor& recurrent_state, const at::Tensor& a_log, const at::Tensor& dt_bias,
                              const at::Tensor& norm_weight, double norm_eps, int64_t num_k_heads,
                              int64_t head_k_dim, int64_t head_v_dim) {
  const char* op = "segki::gdn_recurrent_step";
  const auto d = check_recurrence(op, mixed, z, b, a, recurrent_state, a_log, dt_bias, norm_weight, num_k_heads,
                                  head_k_dim, head_v_dim);
  return launch_recurrence(op, d, mixed, z, b, a, recurrent_state, a_log, dt_bias, norm_weight, norm_eps);
}

}  // namespace

TORCH_LIBRARY_IMPL(segki, CUDA, m) {
  m.impl("gdn_decode_step", &gdn_decode_step);
  m.impl("gdn_recurrent_step", &gdn_recurrent_step);
}

}  // namespace segki
