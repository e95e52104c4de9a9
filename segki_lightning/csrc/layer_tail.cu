// The tail of a pre-norm decoder layer at a decode step (1-4 rows), after its mixer's core, in ONE launch:
//
//   h   = residual + core @ W_out^T                 op 0   [M, H]
//   a   = SiLU(n @ W_gate^T) * (n @ W_up^T),        op 1   [M, I]   n = RMSNorm(h) (post-attention norm)
//   out = h + a @ W_down^T                          op 2   [M, H]
//
// Separately these are three copy-engine GEMVs (gemv.cu), each paying its own launch ramp and tail on 4-17 MB of
// weights (0.8B: 13.6 us for 26 MB, ~6.3 us at copy bandwidth). Here one persistent block per SM streams its share
// of ALL three weights through one ring of copy-engine slots: the weights depend on nothing, so the first slots
// are requested before the PDL wait and the ring is refilled across the ops' boundaries, where the blocks only
// wait for each other's rows (an arrival counter per op) before computing.
//
// A slot holds one tile: 16 weight rows (op 1: 8 gate rows and the same 8 up rows) x one part of K (at most 1024
// columns), which the 8 warps multiply on the tensor cores (mma.m16n8k16 with x's rows as B's columns, the tile
// read by ldmatrix): ~10x fewer instructions per byte than the CUDA-core dot products, which limited this design
// on them (`results/layer_tail/`: ~2.5 us per 26 KB slot; `results/mma_ring/`: a one-block-per-SM ring with this
// consumer streams at 109.6 % of copy bandwidth). Each op's (tile, part) slots are dealt to the blocks as
// contiguous ranges, so every block streams the same bytes within one slot; a tile whose parts span blocks is
// summed by the last of them to arrive (its pieces in part order through global memory: deterministic for a grid
// size). Other sums than the separate launches' (within the dtype's tolerance, not their bits); the roundings of
// the unfused layer (stage_x's norm, store_out's epilogues).
//
// A block needs every other block resident to pass a boundary: the grid is one block per SM, checked against the
// occupancy of the launch's own shared memory.
#include "bulk.cuh"
#include "common.cuh"
#include "gemv.cuh"

#include <atomic>

namespace segki {
namespace {

constexpr int kTailOps = 3;
constexpr int kTailMaxRows = 4;
constexpr int kTailMaxSlots = 8;
constexpr int kTailMinSlots = 2;
constexpr int kTileRows = 16;      // weight rows per tile: mma.m16n8k16's M
constexpr int kPartCols = 1024;    // K columns per slot, at most
constexpr int kRowSkew = 8;        // elements after each slot row: 16 bytes, so ldmatrix's 8 rows hit 8 bank groups
constexpr int kTailSmemBytes = 220 * 1024;  // x and the ring, at most
constexpr int kTailMaxTiles = 4096;         // tiles of one launch, all ops: the split tiles' arrival counters
// Counters per launch site: consecutive launches take consecutive groups (round-robin), so a launch never meets
// a counter that another launch may still be resetting.
constexpr int kTailGroups = 8;

__device__ unsigned int g_tail_arrivals[kTailGroups][kTailOps];
__device__ unsigned int g_tile_arrivals[kTailGroups][kTailMaxTiles];

struct OpPlan {
  int tiles, parts, kc;  // kc = K / parts columns per slot, a multiple of 16
  int tile_base;         // the op's first tile among all ops (its counters)
  int slot_base;         // the op's first slot among all ops (its pieces' place in the scratch)
};

template <typename T>
struct TailArgs {
  GemvArgs<T> op[kTailOps];  // out_proj (+ residual), gate|up (+ the norm prologue), down (+ residual h)
  OpPlan plan[kTailOps];
  int slots;                 // ring slots
  int slot_elems;            // a slot's elements: 16 rows of the widest part + skew
  int x_elems;               // shared x's capacity (the widest op's m * K, rounded up to 128 bytes)
  int group;                 // this launch's counters
  int deal_tiles;            // SEGKI_TAIL_DEAL=tiles: whole tiles per block (no tile split over blocks)
  float* scratch;            // [all slots][16][kTailMaxRows]: the pieces of tiles that span blocks
};

// Block b's slots of an op: [b S / G, (b + 1) S / G); and the block whose range holds slot q.
__device__ __forceinline__ int range_begin(int slots, int b) {
  return (int)((long long)b * slots / gridDim.x);
}

__device__ __forceinline__ int owner(int slots, int q) {
  return (int)(((long long)(q + 1) * gridDim.x - 1) / slots);
}

// Block b's slots of op `op`, [q0, q1): contiguous slots, or whole tiles under deal_tiles.
template <typename T>
__device__ __forceinline__ void op_range(const TailArgs<T>& t, int op, int b, int& q0, int& q1) {
  const OpPlan& p = t.plan[op];
  if (t.deal_tiles) {
    q0 = range_begin(p.tiles, b) * p.parts;
    q1 = range_begin(p.tiles, b + 1) * p.parts;
  } else {
    q0 = range_begin(p.tiles * p.parts, b);
    q1 = range_begin(p.tiles * p.parts, b + 1);
  }
}

// The number of blocks whose ranges hold parts of the tile whose first slot is q0: where the owner changes.
__device__ __forceinline__ bool piece_starts(int slots, int q0, int p) {
  return p == 0 || owner(slots, q0 + p) != owner(slots, q0 + p - 1);
}

__device__ __forceinline__ float ld_cg_f32(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}

// Weight row of tile row r: op 1 interleaves gate rows 0-7 and the same up rows 8-15.
__device__ __forceinline__ int tile_row(bool gated, int tile, int r) {
  return gated ? tile * 8 + (r & 7) : tile * kTileRows + r;
}

// Warp 0's walk over the block's slots in op order: lanes 0-15 request the next slot's 16 rows.
template <typename T>
struct Feeder {
  int op, q, end;

  __device__ __forceinline__ void settle(const TailArgs<T>& t) {
    while (op < kTailOps && q >= end) {
      ++op;
      if (op < kTailOps) op_range(t, op, blockIdx.x, q, end);
    }
  }

  __device__ __forceinline__ void issue(const TailArgs<T>& t, T* slot, uint64_t* full) {
    settle(t);
    if (op >= kTailOps) return;
    const GemvArgs<T>& a = t.op[op];
    const OpPlan& p = t.plan[op];
    const int tile = q / p.parts, part = q % p.parts, lane = threadIdx.x & 31;
    const bool gated = op == 1;
    const int per = gated ? 8 : kTileRows, left = a.n[0] - tile * per;
    const int valid = (left < per ? left : per) * (gated ? 2 : 1);
    if (lane == 0) mbar_expect(full, (unsigned)valid * p.kc * sizeof(T));
    __syncwarp();
    const int row = tile_row(gated, tile, lane);
    if (lane < kTileRows && row < a.n[0]) {
      const T* w = gated && lane >= 8 ? a.w[1] : a.w[0];
      bulk_load(slot + (size_t)lane * (p.kc + kRowSkew), w + (size_t)row * a.k + (size_t)part * p.kc,
                (unsigned)p.kc * sizeof(T), full);
    }
    ++q;
  }
};

// c += the slot's tile (16 rows x kc) . x's columns [col0, col0 + kc), the warp's k-steps w, w + 8, ... : C's
// column n is x row n (rows past m multiply zeros).
template <typename T>
__device__ __forceinline__ void mma_slot(const T* slot, int kc, const T* xs, int k, int col0, int m, float (&c)[4]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const T* arow = slot + ((lane & 7) + 8 * ((lane >> 3) & 1)) * (kc + kRowSkew) + 8 * (lane >> 4);
  const T* xrow = xs + (size_t)g * k + col0 + 2 * t;
  const bool has_x = g < m;
  for (int s = warp; s < kc / 16; s += kWarps) {
    uint32_t a[4];
    ldmatrix_x4(a, arow + s * 16);
    uint32_t b0 = 0, b1 = 0;
    if (has_x) {
      b0 = *reinterpret_cast<const uint32_t*>(xrow + s * 16);
      b1 = *reinterpret_cast<const uint32_t*>(xrow + s * 16 + 8);
    }
    mma16816<T>(c, a[0], a[1], a[2], a[3], b0, b1);
  }
}

// One 16-row, one-row-of-x sum as the epilogue reads it: over the warps' partial sums in `red`, or over a split
// tile's pieces in the scratch (each piece at its first part), in order either way.
struct TileSums {
  const float (*red)[kTileRows][kTailMaxRows];  // [warp][row][n], or nullptr
  const float* pieces;                          // the tile's first part in the scratch
  int parts, slots, q0;                         // q0: the tile's first slot in the op

  __device__ __forceinline__ float operator()(int row, int n) const {
    float s = 0.f;
    if (red) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) s += red[w][row][n];
      return s;
    }
    for (int p = 0; p < parts; ++p)
      if (piece_starts(slots, q0, p)) s += ld_cg_f32(pieces + (p * kTileRows + row) * kTailMaxRows + n);
    return s;
  }
};

template <typename T, int OP>
__device__ __forceinline__ void store_tile(const GemvArgs<T>& a, int tile, const TileSums& sum) {
  const int i = threadIdx.x;
  if constexpr (OP == 1) {
    if (i < 8 * a.m) store_out<T, Epilogue::SiluMul>(a, 0, tile * 8 + i % 8, i / 8, sum(i % 8, i / 8),
                                                      sum(i % 8 + 8, i / 8));
  } else {
    if (i < kTileRows * a.m) {
      const float v = sum(i % kTileRows, i / kTileRows);
      store_out<T, Epilogue::Plain, OP == 2>(a, 0, tile * kTileRows + i % kTileRows, i / kTileRows, v, v);
    }
  }
}

// The end of a piece (a tile's consecutive parts in this block): the warps' sums are in `red`. A whole tile is
// stored; a piece of a split tile goes to the scratch, and the last of the tile's blocks to arrive stores it.
template <typename T, int OP>
__device__ __forceinline__ void finish_piece(const TailArgs<T>& t, const float (*red)[kTileRows][kTailMaxRows],
                                             int tile, int first_part, int last_part, unsigned* tiles_arrived,
                                             int* is_last) {
  const GemvArgs<T>& a = t.op[OP];
  const OpPlan& p = t.plan[OP];
  const int slots = p.tiles * p.parts, q0 = tile * p.parts;
  if (first_part == 0 && last_part == p.parts - 1) {
    store_tile<T, OP>(a, tile, TileSums{red, nullptr, 0, 0, 0});
    return;
  }
  float* pieces = t.scratch + (size_t)(p.slot_base + q0) * kTileRows * kTailMaxRows;
  const int i = threadIdx.x;
  if (i < kTileRows * a.m)
    pieces[(first_part * kTileRows + i % kTileRows) * kTailMaxRows + i / kTileRows] =
        TileSums{red, nullptr, 0, 0, 0}(i % kTileRows, i / kTileRows);
  __syncthreads();
  if (i == 0) {
    __threadfence();
    unsigned blocks = 0;
    for (int pp = 0; pp < p.parts; ++pp) blocks += piece_starts(slots, q0, pp);
    unsigned* counter = tiles_arrived + p.tile_base + tile;
    *is_last = atomicAdd(counter, 1u) == blocks - 1;
    if (*is_last) *counter = 0;  // every other piece has arrived: reset for the next launch of this group
    __threadfence();
  }
  __syncthreads();
  if (*is_last) store_tile<T, OP>(a, tile, TileSums{nullptr, pieces, p.parts, slots, q0});
}

// Op OP's slots of this block: wait for the slot, multiply it, refill it with the block's next slot whichever op
// that belongs to, and finish each piece.
template <typename T, int OP>
__device__ __forceinline__ void tail_op(const TailArgs<T>& t, const T* xs, T* ring, uint64_t* full,
                                        float (*red)[kWarps][kTileRows][kTailMaxRows], int& seq, int& pieces_done,
                                        Feeder<T>& feed, unsigned* tiles_arrived, int* is_last) {
  const GemvArgs<T>& a = t.op[OP];
  const OpPlan& p = t.plan[OP];
  int q0, q1;
  op_range(t, OP, blockIdx.x, q0, q1);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, n0 = 2 * (lane & 3);
  float c[4] = {0.f, 0.f, 0.f, 0.f};
  int first_part = -1;
  for (int q = q0; q < q1; ++q, ++seq) {
    const int tile = q / p.parts, part = q % p.parts, slot = seq % t.slots;
    if (first_part < 0) first_part = part;
    mbar_wait(&full[slot], (unsigned)(seq / t.slots) & 1u);
    T* s = ring + (size_t)slot * t.slot_elems;
    mma_slot<T>(s, p.kc, xs, a.k, part * p.kc, a.m, c);
    const bool piece_end = part == p.parts - 1 || q == q1 - 1;
    float (*r)[kTileRows][kTailMaxRows] = red[pieces_done & 1];
    if (piece_end) {  // c: rows g, g + 8 x columns n0, n0 + 1 (x rows past m hold zeros and are not kept)
      if (n0 < a.m) {
        r[warp][g][n0] = c[0];
        r[warp][g + 8][n0] = c[2];
      }
      if (n0 + 1 < a.m) {
        r[warp][g][n0 + 1] = c[1];
        r[warp][g + 8][n0 + 1] = c[3];
      }
      c[0] = c[1] = c[2] = c[3] = 0.f;
    }
    __syncthreads();  // the slot is read; the piece's sums are in `r`
    if (warp == 0) feed.issue(t, s, &full[slot]);
    if (piece_end) {
      finish_piece<T, OP>(t, r, tile, first_part, part, tiles_arrived, is_last);
      first_part = -1;
      ++pieces_done;  // the next piece writes the other buffer, so no barrier guards this one's readers
    }
  }
}

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Every block has stored its rows of an op (the block's stores made visible GPU-wide, then its arrival).
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

template <typename T, int MAXM>
__global__ void __launch_bounds__(kWarps * 32, 1) layer_tail_kernel(const __grid_constant__ TailArgs<T> t) {
  extern __shared__ __align__(128) unsigned char tail_smem[];  // x [m][K], then the ring [slots][16][kc + skew]
  __shared__ __align__(8) uint64_t full[kTailMaxSlots];
  __shared__ float red[2][kWarps][kTileRows][kTailMaxRows];
  __shared__ float norm_scratch[MAXM][32];
  __shared__ int is_last;
  T* xs = reinterpret_cast<T*>(tail_smem);
  T* ring = xs + t.x_elems;
  Feeder<T> feed{-1, 0, 0};
  if (threadIdx.x < 32) {  // weights only: safe before the wait
    if (threadIdx.x == 0) {
      for (int s = 0; s < t.slots; ++s) mbar_init(&full[s]);
      bulk_fence_init();
    }
    __syncwarp();
    for (int s = 0; s < t.slots; ++s) feed.issue(t, ring + (size_t)s * t.slot_elems, &full[s]);
  }
  // the norm prologue's first weights (a parameter: safe before the wait)
  const GemvArgs<T>& mlp = t.op[1];
  const uint4 w0 = threadIdx.x * 8 < mlp.k ? ld_cached(mlp.norm_w + threadIdx.x * 8) : make_uint4(0, 0, 0, 0);
  pdl_launch_dependents();
  pdl_wait();
  unsigned* counters = g_tail_arrivals[t.group];
  unsigned* tiles_arrived = g_tile_arrivals[t.group];
  int seq = 0, pieces_done = 0;
  stage_x<T, MAXM>(t.op[0], xs, norm_scratch, w0);  // the mixer's core (no norm)
  __syncthreads();  // x is in place and the barriers are initialized before any thread waits on them
  tail_op<T, 0>(t, xs, ring, full, red, seq, pieces_done, feed, tiles_arrived, &is_last);
  arrive(&counters[0]);
  wait_all(&counters[0]);
  stage_x<T, MAXM, true>(mlp, xs, norm_scratch, w0);  // h, through the post-attention norm
  __syncthreads();
  tail_op<T, 1>(t, xs, ring, full, red, seq, pieces_done, feed, tiles_arrived, &is_last);
  arrive(&counters[1]);
  wait_all(&counters[1]);
  stage_x<T, MAXM, true>(t.op[2], xs, norm_scratch, w0);  // the MLP's activations (no norm)
  __syncthreads();
  tail_op<T, 2>(t, xs, ring, full, red, seq, pieces_done, feed, tiles_arrived, &is_last);
  // the last block to finish resets this group's counters: every block has passed every wait by then
  __syncthreads();
  if (threadIdx.x == 0 && atomicAdd(&counters[2], 1u) == gridDim.x - 1) {
    counters[0] = 0;
    counters[1] = 0;
    counters[2] = 0;
    __threadfence();
  }
}

// Ring slots per block (SEGKI_TAIL_SLOTS, 2-8; default 4): fewer leave room on each SM for a block of the next
// kernel, more keep more of the layer's weights in flight.
inline int tail_slots() {
  static const int slots = (int)env_long("SEGKI_TAIL_SLOTS", 4, kTailMinSlots, kTailMaxSlots);
  return slots;
}

// Consecutive launches take consecutive counter groups.
inline int next_tail_group() {
  static std::atomic<int> next{0};
  return next.fetch_add(1, std::memory_order_relaxed) % kTailGroups;
}

// Parts of K per tile: the fewest with at most kPartCols columns each and a whole number of 16-column k-steps
// (0: K is not a multiple of 16).
int tail_parts(int k) {
  if (k <= 0 || k % 16 != 0) return 0;
  for (int p = (k + kPartCols - 1) / kPartCols;; ++p)
    if (k % (16 * p) == 0) return p;
}

// The plan for these shapes, or false where the kernel cannot take them (the caller, ops/dispatch.py's
// tail_fits, mirrors this rule): 1 to kTailMaxRows rows, every K a multiple of 16, at most kTailMaxTiles tiles, x
// and kTailMinSlots slots within kTailSmemBytes, 16-byte aligned weights, sm_90.
template <typename T>
bool tail_plan(TailArgs<T>& t, long& smem, long& scratch_floats) {
  if (at::cuda::getCurrentDeviceProperties()->major < 9 || t.op[0].m > kTailMaxRows) return false;
  long x_bytes = 0;
  int tiles = 0, slots = 0, kc_max = 0;
  for (int i = 0; i < kTailOps; ++i) {
    const GemvArgs<T>& a = t.op[i];
    OpPlan& p = t.plan[i];
    p.parts = tail_parts(a.k);
    if (p.parts == 0) return false;
    for (int j = 0; j < a.nw; ++j)
      if (reinterpret_cast<uintptr_t>(a.w[j]) % 16 != 0) return false;
    p.kc = a.k / p.parts;
    p.tiles = (a.n[0] + (i == 1 ? 7 : 15)) / (i == 1 ? 8 : 16);
    p.tile_base = tiles;
    p.slot_base = slots;
    tiles += p.tiles;
    slots += p.tiles * p.parts;
    kc_max = std::max(kc_max, p.kc);
    x_bytes = std::max<long>(x_bytes, ((long)a.m * a.k * (long)sizeof(T) + 127) / 128 * 128);
  }
  if (tiles > kTailMaxTiles) return false;
  t.x_elems = (int)(x_bytes / sizeof(T));
  t.slot_elems = kTileRows * (kc_max + kRowSkew);
  const long slot_bytes = (long)t.slot_elems * sizeof(T);
  t.slots = (int)std::min<long>(tail_slots(), (kTailSmemBytes - x_bytes) / slot_bytes);
  smem = x_bytes + (long)t.slots * slot_bytes;
  scratch_floats = (long)slots * kTileRows * kTailMaxRows;
  return t.slots >= kTailMinSlots;
}

// One block per SM; the launch refuses a grid that could not be resident at once (its blocks wait for each
// other), which the occupancy of this shared memory would say first.
template <typename T>
void launch_tail(const TailArgs<T>& t, long smem) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  auto stream = at::cuda::getCurrentCUDAStream();
#define SEGKI_TAIL_CASE(M)                                                                                    \
  if (t.op[0].m <= M) {                                                                                      \
    allow_dynamic_smem<layer_tail_kernel<T, M>>(kTailSmemBytes);                                             \
    int per_sm = 0;                                                                                          \
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, layer_tail_kernel<T, M>,          \
                                                                 kWarps * 32, (size_t)smem));                \
    TORCH_CHECK(per_sm >= 1, "segki::layer_tail: a block of ", smem, " bytes of shared memory does not fit an ", \
                "SM; set SEGKI_TAIL_SLOTS lower");                                                           \
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
    long smem = 0, scratch = 0;
    TORCH_CHECK(tail_plan<T>(t, smem, scratch), op, ": these shapes do not fit the layer tail kernel (an sm_90 ",
                "GPU, every K a multiple of 16, at most ", kTailMaxTiles, " tiles of 16 weight rows, x and ",
                kTailMinSlots, " slots within ", kTailSmemBytes, " bytes of shared memory, 16-byte aligned ",
                "weights); ops.layer_tail composes the separate projections for them");
    auto pieces = at::empty({scratch}, core.options().dtype(at::kFloat));
    t.scratch = pieces.data_ptr<float>();
    t.group = next_tail_group();
    t.deal_tiles = env_is("SEGKI_TAIL_DEAL", "tiles");
    launch_tail<T>(t, smem);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(segki, CUDA, m) { m.impl("layer_tail", &layer_tail); }

}  // namespace segki
