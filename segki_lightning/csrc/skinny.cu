// Skinny products for 1-16 rows of x: out = x . W^T, every weight element read once. Measured on the H200
// (results/skinny/): at 1-8 rows faster than the GEMVs and cuBLAS on most Qwen3.5 projections alone (0.8B 1.0-1.65x,
// 4B 0.96-1.28x the better of the two) and more so inside the decode step. At 9-16 rows dispatch routes here too,
// with the norm as its own kernel before (results/staging16/: 0.8B b=16 +13.7 %, 4B +2.2 %).
//
// One block per SM, resident for the whole product. The work is a list of units (a 16-row weight tile x one part
// of K, tile-major), dealt to the blocks as equal contiguous ranges (stream-K: no wave quantization), or where the
// segments of K are not gathered and a block has four tiles or more, whole tiles by a queue (produce_queued). Each
// unit is copied into a ring of shared-memory slots by the copy engine (16 row copies of 2-4 KB, requested up to
// `slots` units ahead; the first ones before the PDL wait, since weights do not depend on the previous kernel) by a
// warp of its own: a block completes one bulk copy per ~55 ns (results/mma_ring/), so a unit's 16 copies take ~0.9 us
// to go out, which the first version (warp 0 issued them between its products) added to every unit. x stays in
// shared memory for the block's life. 8 consumer warps multiply an eighth of each unit's columns on tensor cores
// (mma.m16n8k16: A = the 16 weight rows, B = up to 16 rows of x; a lane's 8 consecutive k map to fragment slots
// {2t, 2t+1, 2t+8, 2t+9} of two k-steps, A and B alike) and sum their tiles through shared memory when a tile
// ends. A tile split between two blocks: the later block computes its parts first and publishes the partial sums;
// the earlier block adds them to its own at its end (the same order every launch: deterministic).
//
// Gated (SiLU-gated MLP front, weights packed gate rows then up rows): a tile is 8 gate rows and the 8 matching up
// rows, so each output's gate and up sums meet in one thread: out = silu(round(gate)) * round(up), as the
// reference (two products rounded, then the fp32 epilogue) computes it.
//
// The consumers pace a one-row product (results/landed/): each warp runs its ~200 instructions a unit back to back,
// two warps to a scheduler, so what pays is fewer instructions between units. The unit cursor (no divisions on the
// way from one unit to the next) and, at one row group, red's halves in turn (one barrier a tile end, not two):
// 0.8B decode b=1 +5.7 %, b=4 +5.5 %, 4B b=1 +5.4 % (results/unit_cursor/). What a launch's code weighs counts
// too: one row of x has an instantiation of its own, with one x staging (1592 SASS instructions instead of 5320),
// and the kernels that run between its launches got faster with it: 0.8B b=1 +8.2 %, 4B b=1 +2.5 %
// (results/one_row_kernel/); so do 2, 3-4 and 5-8 rows (1896-2824 instead of 4736): 0.8B b=2 +5.5 %, b=4 / b=8
// +2.0 %, 4B within 1 % (results/row_kernels/). ldmatrix fragments (no register moves in the mma loop) did not pay.
//
// Segments of K, at 1-8 rows: where x of all of K and three slots do not fit in shared memory (the 4B down, K = 9216,
// and the 0.8B down, K = 3584, at 7-8 rows), the grid splits into `segs` groups of blocks, group g taking every tile
// over segment g of K (whole parts) and staging only that segment of x. A group's sums of a tile go to global memory;
// the block whose sums arrive last (a counter per tile) adds every segment's in segment order and stores the outputs
// (deterministic: the same order whichever block is last). Decode against cuBLAS there: 0.8B b=8 +7.4 %, 4B b=8 +0.5 %
// (results/segments/run2/). At 9-16 rows they lost to cuBLAS: the 4B o_proj / out_proj in two segments took ~14 us and
// the down in three ~24.5 us without PDL (cuBLAS ~10.7 and ~18 with its split-K reduction), 4B b=16 -2.1 %
// (results/segments/run1_to_16_rows/), most of it likely in those tile ends, which stall the consumers on the counter.
//
// Deferred segments, at 9-16 rows: where x of all of K and three slots do not fit (the 4B o_proj / out_proj, K = 4096,
// and down, K = 9216, above 16 MiB: shorter parts are planned first), in one part of K a segment (four and nine
// groups: each stages the least of x), each group stores its sums of a tile to a buffer [segs][m][weight rows] as a
// plain store, with no counter and no wait, and a second launch (sum_segments_kernel) adds the segments in segment
// order and applies the epilogue (rounded, plus the residual; gated, the SiLU-mul): the same arithmetic as the
// gathered segments. It replaces cuBLAS's product, its split-K reduction and the residual add there: 4B decode b=16
// +3.7-4.0 %, b=12 +6 % (results/deferred_segments/). Without PDL the products are no faster than cuBLAS's (out_proj
// 11.6 us against 8.8 + 1.9, down 17.5 against 16.4 + 1.9 + 1.5); the gain is their weight copies going out before
// the PDL wait. A mixer's output projection hands its sums to the residual add + norm kernel instead
// (skinny_linear_sums, add_rms_norm_sums in norm.cu): +0.2-0.4 % more. One part a segment instead of the fewest
// segments that fit (two and three): 4B b=16 +0.5 % (results/one_wave_sums/).
//
// Norm prologue (norm_w): x is normalized as it is staged, with the norm kernel's arithmetic (the same bits), so
// the decoder layer launches no norm before the projection: 4B decode b=1 +4.3 %, 0.8B +2.1 %
// (results/skinny/run6_fold_ring/). Without one, x comes in by the copy engine, one copy per row: decode 4B b=16
// +0.6-0.7 %, 0.8B b=16 +1.5 % over async copies of 16 bytes by every consumer thread (results/bulk_x/), which had
// gained 4B b=16 +2.2 %, 0.8B b=1-8 +0.9-2.3 % over loads through registers (results/staging16/).
//
// x in registers (load_x_regs), at 9-16 rows of K = 2560 by a queue: each consumer thread holds the fragments of x
// its mma reads, so the ring takes all of shared memory (five slots instead of three beside x) and more of a block's
// weights go out before the PDL wait: 4B decode b=16 +3.4 %, b=12 +4.2 % (results/x_registers/). So do the deferred
// segments where K has parts of 1536-2048 columns (plan_deferred_regs): fewer, longer row copies.
#include "bulk.cuh"
#include "common.cuh"
#include "timeline.cuh"

namespace segki {
namespace {

constexpr int kWarps = 8;                   // consumer warps (the tensor-core work); one more warp issues the copies
constexpr int kConsumers = kWarps * 32;
constexpr int kThreads = kConsumers + 32;
constexpr int kTile = 16;            // weight rows per unit (the mma's M)
constexpr int kMaxRows = 16;         // rows of x (two mma N-groups of 8)
constexpr int kPad = 32;             // elements after each shared-memory row: rows g and g + 1 64 bytes apart in the
                                     // banks, so a quarter-warp's 16-byte fragment loads hit 32 distinct banks
constexpr int kMaxSlots = 6;
constexpr int kMinSlots = 3;
constexpr int kSmemBytes = 218 * 1024;  // dynamic: the ring and x (red and the barriers are static, ~8.8 KB)
constexpr int kRedStride = kTile + 1;

template <typename T>
struct SkinnyArgs {
  const T* x;         // [m, k]
  const T* w;         // [rows, k]; gated: gate rows [0, n), up rows [n, 2n)
  const T* residual;  // [m, n] added to the rounded product, or nullptr (plain only)
  const T* norm_w;    // [k]: the RMSNorm applied to x as it is staged, or nullptr
  float norm_eps;
  bool norm_unit_offset;
  T* out;             // [m, n]
  float* partial;     // [grid][kMaxRows * kTile]: the partial sums of the tile a block starts inside
  int* ready;         // [grid]: set by the block that published them, reset by the block that consumed them
  float* seg_sums;    // [tiles][segs][kMaxRows * kTile]: each segment's sums of a tile (gathered segments)
  int* arrived;       // [tiles]: segments whose sums are in, reset by the block that added them (gathered)
  float* seg_out;     // [segs][m][weight rows]: each segment's sums, added by sum_segments_kernel (deferred)
  int* queue;         // [segs]: the counters of the launch's tile queues, one a group (zero between launches)
  bool x_pieces;      // x staged in two pieces (stage_x), with a queue only
  int m, k, n;        // n: output columns
  int kp, parts;      // columns per part of K, parts per segment (kp a multiple of 8 warps x 32)
  int segs, ks;       // segments of K (groups of blocks), columns per segment: ks = parts * kp
  int tiles, slots;
  int fill_ahead;     // units in flight while the ring first fills (paced_fill), 0: all of its slots at once
  unsigned long long* stamps;  // the timeline's buffer (the stamping launches only; timeline.cuh)
  int launch_id;
};

// How a launch's segments of K meet: one segment (all of K); gathered by the block whose sums come last (1-8 rows);
// deferred to sum_segments_kernel (9-16 rows). Each mode is an instantiation of its own.
enum SegMode : int { kWhole = 0, kGathered = 1, kDeferred = 2 };

struct SkinnyPlan {
  int kp = 0, parts = 0, segs = 0, slots = 0;
  bool xreg = false;  // deferred segments with x in registers (plan_deferred_regs), kp / 256 steps a part
  long smem = 0;
  SegMode mode = kWhole;
};

constexpr int kMaxGrid = 1024;      // blocks the workspace has room for
constexpr int kMaxSegTiles = 4096;  // tiles x segments the workspace has room for (the 4B down: 160 x 3)
constexpr int kSegRows = 8;         // rows of x up to which segments of K are gathered (at 4 rows: K past ~15 000);
                                    // past them, deferred
constexpr int kMinPartCols = 512;   // the shortest parts of K planned where the longer ones do not fit (1 KB copies)
constexpr long kShortPartsMaxBytes = 16l << 20;  // weights up to which shorter parts are planned (skinny_plan)
constexpr int kRegParts = 2;      // x in registers (x_in_registers): K = kRegParts parts of kRegSteps x 256 columns,
constexpr int kRegSteps = 5;      // each lane holding 16 bytes of x a step, row group and part (the 4B's K = 2560)

// The weight row that row r (0-15) of tile t is.
template <bool GATED, typename T>
__device__ __forceinline__ int tile_row(const SkinnyArgs<T>& a, int t, int r) {
  if constexpr (GATED) return r < 8 ? t * 8 + r : a.n + t * 8 + r - 8;
  else return t * kTile + r;
}

// The producer warp: tile t's 16 row parts of part p of K (counted over all of K) into `slot` (rows kp + kPad
// apart), completing on `bar`, evicted first from L2 (`policy`: the weights are read once a step).
template <bool GATED, typename T>
__device__ __forceinline__ void issue_unit(const SkinnyArgs<T>& a, int t, int p, T* slot, uint64_t* bar,
                                           uint64_t policy) {
  const int lane = threadIdx.x & 31;
  if (lane == 0) mbar_expect(bar, (unsigned)(kTile * a.kp * sizeof(T)));
  __syncwarp();
  if (lane < kTile)
    bulk_load(slot + (size_t)lane * (a.kp + kPad), a.w + (size_t)tile_row<GATED>(a, t, lane) * a.k + (size_t)p * a.kp,
              (unsigned)(a.kp * sizeof(T)), bar, policy);
}

// Where a block is in its units: the slot and its phase parity, the tile and the part of K, advanced by adding
// (no divisions by the launch's slots and parts on the way from one unit to the next).
struct UnitCursor {
  int slot = 0, t = 0, p = 0;
  unsigned phase = 0;
  __device__ __forceinline__ UnitCursor(int u0, int parts) : t(u0 / parts), p(u0 % parts) {}
  __device__ __forceinline__ void next(int slots, int parts) {
    if (++slot == slots) slot = 0, phase ^= 1u;
    if (++p == parts) p = 0, ++t;
  }
};

// Before its unit `issued` goes out while the ring first fills (issued < slots), the producer waits for unit
// issued - fill_ahead to land: a block keeps fill_ahead units in flight through its first fill instead of its whole
// ring at once (the refills after it stay paced by the consumers). Two at 1-8 rows: decode 4B b=1 +1.2-1.5 %, b=8
// +0.6-0.9 %, 0.8B b=8 +1.0-1.2 %, 0.8B b=1 within 0.2 % (results/paced_fill/). It was built for 9-16 rows, where the
// norms between the products load slowly while 132 rings of five 42 KB slots are requested at once; there no pace
// changed those loads or the step (+0.1-0.6 %), so why it pays at 1-8 rows is not established. SEGKI_SKINNY_FILL
// sets it at every row count (0: the whole ring at once).
constexpr int kFillAhead = 2;

__device__ __forceinline__ void paced_fill(int issued, int slots, int fill_ahead, uint64_t* full) {
  if (fill_ahead > 0 && issued >= fill_ahead && issued < slots) mbar_wait(&full[issued - fill_ahead], 0u);
}

// A group's tiles dealt by a queue (segments not gathered, the tiles many a block: kQueueTiles), so that a block that
// streams faster takes more of them: blocks of equal units ran 17.5-23 us in one launch, their pace uncorrelated from
// one launch to the next, so a fixed deal ends at the slowest block's pace (results/one_wave_sums/). Block j of the
// group takes tile j first (its copies go out before the PDL wait with no round trip), then tiles group, group + 1,
// ... in the order the blocks draw them from the group's counter. Lane 0 keeps two draws in flight, so that a draw's
// round trip overlaps a tile's copies even at one part a tile. A tile is whole in one block, every part in part
// order, so its sums have the same bits whichever block takes it. A thread's draws on one counter come back in the
// order it made them, so once a block sees a draw past the tiles its other one is past them too: every block draws
// exactly twice past them, a launch tiles + group times, and the block holding the last draw sets the counter back
// to zero. Returns the units issued; after them the slot that follows carries tile -1, the consumers' end.
template <bool GATED, typename T>
__device__ __forceinline__ int produce_queued(const SkinnyArgs<T>& a, int seg, int first, int group, T* ring,
                                              size_t slot_elems, uint64_t* full, uint64_t* empty, int* slot_tile,
                                              uint64_t policy) {
  const int lane = threadIdx.x & 31, last = a.tiles + group - 1;  // the launch's last draw
  int* counter = a.queue + seg;
  int drawn = 0, after = 0;  // lane 0: the two draws in flight, in the order made
  if (lane == 0) {
    drawn = atomicAdd(counter, 1);
    after = atomicAdd(counter, 1);
  }
  int slot = 0, issued = 0;
  unsigned phase = 0;
  for (int t = first; t < a.tiles;) {
    for (int p = 0; p < a.parts; ++p) {
      if (issued >= a.slots) mbar_wait(&empty[slot], phase ^ 1u);  // the slot's previous round consumed
      paced_fill(issued, a.slots, a.fill_ahead, full);
      if (lane == 0) slot_tile[slot] = t;  // published by the arrival in issue_unit
      issue_unit<GATED>(a, t, seg * a.parts + p, ring + slot * slot_elems, &full[slot], policy);
      ++issued;
      if (++slot == a.slots) slot = 0, phase ^= 1u;
    }
    const int c = __shfl_sync(0xffffffffu, drawn, 0);
    t = group + c;
    if (lane == 0) {
      if (t < a.tiles) {
        drawn = after;
        after = atomicAdd(counter, 1);
      } else if (c == last || after == last) {
        atomicExch(counter, 0);
      }
    }
  }
  if (issued >= a.slots) mbar_wait(&empty[slot], phase ^ 1u);
  if (lane == 0) {
    slot_tile[slot] = -1;
    mbar_arrive(&full[slot]);
  }
  return issued;
}

// acc += the 16 weight rows' 16 k (wl: rows g, wh: rows g + 8; 8 consecutive k a lane) times x's (xv).
template <typename T>
__device__ __forceinline__ void mma_k16(float acc[4], uint4 wl, uint4 wh, uint4 xv) {
  mma16816<T>(acc, wl.x, wh.x, wl.y, wh.y, xv.x, xv.y);
  mma16816<T>(acc, wl.z, wh.z, wl.w, wh.w, xv.z, xv.w);
}

// acc[j] += this warp's columns of the unit in `slot` (part p of the block's segment, ks columns) times x rows
// 8j..8j+7.
template <typename T, int NB>
__device__ __forceinline__ void mma_unit(const T* slot, const T* xs, int m, int ks, int kp, int p, float acc[NB][4]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int wcols = kp / kWarps, c0 = warp * wcols + t * 8;
  const T* lo = slot + (size_t)g * (kp + kPad) + c0;
  const T* hi = lo + (size_t)8 * (kp + kPad);
  const T* xr[NB];
  bool xin[NB];
#pragma unroll
  for (int j = 0; j < NB; ++j) {
    xin[j] = 8 * j + g < m;
    xr[j] = xs + (size_t)(xin[j] ? 8 * j + g : 0) * (ks + kPad) + (size_t)p * kp + c0;
  }
#pragma unroll 4
  for (int c = 0; c < wcols; c += 32) {
    const uint4 wl = *reinterpret_cast<const uint4*>(lo + c), wh = *reinterpret_cast<const uint4*>(hi + c);
#pragma unroll
    for (int j = 0; j < NB; ++j) {
      mma_k16<T>(acc[j], wl, wh, xin[j] ? *reinterpret_cast<const uint4*>(xr[j] + c) : make_uint4(0, 0, 0, 0));
    }
  }
}

// mma_unit with x in registers (x_in_registers): xr[j][s] holds what mma_unit reads at c = 32 s for row group j,
// so the products and their order, and the sums' bits, are mma_unit's. The part's columns are S x 256.
template <typename T, int NB, int S>
__device__ __forceinline__ void mma_unit_regs(const T* slot, const uint4 (&xr)[NB][S], float acc[NB][4]) {
  constexpr int kp = S * kWarps * 32, wcols = S * 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const T* lo = slot + (size_t)g * (kp + kPad) + warp * wcols + t * 8;
  const T* hi = lo + (size_t)8 * (kp + kPad);
#pragma unroll
  for (int s = 0; s < S; ++s) {
    const uint4 wl = *reinterpret_cast<const uint4*>(lo + 32 * s), wh = *reinterpret_cast<const uint4*>(hi + 32 * s);
#pragma unroll
    for (int j = 0; j < NB; ++j) mma_k16<T>(acc[j], wl, wh, xr[j][s]);
  }
}

// x [m, P parts of S x 256 columns] into the registers mma_unit_regs reads (rows past m zero), all requested at once.
// Where x lives for the block's life at 9-16 rows of K = 2560 (80 registers a thread): the ring then takes all of
// shared memory, five slots instead of three, so the block's copies before the PDL wait carry 210 KB instead of 126
// (the blocks of the 4B's K = 2560 products wait 5.5-7 us there, and three slots land in ~4 us at an SM's share of
// copy bandwidth: results/stamped_b16/). From L2 (ld.global.cg): x is written by the kernel before, which runs
// under PDL while this one starts, so the read-only path (ld.global.nc) is not for it; with it the replayed 4B step
// at 12 and 16 rows failed (bad tokens, results/x_registers/).
template <typename T, int NB, int P, int S>
__device__ __forceinline__ void load_x_regs(const SkinnyArgs<T>& a, int col0, uint4 (&xr)[P][NB][S]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int j = 0; j < NB; ++j) {
    const int row = 8 * j + g;
    const T* src = a.x + (size_t)(row < a.m ? row : 0) * a.k + col0 + warp * (S * 32) + t * 8;
#pragma unroll
    for (int q = 0; q < P; ++q)
#pragma unroll
      for (int s = 0; s < S; ++s)
        xr[q][j][s] = row < a.m ? __ldcg(reinterpret_cast<const uint4*>(src + q * (S * kWarps * 32) + 32 * s))
                                : make_uint4(0, 0, 0, 0);
  }
}

// The warp's tile sums into red [warp][x row][weight row].
template <int NB>
__device__ __forceinline__ void stash(const float acc[NB][4], float (*red)[kMaxRows][kRedStride]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int j = 0; j < NB; ++j) {
    red[warp][8 * j + 2 * t][g] = acc[j][0];
    red[warp][8 * j + 2 * t + 1][g] = acc[j][1];
    red[warp][8 * j + 2 * t][g + 8] = acc[j][2];
    red[warp][8 * j + 2 * t + 1][g + 8] = acc[j][3];
  }
}

__device__ __forceinline__ float warps_sum(float (*red)[kMaxRows][kRedStride], int xr, int r) {
  float s = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) s += red[w][xr][r];
  return s;
}

// A barrier of the consumer warps only (the producer warp never joins it).
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(kConsumers) : "memory"); }

// The stamping instantiation's end: the producer warp arrives once it has stamped `landed`, the consumer warps
// wait for it before thread 0 writes the record (named barrier 2: 0 is __syncthreads, 1 consumers_sync).
__device__ __forceinline__ void landed_arrive() { asm volatile("bar.arrive 2, %0;" ::"n"(kThreads) : "memory"); }
__device__ __forceinline__ void landed_wait() { asm volatile("bar.sync 2, %0;" ::"n"(kThreads) : "memory"); }

struct ConsumersSync {
  __device__ __forceinline__ void operator()() const { consumers_sync(); }
};

// stage_x through the launch's RMSNorm: rms_norm_kernel's arithmetic thread for thread (256 threads, 8 columns of every
// 2048 each, the same block reduction), so the rows hold the bits that kernel would have stored and the product is
// exactly the one of its output. Every row's stretch is requested at once; w0 (the thread's first 8 norm weights) came
// before the wait. M: the rows it holds sums for (at least m; a row past m sums zeros and is not stored); each row's
// arithmetic is the same for any M. At M <= 4 the first two stretches (all of x for K <= 4096: the 4B's 2560) are
// requested together, one round trip instead of two, and w1 (the second stretch's norm weights) came before the wait
// too. A launch with a norm has one segment (ks = k: the sums need whole rows). Sums for the rows there are, not for 8:
// at one row the staging ran ~650 instructions a thread instead of ~250 and took 2.1 us instead of 0.2 on the 0.8B
// (results/skinny/run15_normrows/).
template <typename T, int M, bool STAMP>
__device__ __forceinline__ void stage_normed(const SkinnyArgs<T>& a, T* xs, float (*scratch)[32], uint4 w0, uint4 w1,
                                             Stamps& st) {
  constexpr int kStride = kConsumers * 8;  // columns between a thread's stretches
  const int i0 = threadIdx.x * 8;
  float ss[M] = {};
  auto load = [&](uint4 (&u)[M], int i) {
#pragma unroll
    for (int r = 0; r < M; ++r) u[r] = r < a.m ? ld_cached(a.x + (size_t)r * a.k + i) : make_uint4(0, 0, 0, 0);
  };
  auto add_and_store = [&](const uint4 (&u)[M], int i) {
#pragma unroll
    for (int r = 0; r < M; ++r) {
      float v[8];
      unpack8<T>(u[r], v);
      ss[r] = add_squares8(v, ss[r]);
      if (r < a.m) *reinterpret_cast<uint4*>(xs + (size_t)r * (a.ks + kPad) + i) = u[r];
    }
  };
  int i = i0;
  if constexpr (M <= 4) {
    if (i0 + kStride < a.k) {
      uint4 u[M], u1[M];
      load(u, i0);
      load(u1, i0 + kStride);
      add_and_store(u, i0);
      add_and_store(u1, i0 + kStride);
      i = i0 + 2 * kStride;
    }
  }
  for (; i < a.k; i += kStride) {
    uint4 u[M];
    load(u, i);
    add_and_store(u, i);
  }
  mark<STAMP>(st, kLoaded);
  block_sums<M>(ss, scratch, kWarps, ConsumersSync{});
  mark<STAMP>(st, kReduced);
  for (int i = i0; i < a.k; i += kStride) {  // normalized in place, by the thread that stored them
    float w[8];
    unpack8<T>(i == i0 ? w0 : M <= 4 && i == i0 + kStride ? w1 : ld_cached(a.norm_w + i), w);
#pragma unroll
    for (int r = 0; r < M; ++r) {
      if (r >= a.m) break;
      const float inv = rms_inverse(ss[r], a.k, a.norm_eps);
      uint4* p = reinterpret_cast<uint4*>(xs + (size_t)r * (a.ks + kPad) + i);
      float v[8];
      unpack8<T>(*p, v);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = rms_scaled<T>(v[j], inv, w[j], a.norm_unit_offset);
      *p = pack8<T>(v);
    }
  }
}

// Segment `seg` of x [m, K] (its ks columns) into shared memory (rows ks + kPad apart) for the block's life,
// normalized when the launch has a norm; without one by the copy engine, row r by consumer thread r, landing on
// x_bar[0] (its one phase). PIECES (x_in_pieces): the first part of K on x_bar[0], the rest on x_bar[1], and no
// wait here: the consumers wait for each piece as they first multiply it. MAXM: the most rows the kernel takes
// (1, 2, 4, 8 or 16): each kernel holds the one staging it runs.
template <typename T, int MAXM, bool NORM, bool PIECES, bool STAMP>
__device__ __forceinline__ void stage_x(const SkinnyArgs<T>& a, int seg, T* xs, float (*scratch)[32], uint4 w0,
                                        uint4 w1, uint64_t* x_bar, Stamps& st) {
  if (!NORM || a.norm_w == nullptr) {  // every row's copies in flight at once
    const int r = threadIdx.x;           // the row this thread copies, if any (the first warp's lanes)
    T* dst = xs + (size_t)r * (a.ks + kPad);
    const T* src = a.x + (size_t)r * a.k + (size_t)seg * a.ks;
    if (PIECES && a.x_pieces) {
      if (r < 2) mbar_expect(&x_bar[r], (unsigned)(a.m * (r == 0 ? a.kp : a.ks - a.kp) * sizeof(T)));
      __syncwarp();
      if (r < a.m) {
        bulk_load(dst, src, (unsigned)(a.kp * sizeof(T)), &x_bar[0]);
        bulk_load(dst + a.kp, src + a.kp, (unsigned)((a.ks - a.kp) * sizeof(T)), &x_bar[1]);
      }
      mark<STAMP>(st, kLoaded);  // requested, not landed
      mark<STAMP>(st, kReduced);
      return;
    }
    if (r == 0) mbar_expect(x_bar, (unsigned)(a.m * a.ks * sizeof(T)));
    __syncwarp();
    if (r < a.m) bulk_load(dst, src, (unsigned)(a.ks * sizeof(T)), x_bar);
    mbar_wait(x_bar, 0);
    mark<STAMP>(st, kLoaded);
    mark<STAMP>(st, kReduced);
    return;
  }
  if constexpr (NORM) stage_normed<T, MAXM, STAMP>(a, xs, scratch, w0, w1, st);  // sums for the rows there are
}

__device__ __forceinline__ void publish(int* flag) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(flag), "r"(1) : "memory");
}

__device__ __forceinline__ void await(int* flag) {
  int v = 0;
  do {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
  } while (v == 0);
}

// Adds 1 to `count` at gpu scope, acquiring what the blocks that added before it released: the earlier value.
__device__ __forceinline__ int arrive_count(int* count) {
  int old = 0;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(old) : "l"(count) : "memory");
  return old;
}

// Segments of K (segs > 1): this block's group's sums of tile t (v, thread i's) into seg_sums. Whether they came
// last; then v is every segment's sum, added in segment order. `last`: a shared word the block's answer passes by.
template <typename T>
__device__ __forceinline__ bool gather_segments(const SkinnyArgs<T>& a, int t, int seg, bool mine, float& v,
                                                int* last) {
  const int i = threadIdx.x;
  float* sums = a.seg_sums + (size_t)t * a.segs * kMaxRows * kTile + i;
  if (mine) sums[(size_t)seg * kMaxRows * kTile] = v;
  // every thread's store before the count: ordered before thread 0's acq_rel arrival (as finish_tile's flag)
  consumers_sync();
  if (i == 0) *last = arrive_count(a.arrived + t) == a.segs - 1;
  consumers_sync();
  if (!*last) return false;
  v = 0.f;
  if (mine) {
    for (int s = 0; s < a.segs; ++s) v += __ldcg(sums + (size_t)s * kMaxRows * kTile);
  }
  if (i == 0) a.arrived[t] = 0;  // every segment counted: zero again for the next launch
  return true;
}

// Thread i's output of tile t (x row xr, weight row r; mine: a row of x there is) from its sum v. Every consumer
// thread calls it: the gated form pairs threads i and i + 8 by a shuffle.
template <typename T, bool GATED>
__device__ __forceinline__ void store_output(const SkinnyArgs<T>& a, int t, int xr, int r, bool mine, float v) {
  if constexpr (GATED) {
    // gate (r < 8) and up (r + 8) of one output sit in threads i and i + 8 of the same half-warp
    const float up = __shfl_down_sync(0xffffffffu, v, 8);
    if (mine && r < 8) {
      const float gv = round_to<T>(v), uv = round_to<T>(up);
      a.out[(size_t)xr * a.n + t * 8 + r] = from_float<T>(silu(gv) * uv);
    }
  } else if (mine) {
    const size_t o = (size_t)xr * a.n + (size_t)t * kTile + r;
    float y = round_to<T>(v);
    if (a.residual) y += to_float<T>(a.residual[o]);
    a.out[o] = from_float<T>(y);
  }
}

// How a block finishes tile `t` after the warps' sums are in `red`. head: the block started inside the tile, so
// it publishes its sums for the block before it. tail: the block ends inside the tile, so it adds the next
// block's published sums to its own. Then it stores the outputs; with gathered segments of K it passes the group's
// sums on (gather_segments) and stores them only where they came last; with deferred ones it stores the group's
// sums for sum_segments_kernel.
template <typename T, bool GATED, int SEGS>
__device__ __forceinline__ void finish_tile(const SkinnyArgs<T>& a, int t, int seg, bool head, bool tail,
                                            float (*red)[kMaxRows][kRedStride], int* last) {
  const int i = threadIdx.x;
  const int xr = i / kTile, r = i % kTile;  // one (x row, weight row) per thread: 16 x 16 = 256 threads
  const bool mine = xr < a.m;
  float v = mine ? warps_sum(red, xr, r) : 0.f;
  if (head) {
    if (mine) a.partial[(size_t)blockIdx.x * kMaxRows * kTile + i] = v;
    // every thread's store before the flag: the barrier orders them before thread 0's release, which is
    // cumulative at gpu scope, as CUTLASS's split-K semaphore. A __threadfence() (fence.sc) before it cost 4B b=1
    // 0.3-0.5 % and the 1-row down's late heads ~1 us (results/split_tile_fence/)
    consumers_sync();
    if (i == 0) publish(a.ready + blockIdx.x);
    return;
  }
  if (tail) {
    if (i == 0) await(a.ready + blockIdx.x + 1);
    consumers_sync();
    if (mine) v += __ldcg(a.partial + (size_t)(blockIdx.x + 1) * kMaxRows * kTile + i);
    if (i == 0) a.ready[blockIdx.x + 1] = 0;  // consumed: zero again for the next launch
  }
  if constexpr (SEGS == kDeferred) {
    const int wrows = GATED ? 2 * a.n : a.n;
    if (mine) a.seg_out[((size_t)seg * a.m + xr) * wrows + tile_row<GATED>(a, t, r)] = v;
    return;
  }
  if constexpr (SEGS == kGathered) {
    if (!gather_segments(a, t, seg, mine, v, last)) return;
  }
  store_output<T, GATED>(a, t, xr, r, mine, v);
}

// SEGS: how the launch's segments of K meet (SegMode; an instantiation each, so that the others carry none of its
// code). XS > 0: x in registers (load_x_regs), XS x 256 columns a part (kp), its ring [slots][16][kp + kPad] all of
// the dynamic shared memory: all of K in kRegParts parts (one segment), or deferred segments of one part each.
template <typename T, int MAXM, bool GATED, int SEGS, bool QUEUE, bool STAMP, int XS = 0>
__global__ void __launch_bounds__(kThreads, 1) skinny_kernel(const SkinnyArgs<T> a) {
  constexpr bool XREG = XS > 0;
  constexpr int NB = (MAXM + 7) / 8;  // mma N-groups of 8 rows of x
  Stamps st{};  // STAMP only: the block's phases (timeline.cuh)
  mark_start<STAMP>(st);
  extern __shared__ __align__(128) unsigned char skinny_smem[];  // ring [slots][16][kp + kPad], then x [m][k + kPad]
  // x_bar: x staged (one phase; with a queue, one a piece)
  __shared__ __align__(8) uint64_t full[kMaxSlots], empty[kMaxSlots], x_bar[2];
  __shared__ float red[kWarps][kMaxRows][kRedStride];
  __shared__ unsigned long long landed;  // STAMP only: the clock when the block's last unit had landed
  __shared__ int last;                    // segs > 1: whether the block's sums of a tile came last (finish_tile)
  __shared__ int slot_tile[kMaxSlots];    // QUEUE: the tile each slot holds, -1 past the block's last
  T* ring = reinterpret_cast<T*>(skinny_smem);
  const size_t slot_elems = (size_t)kTile * (a.kp + kPad);
  T* xs = ring + a.slots * slot_elems;
  // the block's segment of K: blocks [b0, b0 + group) are group seg; without a queue its units split in equal
  // contiguous ranges
  int seg = 0, b0 = 0, group = (int)gridDim.x;
  if constexpr (SEGS != kWhole) {
    while ((seg + 1) * (int)gridDim.x / a.segs <= (int)blockIdx.x) ++seg;
    b0 = seg * (int)gridDim.x / a.segs;
    group = (seg + 1) * (int)gridDim.x / a.segs - b0;
  }
  const int units = a.tiles * a.parts;
  const int u0 = (int)((long long)(blockIdx.x - b0) * units / group);
  const int u1 = (int)((long long)(blockIdx.x - b0 + 1) * units / group);
  const int warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) {
    for (int s = 0; s < a.slots; ++s) {
      mbar_init(&full[s]);
      mbar_init(&empty[s], kWarps);
    }
    mbar_init(&x_bar[0]);
    mbar_init(&x_bar[1]);
    bulk_fence_init();
  }
  __syncthreads();  // the barriers are initialized before anyone uses them
  if (warp == kWarps) {  // the producer: weights only, so its first copies go out before the PDL wait
    pdl_launch_dependents();
    const uint64_t policy = l2_evict_first();
    int issued = u1 - u0;
    if constexpr (QUEUE) {
      issued = produce_queued<GATED>(a, seg, (int)blockIdx.x - b0, group, ring, slot_elems, full, empty, slot_tile,
                                     policy);
    } else {
      UnitCursor at(u0, a.parts);
      for (int u = u0; u < u1; ++u, at.next(a.slots, a.parts)) {
        if (u - u0 >= a.slots) mbar_wait(&empty[at.slot], at.phase ^ 1u);  // the slot's previous round consumed
        paced_fill(u - u0, a.slots, a.fill_ahead, full);
        issue_unit<GATED>(a, at.t, seg * a.parts + at.p, ring + at.slot * slot_elems, &full[at.slot], policy);
      }
    }
    if constexpr (STAMP) {  // when the copies, not the consumers, were done: the last unit's barrier completing
      const int c = issued - 1;
      mbar_wait(&full[c % a.slots], (unsigned)(c / a.slots) & 1u);
      if (threadIdx.x == kConsumers) landed = clock64();
      landed_arrive();
    }
    return;
  }
  // the norm prologue's first weights (a parameter, never written by a kernel of the step: safe before the wait),
  // and at 1-4 rows its second stretch's (stage_normed)
  const int wi = threadIdx.x * 8, wi1 = wi + kConsumers * 8;
  const uint4 w0 = a.norm_w && wi < a.k ? ld_cached(a.norm_w + wi) : make_uint4(0, 0, 0, 0);
  const uint4 w1 = NB == 1 && a.norm_w && a.m <= 4 && wi1 < a.k ? ld_cached(a.norm_w + wi1) : make_uint4(0, 0, 0, 0);
  pdl_launch_dependents();
  pdl_wait();
  mark<STAMP>(st, kWaited);
  constexpr int XP = XREG && SEGS == kWhole ? kRegParts : 1, XN = XREG ? XS : 1;
  uint4 xr[XP][NB][XN];  // XREG: the thread's x for every part (load_x_regs); no barrier, no one else reads it
  if constexpr (XREG) {
    static_assert(SEGS == kWhole || SEGS == kDeferred, "x in registers: all of K, or a deferred segment");
    load_x_regs<T, NB, XP, XN>(a, seg * a.ks, xr);
    mark<STAMP>(st, kLoaded);  // requested, not landed
    mark<STAMP>(st, kReduced);
  } else {
    // red is free until the first tile ends
    float(*scratch)[32] = reinterpret_cast<float(*)[32]>(&red[0][0][0]);
    stage_x<T, MAXM, SEGS == kWhole, QUEUE, STAMP>(a, seg, xs, scratch, w0, w1, x_bar, st);
    consumers_sync();  // x is in place (and the norm's scratch read) before any product
  }
  mark<STAMP>(st, kStaged);
  float acc[NB][4] = {};
  unsigned long long t0 = 0;  // STAMP only
  // At one row group a tile's sums take half of red (x rows 0-7), so consecutive tiles use the halves in turn: a
  // warp stashes into a half only after the barrier of the tile between, which every warp passes after reading it.
  bool upper = false;
  // The warps' sums of tile t into red, then finish_tile (head / tail: the block starts / ends inside it).
  auto end_tile = [&](int t, bool head, bool tail) {
    float(*sums)[kMaxRows][kRedStride] = upper ? reinterpret_cast<float(*)[kMaxRows][kRedStride]>(&red[0][8][0]) : red;
    stash<NB>(acc, sums);
    consumers_sync();
    finish_tile<T, GATED, SEGS>(a, t, seg, head, tail, sums, &last);
    if constexpr (NB == 1) upper = !upper;
    else consumers_sync();  // red is read before the next tile's sums go in
#pragma unroll
    for (int j = 0; j < NB; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  };
  // STAMP: the unit's wait for its slot since t0 (the first unit's: the first mark instead)
  auto stamp_wait = [&](bool first) {
    if constexpr (STAMP) {
      if (first) mark<STAMP>(st, kFirst);
      else st.unit_wait += clock64() - t0;
    }
  };
  // The unit in `slot` (part p of the segment) into acc (`last`: maybe the block's last, stamped so); the slot back
  // to the producer once the warp is done with it.
  auto multiply = [&](int slot, int p, bool last) {
    if constexpr (XREG) {
#pragma unroll
      for (int q = 0; q < XP; ++q)  // the part's registers by a constant index
        if (q == p) mma_unit_regs<T, NB, XN>(ring + slot * slot_elems, xr[q], acc);
    } else {
      mma_unit<T, NB>(ring + slot * slot_elems, xs, a.m, a.ks, a.kp, p, acc);
    }
    if (last) mark<STAMP>(st, kLast);
    __syncwarp();
    if ((threadIdx.x & 31) == 0) mbar_arrive(&empty[slot]);
  };
  int done = 0;  // units multiplied
  if constexpr (QUEUE) {
    int slot = 0, p = 0;
    unsigned phase = 0;
    unsigned long long ended = 0;  // STAMP only: the last tile end's cycles, counted once a unit follows it
    int x_next = a.x_pieces ? 0 : -1;  // x's next piece to see landed (stage_x): 0 before part 0, 1 before part 1
    for (;; ++done) {
      if constexpr (STAMP) t0 = clock64();
      mbar_wait(&full[slot], phase);
      const int t = slot_tile[slot];
      if (t < 0) break;  // the block's tiles are done
      if (p == x_next) {
        mbar_wait(&x_bar[x_next], 0);
        x_next = x_next == 0 ? 1 : -1;
      }
      stamp_wait(done == 0);
      if constexpr (STAMP) {
        st.tile_ends += ended;
        ended = 0;
      }
      multiply(slot, p, true);  // the last unit is known only when the slot after it says so
      if (++slot == a.slots) slot = 0, phase ^= 1u;
      if (++p == a.parts) {  // the tile ends here
        if constexpr (STAMP) t0 = clock64();
        end_tile(t, false, false);
        p = 0;
        if constexpr (STAMP) ended = clock64() - t0;
      }
    }
  } else {
    UnitCursor at(u0, a.parts);
    const int head_tile = at.p != 0 ? at.t : -1;  // the tile the block starts inside, if it does
    for (int u = u0; u < u1; ++u, ++done, at.next(a.slots, a.parts)) {
      if constexpr (STAMP) t0 = clock64();
      mbar_wait(&full[at.slot], at.phase);
      stamp_wait(u == u0);
      multiply(at.slot, at.p, u == u1 - 1);
      if (at.p == a.parts - 1 || u == u1 - 1) {  // the tile ends here
        if constexpr (STAMP) t0 = clock64();
        end_tile(at.t, at.t == head_tile, at.p != a.parts - 1);
        if constexpr (STAMP) {
          if (u < u1 - 1) st.tile_ends += clock64() - t0;
        }
      }
    }
  }
  if constexpr (STAMP) {
    landed_wait();
    if (threadIdx.x == 0) write_stamps(a.stamps, a.launch_id, st, done, landed);
  }
}

// Columns per part of K: a divisor of K that is a multiple of 256 (8 warps x 32), closest to 1280 (row copies of
// 2-4 KB: a block completes one copy per ~55 ns, so copies below 2 KB cap its stream, results/mma_ring/); the
// smaller on a tie. 0: none. Longer copies did not pay: the 4B down (K = 9216) in 6 parts of 3 KB copies instead of
// 9 of 2 KB lost at 4B b=1 (359.2 -> 350.2 tok/s, results/skinny/run12_parts/).
int part_cols(int k) {
  int best = 0;
  for (int p = 1; p <= 64; ++p) {
    if (k % p != 0 || (k / p) % (kWarps * 32) != 0) continue;
    const int kp = k / p;
    const int d = std::abs(kp - 1280), best_d = std::abs(best - 1280);
    if (best == 0 || d < best_d || (d == best_d && kp < best)) best = kp;
  }
  return best;
}

// The launch for x [m, k] by a weight of `rows` rows in parts of kp columns, or false where x and three slots do
// not fit. Segments of K (a divisor of the parts), by `segments`: kWhole, one; kGathered, the fewest whose x leaves
// room for three slots (the tile sums' workspace holds kMaxSegTiles); kDeferred, one part of K each, so that each
// group stages the least of x and keeps the most slots (the 4B o_proj / out_proj in four, the down in nine; against
// the fewest, two and three, each +0.5 % at 4B b=16: results/deferred_segments/run2_segment_counts/).
bool plan_parts(int m, int k, int rows, size_t elem, int kp, SegMode segments, SkinnyPlan& plan) {
  const int parts = k / kp, tiles = rows / kTile;
  const long slot_bytes = (long)kTile * (kp + kPad) * (long)elem;
  const int most = segments == kWhole ? 1 : parts;
  for (int segs = segments == kDeferred ? parts : 1; segs <= most; ++segs) {
    if (parts % segs != 0) continue;
    if (segments == kGathered && segs > 1 && (long)tiles * segs > kMaxSegTiles) return false;
    const long x_bytes = (long)m * (k / segs + kPad) * (long)elem;
    const long slots = std::min<long>(kMaxSlots, (kSmemBytes - x_bytes) / slot_bytes);
    if (slots < kMinSlots) continue;
    plan.kp = kp;
    plan.parts = parts / segs;
    plan.segs = segs;
    plan.slots = (int)slots;
    plan.smem = slots * slot_bytes + x_bytes;
    plan.mode = segs == 1 ? kWhole : segments;
    return true;
  }
  return false;
}

// With x in registers, the ring in all of the dynamic shared memory: the slots of kp columns that fit there (at most
// kMaxSlots) and their bytes into `plan`; false where fewer than kMinSlots fit.
bool ring_fills_smem(int kp, size_t elem, SkinnyPlan& plan) {
  const long slot_bytes = (long)kTile * (kp + kPad) * (long)elem;
  const long slots = std::min<long>(kMaxSlots, kSmemBytes / slot_bytes);
  if (slots < kMinSlots) return false;
  plan.slots = (int)slots;
  plan.smem = slots * slot_bytes;
  return true;
}

// Deferred segments with x in registers (9-16 rows, no norm, not gated): each segment one part of kp columns, the
// longest multiple of 256 up to kRegSegCols that divides K and that an instantiation holds (6 or 8 steps of 256),
// the ring taking all of shared memory. Against the plain deferred segments (parts of 1024 columns: 2 KB copies,
// x staged in shared memory) the copies are 3-4 KB, half to two thirds as many, and the sums two or six segments
// instead of four or nine (the 4B's K = 4096 and 9216). The 16-row o_proj was bound by its blocks' copies (78 of
// 2 KB, ~49 ns each; warming its weight in L2 changed nothing, results/attn_warm/). Measured (A/B in one run,
// results/deferred_xregs/): 4B decode b=16 T=1 4866-4872 -> 4998-5008 tok/s (+2.7 %), b=12 +2.1 %; in the stamped
// step the out_proj 1.2 us and the down 2.2 us shorter. SEGKI_SKINNY_XSEG=0: the plain deferred segments.
constexpr int kRegSegCols = 2048;
bool plan_deferred_regs(int k, size_t elem, SkinnyPlan& plan) {
  if (env_is("SEGKI_SKINNY_XSEG", "0")) return false;
  for (int kp = kRegSegCols; kp >= 6 * kWarps * 32; kp -= kWarps * 32) {
    const int steps = kp / (kWarps * 32);
    if (k % kp != 0 || (steps != 6 && steps != 8)) continue;
    if (k / kp < 2 || !ring_fills_smem(kp, elem, plan)) return false;
    plan.kp = kp;
    plan.parts = 1;
    plan.segs = k / kp;
    plan.mode = kDeferred;
    plan.xreg = true;
    return true;
  }
  return false;
}

// The launch for x [m, k] by a weight of `rows` rows (norm: with the norm prologue), or false where this path does
// not take it: the parts of part_cols, in segments of K at 1-8 rows (kSegRows) where all of x does not fit (one
// segment where the launch normalizes x: the sums need whole rows); else, in one segment on weights of at most
// kShortPartsMaxBytes, the longest smaller parts that fit, down to kMinPartCols; else, at 9-16 rows without a norm,
// in deferred segments. Against cuBLAS at 16 rows (results/short_parts/): the 0.8B down (7.3 MB) in parts of 512
// columns, decode 0.8B b=16 +7.3 %, b=12 +8.0 %; the 4B o_proj / out_proj (21 MB) so took 13.2 us without PDL, 4B
// b=16 -1.4 %.
bool skinny_plan(int m, int k, int rows, size_t elem, bool norm, bool gated, SkinnyPlan& plan) {
  if (m < 1 || m > kMaxRows || rows % kTile != 0 || k % 8 != 0) return false;
  const int kp = part_cols(k);
  if (kp == 0) return false;
  bool ok = plan_parts(m, k, rows, elem, kp, !norm && m <= kSegRows ? kGathered : kWhole, plan);
  if (!ok && (long)rows * k * (long)elem <= kShortPartsMaxBytes) {
    for (int p = kp - kWarps * 32; p >= kMinPartCols && !ok; p -= kWarps * 32)
      ok = k % p == 0 && plan_parts(m, k, rows, elem, p, kWhole, plan);
  }
  if (!ok && !norm && m > kSegRows)
    ok = (!gated && plan_deferred_regs(k, elem, plan)) ||
         plan_parts(m, k, rows, elem, kp, kDeferred, plan);
  return ok;
}

// Per device: the partial sums and flags of split tiles, the gathered segments' sums and counters and the tile
// queues' counters, allocated zeroed on the first product (outside graph capture: the decode engine runs each step
// eagerly before capturing it) and kept for the process; every flag and counter is zero again when its launch ends.
struct Workspace {
  float* partial = nullptr;
  int* ready = nullptr;
  float* seg_sums = nullptr;
  int* arrived = nullptr;
  int* queues = nullptr;
};

// The tile queues' counters: each launch takes the next kQueueStride of kQueueCounters in turn (one a
// segment), so a launch that starts under PDL before the one before it has ended never shares a counter with it.
constexpr int kQueueStride = 64;  // segments a launch may have (parts of K at most 64, part_cols)
constexpr int kQueueCounters = 64 * kQueueStride;
constexpr int kQueueTiles = 4;        // tiles a block from which a launch deals them by a queue
constexpr int kMinPieceBytes = 2048;  // x in two pieces where a row's first part is at least this long: a block
                                      // completes one copy per ~55 ns, so short copies of x cost more than they save

Workspace workspace() {
  static std::vector<at::Tensor> keep;
  static Workspace ws[64];
  const int dev = c10::cuda::current_device();
  TORCH_CHECK(dev < 64, "segki::skinny_linear: device index ", dev, " beyond 63");
  if (ws[dev].ready == nullptr) {
    cudaStreamCaptureStatus status;
    C10_CUDA_CHECK(cudaStreamIsCapturing(at::cuda::getCurrentCUDAStream(), &status));
    TORCH_CHECK(status == cudaStreamCaptureStatusNone, "segki::skinny_linear: the first product on a device must "
                "run outside CUDA graph capture (it allocates its workspace); run the step once before capturing");
    auto opts = at::TensorOptions().device(at::kCUDA, dev);
    keep.push_back(at::zeros({(long)kMaxGrid * kMaxRows * kTile}, opts.dtype(at::kFloat)));
    ws[dev].partial = keep.back().data_ptr<float>();
    keep.push_back(at::zeros({(long)kMaxGrid}, opts.dtype(at::kInt)));
    ws[dev].ready = keep.back().data_ptr<int>();
    keep.push_back(at::zeros({(long)kMaxSegTiles * kMaxRows * kTile}, opts.dtype(at::kFloat)));
    ws[dev].seg_sums = keep.back().data_ptr<float>();
    keep.push_back(at::zeros({(long)kMaxSegTiles}, opts.dtype(at::kInt)));
    ws[dev].arrived = keep.back().data_ptr<int>();
    keep.push_back(at::zeros({(long)kQueueCounters}, opts.dtype(at::kInt)));
    ws[dev].queues = keep.back().data_ptr<int>();
    C10_CUDA_CHECK(cudaStreamSynchronize(at::cuda::getCurrentCUDAStream()));
  }
  return ws[dev];
}

// The counters of a launch's tile queues: the next kQueueStride of the workspace's (`queues`) in turn.
int* next_queues(int* queues) {
  static std::atomic<unsigned> next{0};
  return queues + (next.fetch_add(1, std::memory_order_relaxed) % (kQueueCounters / kQueueStride)) * kQueueStride;
}

// The grid: every block resident at once (a block may wait for the next one's partial sums), at most one per tile in
// each segment's group (so each block has at least `parts` units and a tile spans at most two blocks). A grid of one
// block per unit, which streams the narrow 0.8B products (64 tiles of 2 parts) on all 132 SMs instead of 64, lost in
// the decode step (results/skinny/run7_grid/: 0.8B b=1 1189.0 -> 1149.6 tok/s, b=4 -5.4 %); likely reasons, not
// measured apart: the SMs left free are where the next kernel's blocks start under PDL, and split tiles wait. A grid
// capped below the SM count lost too (results/skinny/run9_ab/: 116 blocks 0.8B b=1 1161.8 -> 1152.0, 4B 357.2 -> 351.1;
// 100 blocks 1119.7 / 350.6): the blocks' stream, not free SMs, is what the step waits for.
template <typename T, int MAXM, bool GATED, int SEGS, bool QUEUE, int XS = 0>
void launch_grid(SkinnyArgs<T> a, const SkinnyPlan& plan, int grid) {
  constexpr auto plain = skinny_kernel<T, MAXM, GATED, SEGS, QUEUE, false, XS>;
  constexpr auto stamped = skinny_kernel<T, MAXM, GATED, SEGS, QUEUE, true, XS>;  // while the timeline stamps
  const StampTarget stamp =
      stamp_target(kSkinnyProduct, {a.m, a.k, a.n, (GATED ? 1 : 0) | (XS > 0 ? 2 : 0), grid, a.parts * a.segs,
                                    a.tiles});
  (stamp.buf ? allow_dynamic_smem<stamped> : allow_dynamic_smem<plain>)(kSmemBytes);
  a.stamps = stamp.buf;
  a.launch_id = stamp.id;
  launch_pdl_smem(stamp.buf ? stamped : plain, dim3(grid), dim3(kThreads), (size_t)plan.smem,
                  at::cuda::getCurrentCUDAStream(), dim3(1), a);
}

// Where segments of K are not gathered and a block's group has at least kQueueTiles tiles a block, they are dealt
// by a queue (produce_queued) and x comes in two pieces where the first part's row copies are long enough
// (kMinPieceBytes): decode 4B b=16 T=1 +3.6-3.9 %, b=12 +3.0 %, the 0.8B within 0.4 %
// (results/tile_queue/run2_landed/); at 1-8 rows (the 4B's GDN input, gate|up and q|k|v) 4B b=1 +0.6 %, b=8
// +1.6-1.9 %, the 0.8B within 0.3 % (tile_queue/run3_rows_1_8.md). On every 16-row product, the 0.8B's 2.9-3.4 tiles a block
// included, the queue (one draw in flight) gave 4B b=16 +3.4-3.5 % and 0.8B -4.7 %; x by every part (the 0.8B
// down's 112 copies of 1 KB a block) 4B +3.9-4.0 %, 0.8B -8 % (run1).
// x in registers (load_x_regs) where a 9-16 row launch (the caller's) deals its tiles by a queue over K = kRegParts
// parts of kRegSteps x 256 columns, in one segment, without a norm: `regs` then has the slots that fill all of
// shared memory. SEGKI_SKINNY_XREG=0: x in shared memory there too.
bool x_in_registers(int k, int kp, int segs, bool norm, size_t elem, SkinnyPlan& regs) {
  if (norm || segs != 1 || kp != kRegSteps * kWarps * 32 || k != kRegParts * kp || env_is("SEGKI_SKINNY_XREG", "0"))
    return false;
  return ring_fills_smem(kp, elem, regs);
}

// launch_grid, with x in registers where it goes there: all of K in a queued 9-16 row launch (x_in_registers), or
// deferred segments the plan holds so (plan_deferred_regs). There x comes in no pieces.
template <typename T, int MAXM, bool GATED, int SEGS, bool QUEUE>
void launch_x(SkinnyArgs<T> a, const SkinnyPlan& plan, int grid) {
  if constexpr (MAXM == kMaxRows && SEGS == kWhole && QUEUE) {
    SkinnyPlan regs = plan;
    if (x_in_registers(a.k, a.kp, a.segs, a.norm_w != nullptr, sizeof(T), regs)) {
      a.slots = regs.slots;
      a.x_pieces = false;
      return launch_grid<T, MAXM, GATED, SEGS, QUEUE, kRegSteps>(a, regs, grid);
    }
  }
  if constexpr (MAXM == kMaxRows && SEGS == kDeferred && !GATED) {
    a.x_pieces = a.x_pieces && !plan.xreg;
    const int steps = plan.kp / (kWarps * 32);
    if (plan.xreg && steps == 8) return launch_grid<T, MAXM, GATED, SEGS, QUEUE, 8>(a, plan, grid);
    if (plan.xreg && steps == 6) return launch_grid<T, MAXM, GATED, SEGS, QUEUE, 6>(a, plan, grid);
  }
  TORCH_CHECK(!plan.xreg, "segki::skinny_linear: no instantiation holds x in ", plan.kp / (kWarps * 32), " steps");
  launch_grid<T, MAXM, GATED, SEGS, QUEUE>(a, plan, grid);
}

template <typename T, int MAXM, bool GATED, int SEGS = kWhole>
void launch(SkinnyArgs<T> a, const SkinnyPlan& plan) {
  constexpr auto kernel = skinny_kernel<T, MAXM, GATED, SEGS, false, false>;
  allow_dynamic_smem<kernel>(kSmemBytes);
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, (size_t)plan.smem));
  TORCH_CHECK(per_sm >= 1, "segki::skinny_linear: a block of ", plan.smem, " bytes of shared memory does not fit");
  const int resident = per_sm * sm_count();
  const int grid = std::min({resident, a.tiles * a.segs, kMaxGrid});
  TORCH_CHECK(grid >= a.segs, "segki::skinny_linear: ", a.segs, " segments of K need as many resident blocks");
  if constexpr (SEGS != kGathered) {
    if ((long)a.tiles * a.segs >= (long)kQueueTiles * grid) {
      TORCH_CHECK(a.segs <= kQueueStride, "segki::skinny_linear: ", a.segs, " segments of K, past the ", kQueueStride,
                  " the tile queues have room for");
      a.queue = next_queues(a.queue);
      a.x_pieces = a.norm_w == nullptr && a.parts >= 2 && a.kp * sizeof(T) >= kMinPieceBytes;  // a norm: stage_normed
      launch_x<T, MAXM, GATED, SEGS, true>(a, plan, grid);
      return;
    }
  }
  launch_x<T, MAXM, GATED, SEGS, false>(a, plan, grid);
}

// The instantiation for a.m rows: 1, 2, 3-4, 5-8 and 9-16 rows each have their own, holding only their staging
// (less code on the decode path: results/one_row_kernel/, results/row_kernels/); segments of K two more, gathered
// at 1-8 rows (kSegRows) and deferred at 9-16.
template <typename T, bool GATED>
void launch_rows(const SkinnyArgs<T>& a, const SkinnyPlan& plan) {
  static_assert(kSegRows == 8, "the gathered segments' instantiation takes up to 8 rows");
  if (plan.mode == kDeferred) launch<T, 16, GATED, kDeferred>(a, plan);
  else if (plan.mode == kGathered) launch<T, 8, GATED, kGathered>(a, plan);
  else if (a.m == 1) launch<T, 1, GATED>(a, plan);
  else if (a.m == 2) launch<T, 2, GATED>(a, plan);
  else if (a.m <= 4) launch<T, 4, GATED>(a, plan);
  else if (a.m <= 8) launch<T, 8, GATED>(a, plan);
  else launch<T, 16, GATED>(a, plan);
}

constexpr int kSumThreads = 256;

// Deferred segments: out [m, n] from each segment's sums [segs][m][weight rows], added in segment order from zero as
// gather_segments adds them, then store_output's epilogue (rounded, plus the residual; gated, silu(round(gate)) *
// round(up)). Four outputs a thread (n is a multiple of 8). STAMP: the timeline's instantiation (thread 0 of each
// block, whose outputs every block has, writes its record).
template <typename T, bool GATED, bool STAMP>
__global__ void __launch_bounds__(kSumThreads) sum_segments_kernel(const float* __restrict__ sums,
                                                                   const T* __restrict__ residual,
                                                                   T* __restrict__ out, int segs, int m, int n,
                                                                   unsigned long long* stamps, int launch_id) {
  Stamps st{};
  mark_start<STAMP>(st);
  pdl_start();
  mark<STAMP>(st, kWaited);
  const int o = (blockIdx.x * kSumThreads + threadIdx.x) * 4;  // the first of its four outputs
  if (o >= m * n) return;
  const int xr = o / n, c = o - xr * n, wrows = GATED ? 2 * n : n;
  auto added = [&](int col, float (&v)[4]) {  // column col..col+3 of row xr, every segment in order
    sum_parts<4, 16>(sums + (size_t)xr * wrows + col, segs, (size_t)m * wrows, v);
  };
  float v[4], up[4];
  added(c, v);
  if constexpr (GATED) added(n + c, up);
  mark_until<STAMP>(st, kLoaded, kReduced);
  if constexpr (GATED) {
#pragma unroll
    for (int j = 0; j < 4; ++j) out[o + j] = from_float<T>(silu(round_to<T>(v[j])) * round_to<T>(up[j]));
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float y = round_to<T>(v[j]);
      if (residual) y += to_float<T>(residual[o + j]);
      out[o + j] = from_float<T>(y);
    }
  }
  mark_until<STAMP>(st, kStaged, kLast);
  if constexpr (STAMP) {
    if (threadIdx.x == 0) write_stamps(stamps, launch_id, st, 1);
  }
}

template <typename T>
void launch_sum(const SkinnyArgs<T>& a, bool gated) {
  const int blocks = (a.m * a.n / 4 + kSumThreads - 1) / kSumThreads;
  const StampTarget stamp = stamp_target(kSegmentSums, {a.m, 0, a.n, gated ? 1 : 0, blocks, a.segs, 0});
  const auto kernel = gated ? (stamp.buf ? sum_segments_kernel<T, true, true> : sum_segments_kernel<T, true, false>)
                            : (stamp.buf ? sum_segments_kernel<T, false, true> : sum_segments_kernel<T, false, false>);
  launch_pdl(kernel, dim3(blocks), dim3(kSumThreads), at::cuda::getCurrentCUDAStream(), dim3(1),
             (const float*)a.seg_out, a.residual, a.out, a.segs, a.m, a.n, stamp.buf, stamp.id);
}

// The product's launches: out (skinny_linear), or with sums_only each deferred segment's sums, [segs, ..., N] fp32
// (skinny_linear_sums: the caller's next kernel adds them; no sum kernel is launched).
at::Tensor skinny_product(const char* op, const at::Tensor& x, const at::Tensor& w,
                          const c10::optional<at::Tensor>& residual, bool gated,
                          const c10::optional<at::Tensor>& norm_w, double norm_eps, bool norm_unit_offset,
                          bool sums_only) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous(), op, ": x must be a contiguous CUDA tensor");
  check_cuda_half(w, op, "weight", x.scalar_type());
  const int64_t k = x.size(-1), m = x.numel() / std::max<int64_t>(k, 1);
  TORCH_CHECK(w.dim() == 2 && w.size(1) == k, op, ": weight ", w.sizes(), " must be [N, ", k, "]");
  TORCH_CHECK(!gated || w.size(0) % 2 == 0, op, ": a gated weight packs gate and up rows: an even row count");
  TORCH_CHECK(!(gated && residual.has_value()), op, ": the gated product takes no residual");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0, op, ": the weight must start on 16 bytes");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0, op, ": x must start on 16 bytes");
  const int64_t n = gated ? w.size(0) / 2 : w.size(0);
  auto shape = x.sizes().vec();
  shape.back() = n;
  auto out = sums_only ? at::Tensor() : at::empty(shape, x.options());
  if (residual.has_value()) {
    check_cuda_half(*residual, op, "residual", x.scalar_type());
    TORCH_CHECK(residual->sizes() == at::IntArrayRef(shape), op, ": residual ", residual->sizes(),
                " must match the output ", at::IntArrayRef(shape));
  }
  if (norm_w.has_value()) {
    check_cuda_half(*norm_w, op, "norm_w", x.scalar_type());
    TORCH_CHECK(norm_w->dim() == 1 && norm_w->size(0) == k, op, ": norm_w ", norm_w->sizes(), " must be [", k,
                "], one weight per input column");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(norm_w->data_ptr()) % 16 == 0, op, ": norm_w must start on 16 bytes");
  }
  if (m == 0 && !sums_only) return out;
  c10::cuda::CUDAGuard guard(x.device());
  TORCH_CHECK(at::cuda::getCurrentDeviceProperties()->major >= 9, op, ": needs sm_90 (the copy engine)");
  SkinnyPlan plan;
  TORCH_CHECK(skinny_plan((int)m, (int)k, (int)w.size(0), x.element_size(), norm_w.has_value(), gated, plan), op,
              ": x ", x.sizes(), " by weight ", w.sizes(), norm_w.has_value() ? " with a norm" : "",
              " is outside this path (1-", kMaxRows, " rows, N a multiple of ", kTile, ", K with a part of 256-2048 "
              "columns, x (without a norm, a segment of K) and ", kMinSlots, " slots within ",
              kSmemBytes / 1024, " KB); use linear");
  const bool deferred = plan.mode == kDeferred;
  TORCH_CHECK(!sums_only || deferred, op, ": x ", x.sizes(), " by weight ", w.sizes(), " is not planned in "
              "deferred segments of K (9-16 rows where x of all of K and three slots do not fit); use skinny_linear");
  const Workspace ws = workspace();
  // deferred segments: each segment's sums, from the stream's allocator (a captured graph keeps its own)
  auto sums_shape = x.sizes().vec();
  sums_shape.back() = w.size(0);
  sums_shape.insert(sums_shape.begin(), plan.segs);
  const at::Tensor seg_out = deferred ? at::empty(sums_shape, x.options().dtype(at::kFloat)) : at::Tensor();
  SEGKI_DISPATCH_HALF(x.scalar_type(), op, [&] {
    SkinnyArgs<T> a{};
    a.x = reinterpret_cast<const T*>(x.data_ptr());
    a.w = reinterpret_cast<const T*>(w.data_ptr());
    a.residual = residual.has_value() ? reinterpret_cast<const T*>(residual->data_ptr()) : nullptr;
    a.out = sums_only ? nullptr : reinterpret_cast<T*>(out.data_ptr());
    a.norm_w = norm_w.has_value() ? reinterpret_cast<const T*>(norm_w->data_ptr()) : nullptr;
    a.norm_eps = (float)norm_eps;
    a.norm_unit_offset = norm_unit_offset;
    a.partial = ws.partial;
    a.ready = ws.ready;
    a.seg_sums = ws.seg_sums;
    a.arrived = ws.arrived;
    a.queue = ws.queues;  // launch() takes its counters from them
    a.seg_out = deferred ? seg_out.data_ptr<float>() : nullptr;
    a.m = (int)m;
    a.k = (int)k;
    a.n = (int)n;
    a.kp = plan.kp;
    a.parts = plan.parts;
    a.segs = plan.segs;
    a.ks = plan.parts * plan.kp;
    a.tiles = (int)(w.size(0) / kTile);
    a.slots = plan.slots;
    a.fill_ahead = (int)env_long("SEGKI_SKINNY_FILL", m <= kSegRows ? kFillAhead : 0, 0, kMaxSlots);
    if (gated) launch_rows<T, true>(a, plan);
    else launch_rows<T, false>(a, plan);
    if (deferred && !sums_only) launch_sum<T>(a, gated);
  });
  return sums_only ? seg_out : out;
}

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& residual,
                         bool gated, const c10::optional<at::Tensor>& norm_w, double norm_eps, bool norm_unit_offset) {
  return skinny_product("segki::skinny_linear", x, w, residual, gated, norm_w, norm_eps, norm_unit_offset, false);
}

at::Tensor skinny_linear_sums(const at::Tensor& x, const at::Tensor& w) {
  return skinny_product("segki::skinny_linear_sums", x, w, c10::nullopt, false, c10::nullopt, 0.0, false, true);
}

}  // namespace

TORCH_LIBRARY_IMPL(segki, CUDA, m) {
  m.impl("skinny_linear", &skinny_linear);
  m.impl("skinny_linear_sums", &skinny_linear_sums);
  m.impl("timeline_stamps", &timeline_stamps);
}

}  // namespace segki
