// The tail of a pre-norm decoder layer at a decode step (1-4 rows), after its mixer's core, in ONE launch:
//
//   h   = residual + core @ W_out^T                 op 0   [M, H]
//   a   = SiLU(n @ W_gate^T) * (n @ W_up^T),        op 1   [M, I]   n = RMSNorm(h) (post-attention norm)
//   out = h + a @ W_down^T                          op 2   [M, H]
//
// Separately these are three copy-engine GEMVs (gemv.cu), each paying its own launch ramp and tail on 4-17 MB of
// weights (0.8B: 3.3 + 5.9 + 3.9 us for 26 MB, ~6.3 us at copy bandwidth). Here one persistent block per SM
// streams its share of ALL three weights through one ring of 32 KB copy-engine slots: the weights depend on
// nothing, so the first slots are requested before the PDL wait and the ring is refilled across the ops'
// boundaries, where the blocks only wait for each other's rows (an arrival counter per op) before computing.
// The chunks are the copy-engine GEMV's (the same rows per chunk, the same K parts, stage_x's norm, store_out's
// roundings), so the outputs are bit-identical to the three launches where those run on the copy-engine path.
//
// Chunks of the three ops are dealt to the blocks round-robin in op order, so every block streams the same number
// of chunks within one. A block needs every other block resident to pass a boundary: the grid is one block per SM
// and the kernel is launched on one stream at a time (the decode step's), never beside another persistent grid.
#include "bulk.cuh"
#include "common.cuh"
#include "gemv.cuh"

#include <atomic>

namespace segki {
namespace {

constexpr int kTailOps = 3;
constexpr int kTailMaxRows = 4;
constexpr int kTailMaxSlots = 8;
constexpr int kTailSmemBytes = 220 * 1024;  // x and the ring, at most: one block per SM
constexpr long kSmemPerSm = 228 * 1024, kSmemPerBlock = 3 * 1024;  // an SM's shared memory; a block's static + reserve
// Counters per launch site: consecutive launches take consecutive groups (round-robin), so a launch never meets
// a counter that the launch before it in the stream may still be resetting.
constexpr int kTailGroups = 64;

__device__ unsigned int g_tail_arrivals[kTailGroups][kTailOps];

template <typename T>
struct TailArgs {
  GemvArgs<T> op[kTailOps];  // out_proj (+ residual), gate|up (+ the norm prologue), down (+ residual h)
  int rpc[kTailOps];         // weight rows per chunk (gate and up rows each, for op 1)
  int chunks[kTailOps];      // chunks of each op
  int first[kTailOps];       // the chunk of each op that goes to block 0 (dealt round-robin over the ops)
  int range;                 // chunks dealt as contiguous ranges per block and op, not round-robin
  int slots;                 // ring slots of kBulkChunkBytes
  int x_elems;               // shared x's capacity (the widest op's m * K, rounded up to 128 bytes)
  int group;                 // this launch's counters
};

// The chunks of op `op` that block b computes: round-robin, c = begin, begin + G, ... below chunks[op] (consecutive
// chunks of a block lie G chunks apart); or a contiguous range [begin, end) with step 1.
template <typename T>
__device__ __forceinline__ int chunk_begin(const TailArgs<T>& t, int op) {
  const int g = (int)gridDim.x;
  if (t.range) return (int)((long long)blockIdx.x * t.chunks[op] / g);
  return ((int)blockIdx.x - t.first[op] % g + g) % g;
}

template <typename T>
__device__ __forceinline__ int chunk_end(const TailArgs<T>& t, int op) {
  return t.range ? (int)((long long)(blockIdx.x + 1) * t.chunks[op] / gridDim.x) : t.chunks[op];
}

template <typename T>
__device__ __forceinline__ int chunk_step(const TailArgs<T>& t) {
  return t.range ? 1 : (int)gridDim.x;
}

template <typename T>
__device__ __forceinline__ BulkChunk tail_chunk(const TailArgs<T>& t, const GemvArgs<T>& a, int op, int c) {
  // gemv_bulk_kernel's rows for its block c of chunks[op] (one chunk per block): the same rows, so the same K parts
  const int row = (int)((long long)c * a.n[0] / t.chunks[op]);
  return BulkChunk{0, row, (int)((long long)(c + 1) * a.n[0] / t.chunks[op]) - row};
}

// Thread 0's walk over the block's chunks in op order: the next one to request.
template <typename T>
struct Feeder {
  int op, c;

  __device__ __forceinline__ void settle(const TailArgs<T>& t) {
    while (op < kTailOps && c >= chunk_end(t, op)) {
      ++op;
      if (op < kTailOps) c = chunk_begin(t, op);
    }
  }

  // Requests the next chunk into `slot` (nothing once every chunk is requested).
  __device__ __forceinline__ void issue(const TailArgs<T>& t, T* slot, uint64_t* full) {
    settle(t);
    if (op == 0) bulk_issue<T, Epilogue::Plain>(t.op[0], tail_chunk(t, t.op[0], 0, c), slot, full);
    else if (op == 1) bulk_issue<T, Epilogue::SiluMul>(t.op[1], tail_chunk(t, t.op[1], 1, c), slot, full);
    else if (op == 2) bulk_issue<T, Epilogue::Plain>(t.op[2], tail_chunk(t, t.op[2], 2, c), slot, full);
    else return;
    c += chunk_step(t);
  }
};

// Op OP's chunks of this block, as gemv_bulk_kernel computes one chunk: x in shared memory, the chunk's rows in
// ring slot `seq % slots`, a row per warp or its K parts over idle warps; each consumed slot is refilled with the
// block's next chunk, whichever op it belongs to.
template <typename T, int MAXM, Epilogue EPI, int OP>
__device__ __forceinline__ void tail_op(const TailArgs<T>& t, const T* xs, T* ring, uint64_t* full,
                                        float (*red)[EPI == Epilogue::SiluMul ? 2 : 1][MAXM], int& seq,
                                        Feeder<T>& feed) {
  constexpr int NACC = EPI == Epilogue::SiluMul ? 2 : 1;
  constexpr bool kFresh = OP == 2;  // down's residual is op 0's output
  const GemvArgs<T>& a = t.op[OP];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const size_t slot_elems = kBulkChunkBytes / sizeof(T);
  const int end = chunk_end(t, OP), step = chunk_step(t);
  for (int c = chunk_begin(t, OP); c < end; c += step, ++seq) {
    const BulkChunk ch = tail_chunk(t, a, OP, c);
    int parts = 1;  // warps per row: the chunk's rows share the 8 warps
    while (parts * 2 * ch.rows <= kWarps) parts *= 2;
    const int part = warp % parts, first = warp / parts, stride = kWarps / parts;
    const int slot = seq % t.slots;
    if constexpr (OP == 0)  // the residual is the layer's input, from an earlier kernel
      if (part == 0 && lane < a.m)
        for (int r = first; r < ch.rows; r += stride) prefetch_epilogue<T>(a, 0, ch.row + r, lane);
    mbar_wait(&full[slot], (unsigned)(seq / t.slots) & 1u);
    const T* w = ring + slot * slot_elems;
    for (int r = first; r < ch.rows; r += stride) {
      float acc[NACC][MAXM] = {};
      const T* rows[NACC];
      rows[0] = w + (size_t)r * a.k;
      if constexpr (EPI == Epilogue::SiluMul) rows[NACC - 1] = w + (size_t)(ch.rows + r) * a.k;
      smem_row_dot<T, MAXM, NACC>(rows, xs, a.m, a.k, part, parts, acc);
      if (parts == 1) {
        if (lane < a.m) store_out<T, EPI, kFresh>(a, 0, ch.row + r, lane, lane_value(acc[0], lane),
                                                  lane_value(acc[NACC - 1], lane));
      } else if (lane == 0) {
#pragma unroll
        for (int cc = 0; cc < NACC; ++cc)
#pragma unroll
          for (int rr = 0; rr < MAXM; ++rr) red[warp][cc][rr] = acc[cc][rr];
      }
    }
    __syncthreads();  // the slot is read, the parts are in `red`
    if (parts > 1 && part == 0 && first < ch.rows && lane < a.m) {
      float v[NACC];
#pragma unroll
      for (int cc = 0; cc < NACC; ++cc) {
        v[cc] = 0.f;
        for (int p = 0; p < parts; ++p) v[cc] += red[warp + p][cc][lane];
      }
      store_out<T, EPI, kFresh>(a, 0, ch.row + first, lane, v[0], v[NACC - 1]);
    }
    if (threadIdx.x == 0) feed.issue(t, ring + slot * slot_elems, &full[slot]);
    if (parts > 1) __syncthreads();  // `red` is read before the next chunk writes it
  }
}

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Every block has stored its rows of op `op` (the block's stores made visible GPU-wide, then its arrival).
__device__ __forceinline__ void arrive(unsigned* counter) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(counter, 1u);
  }
}

__device__ __forceinline__ void wait_all(const unsigned* counter) {
  if (threadIdx.x == 0)
    while (ld_acquire(counter) < gridDim.x) {
    }
  __syncthreads();
}

// (three blocks' worth of registers: SEGKI_TAIL_BLOCKS up to 3 per SM)
template <typename T, int MAXM>
__global__ void __launch_bounds__(kWarps * 32, 3) layer_tail_kernel(const __grid_constant__ TailArgs<T> t) {
  extern __shared__ __align__(128) unsigned char tail_smem[];  // x [m][K], then the ring [slots][32 KB]
  __shared__ __align__(8) uint64_t full[kTailMaxSlots];
  __shared__ float red[kWarps][2][MAXM];
  __shared__ float norm_scratch[MAXM][32];
  T* xs = reinterpret_cast<T*>(tail_smem);
  T* ring = xs + t.x_elems;
  const size_t slot_elems = kBulkChunkBytes / sizeof(T);
  Feeder<T> feed{0, chunk_begin(t, 0)};
  if (threadIdx.x == 0) {  // weights only: safe before the wait
    for (int s = 0; s < t.slots; ++s) mbar_init(&full[s]);
    bulk_fence_init();
    for (int s = 0; s < t.slots; ++s) feed.issue(t, ring + s * slot_elems, &full[s]);
  }
  // the norm prologue's first weights (a parameter: safe before the wait)
  const GemvArgs<T>& mlp = t.op[1];
  const uint4 w0 = threadIdx.x * 8 < mlp.k ? ld_cached(mlp.norm_w + threadIdx.x * 8) : make_uint4(0, 0, 0, 0);
  pdl_launch_dependents();
  pdl_wait();
  unsigned* counters = g_tail_arrivals[t.group];
  int seq = 0;
  stage_x<T, MAXM>(t.op[0], xs, norm_scratch, w0);  // the mixer's core (no norm)
  __syncthreads();  // x is in place and the barriers are initialized before any thread waits on them
  tail_op<T, MAXM, Epilogue::Plain, 0>(t, xs, ring, full, reinterpret_cast<float(*)[1][MAXM]>(red), seq, feed);
  arrive(&counters[0]);
  wait_all(&counters[0]);
  stage_x<T, MAXM, true>(mlp, xs, norm_scratch, w0);  // h, through the post-attention norm
  __syncthreads();
  tail_op<T, MAXM, Epilogue::SiluMul, 1>(t, xs, ring, full, red, seq, feed);
  arrive(&counters[1]);
  wait_all(&counters[1]);
  stage_x<T, MAXM, true>(t.op[2], xs, norm_scratch, w0);  // the MLP's activations (no norm)
  __syncthreads();
  tail_op<T, MAXM, Epilogue::Plain, 2>(t, xs, ring, full, reinterpret_cast<float(*)[1][MAXM]>(red), seq, feed);
  // the last block to finish resets this group's counters: every block has passed every wait by then
  if (threadIdx.x == 0 && atomicAdd(&counters[2], 1u) == gridDim.x - 1) {
    counters[0] = 0;
    counters[1] = 0;
    counters[2] = 0;
    __threadfence();
  }
}

// Measurement switches: ring slots per block (SEGKI_TAIL_SLOTS, 2-8; default 4, as many as fit beside x), blocks
// per SM (SEGKI_TAIL_BLOCKS, 1-3; default 1) and the deal of chunks to blocks (SEGKI_TAIL_DEAL=range: contiguous
// per block and op; default round-robin). Fewer slots leave room on each SM for a block of the next kernel, more
// keep more of the layer's weights in flight.
constexpr int kTailMinSlots = 2;

inline int tail_slots() {
  static const int slots = (int)env_long("SEGKI_TAIL_SLOTS", 4, kTailMinSlots, kTailMaxSlots);
  return slots;
}

inline int tail_blocks_per_sm() {
  static const int blocks = (int)env_long("SEGKI_TAIL_BLOCKS", 1, 1, 3);
  return blocks;
}

// Consecutive launches take consecutive counter groups.
inline int next_tail_group() {
  static std::atomic<int> next{0};
  return next.fetch_add(1, std::memory_order_relaxed) % kTailGroups;
}

// The plan for x [m, K] through these weights, or false where the kernel cannot take them (the caller, ops/
// dispatch.py's tail_fits, mirrors this rule): at most kTailMaxRows rows, every weight row (gate and up rows
// together) within one slot, x and the ring within kTailSmemBytes, 16-byte aligned weights, sm_90.
template <typename T>
bool tail_plan(TailArgs<T>& t, long& smem) {
  if (at::cuda::getCurrentDeviceProperties()->major < 9 || t.op[0].m > kTailMaxRows) return false;
  long x_bytes = 0;
  int total = 0;
  for (int i = 0; i < kTailOps; ++i) {
    const GemvArgs<T>& a = t.op[i];
    const long row_bytes = (long)a.k * sizeof(T) * (i == 1 ? 2 : 1);
    if (row_bytes > kBulkChunkBytes || a.k % 8 != 0) return false;
    for (int j = 0; j < a.nw; ++j)
      if (reinterpret_cast<uintptr_t>(a.w[j]) % 16 != 0) return false;
    t.rpc[i] = (int)(kBulkChunkBytes / row_bytes);
    t.chunks[i] = (a.n[0] + t.rpc[i] - 1) / t.rpc[i];
    t.first[i] = total;
    total += t.chunks[i];
    x_bytes = std::max<long>(x_bytes, ((long)a.m * a.k * (long)sizeof(T) + 127) / 128 * 128);
  }
  t.x_elems = (int)(x_bytes / sizeof(T));
  const long budget = std::min<long>(kTailSmemBytes, kSmemPerSm / tail_blocks_per_sm() - kSmemPerBlock);
  t.slots = (int)std::min<long>(tail_slots(), (budget - x_bytes) / kBulkChunkBytes);
  t.range = env_is("SEGKI_TAIL_DEAL", "range");
  smem = x_bytes + (long)t.slots * kBulkChunkBytes;
  return t.slots >= kTailMinSlots;
}

template <typename T>
void launch_tail(const TailArgs<T>& t, long smem) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount * tail_blocks_per_sm();
  auto stream = at::cuda::getCurrentCUDAStream();
#define SEGKI_TAIL_CASE(M)                                                                                    \
  if (t.op[0].m <= M) {                                                                                      \
    allow_dynamic_smem<layer_tail_kernel<T, M>>(kTailSmemBytes);                                             \
    launch_pdl_smem(layer_tail_kernel<T, M>, dim3(sms), dim3(kWarps * 32), (size_t)smem, stream, dim3(1), t); \
    return;                                                                                                  \
  }
  SEGKI_TAIL_CASE(1) SEGKI_TAIL_CASE(2) SEGKI_TAIL_CASE(4)
#undef SEGKI_TAIL_CASE
}

template <typename T>
void fill_op(GemvArgs<T>& a, const at::Tensor& x, int m, std::initializer_list<const at::Tensor*> ws, T* out,
             const at::Tensor* residual) {
  a.x = reinterpret_cast<const T*>(x.data_ptr());
  a.m = m;
  a.k = (int)x.size(-1);
  a.nw = (int)ws.size();
  int i = 0;
  for (const at::Tensor* w : ws) {
    a.w[i] = reinterpret_cast<const T*>(w->data_ptr());
    a.n[i] = (int)w->size(0);
    ++i;
  }
  a.out[0] = out;
  a.residual = residual ? reinterpret_cast<const T*>(residual->data_ptr()) : nullptr;
}

at::Tensor layer_tail(const at::Tensor& core, const at::Tensor& w_out, const c10::optional<at::Tensor>& b_out,
                      const at::Tensor& residual, const at::Tensor& norm_w, double norm_eps, bool norm_unit_offset,
                      const at::Tensor& w_gate, const at::Tensor& w_up, const at::Tensor& w_down) {
  const char* op = "segki::layer_tail";
  TORCH_CHECK(core.is_cuda() && core.dim() == 2 && core.is_contiguous(), op,
              ": core must be a contiguous CUDA matrix [M, K] (the mixer's output before its projection)");
  const auto dtype = core.scalar_type();
  const std::pair<const at::Tensor*, const char*> named[] = {
      {&w_out, "w_out"}, {&residual, "residual"}, {&norm_w, "norm_w"}, {&w_gate, "w_gate"}, {&w_up, "w_up"},
      {&w_down, "w_down"}};
  for (const auto& [t, name] : named) {
    check_cuda_half(*t, op, name, dtype);
    TORCH_CHECK(t->is_contiguous(), op, ": ", name, " must be contiguous");
  }
  TORCH_CHECK(!b_out.has_value(), op, ": an output projection with a bias is not supported here; call "
              "segki_lightning.ops.layer_tail, which composes the separate projections for it");
  const int64_t m = core.size(0), h = w_out.size(0), inter = w_gate.size(0);
  TORCH_CHECK(m >= 1 && m <= kTailMaxRows, op, ": ", m, " rows; the layer tail takes 1 to ", kTailMaxRows,
              " (decode rows); use the separate projections beyond");
  TORCH_CHECK(w_out.dim() == 2 && w_out.size(1) == core.size(1), op, ": w_out ", w_out.sizes(), " must be [H, ",
              core.size(1), "]");
  TORCH_CHECK(residual.sizes() == at::IntArrayRef({m, h}), op, ": residual ", residual.sizes(), " must be [", m,
              ", ", h, "]");
  TORCH_CHECK(norm_w.dim() == 1 && norm_w.size(0) == h, op, ": norm_w ", norm_w.sizes(), " must be [", h, "]");
  TORCH_CHECK(w_gate.dim() == 2 && w_gate.size(1) == h && w_up.sizes() == w_gate.sizes(), op, ": w_gate ",
              w_gate.sizes(), " and w_up ", w_up.sizes(), " must both be [I, ", h, "]");
  TORCH_CHECK(w_down.sizes() == at::IntArrayRef({h, inter}), op, ": w_down ", w_down.sizes(), " must be [", h,
              ", ", inter, "]");
  c10::cuda::CUDAGuard guard(core.device());
  auto hid = at::empty({m, h}, core.options());        // op 0's rows, then down's residual
  auto act = at::empty({m, inter}, core.options());    // op 1's rows
  auto out = at::empty({m, h}, core.options());
  SEGKI_DISPATCH_HALF(dtype, op, [&] {
    TailArgs<T> t{};
    fill_op<T>(t.op[0], core, (int)m, {&w_out}, reinterpret_cast<T*>(hid.data_ptr()), &residual);
    fill_op<T>(t.op[1], hid, (int)m, {&w_gate, &w_up}, reinterpret_cast<T*>(act.data_ptr()), nullptr);
    t.op[1].norm_w = reinterpret_cast<const T*>(norm_w.data_ptr());
    t.op[1].norm_eps = (float)norm_eps;
    t.op[1].norm_unit_offset = norm_unit_offset;
    fill_op<T>(t.op[2], act, (int)m, {&w_down}, reinterpret_cast<T*>(out.data_ptr()), &hid);
    long smem = 0;
    TORCH_CHECK(tail_plan<T>(t, smem), op, ": these shapes do not fit the layer tail kernel (an sm_90 GPU, rows ",
                "of at most 32 KB, x and ", kTailMinSlots, " slots of 32 KB within ", kTailSmemBytes, " bytes of ",
                "shared memory, 16-byte aligned weights); ops.layer_tail composes the separate projections for them");
    t.group = next_tail_group();
    launch_tail<T>(t, smem);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(segki, CUDA, m) { m.impl("layer_tail", &layer_tail); }

}  // namespace segki
