// The decode step's timeline (benchmarks/step_timeline.py): while a stamp buffer is set (segki::timeline_stamps),
// the skinny product and its segments' sum kernel (skinny.cu), the GDN conv and recurrence (gdn.cu), the one-launch
// attention step (attention.cu) and the norm kernels (norm.cu) launch their stamping instantiations,
// and one thread of each block writes one record of kStampWords words:
//   [0] launch id << 32 | block, [1] SM << 32 | grid, [2] [3] %globaltimer at the block's start and end (ns; it
//   ticks every 250 ns on the H200, too coarse for a block's phases), [4 .. 4 + kPhases) the SM clock (%clock64)
//   at each Phase, [12] cycles waiting for a unit to land after the first, [13] cycles in the tile ends before the
//   last unit's, [14] the block's units (the attention step: its split's positions; the streamed recurrence: its
//   items; the kernels between: 1), [15] the SM clock when the block's last unit had landed, as its producer warp
//   saw it (the skinny product; 0 elsewhere).
// Buffer: [0] records written, [1] room for records, records from word kStampWords on. Other launches run the
// instantiations without stamps, whose code is the same as without this file.
#pragma once

#include "common.cuh"

#include <initializer_list>
#include <vector>

namespace segki {

// A block's phases. The skinny product: its start, the PDL wait's return, x's loads landed (its first pass), the
// norm's sums reduced (= loaded without a norm), x staged, the first unit landed, the last unit multiplied, its
// end. The recurrence: its start, the wait's return, its inputs landed (with the conv inside: and its outputs
// computed), the delta rule done (its state landed) and the new state's stores issued, the head's norm sums
// exchanged through the cluster (staged and first alike), its output and windows stored, its end. The attention
// step: its start, the wait's return, the prologue done (query heads and the new key in shared memory), its
// positions attended (every warp), its split merged over its warps, the cluster's splits all merged (the cluster
// barrier passed), its share of the outputs combined and stored, its end (the last cluster barrier passed). The
// kernels between them mark what they have (thread 0's view) and the phases they lack where the next one begins:
// the norm: x (and the residual) in and squared (loaded), the block's sum (reduced), its outputs stored (staged to
// last); the segments' sums: added (loaded, reduced), stored (staged to last); the conv: stored (loaded to last);
// the streamed recurrence (gdn_recurrent_pipe_kernel): its first item's state landed (loaded to first), its last
// item's output stored (last), its states' stores done (end).
enum Phase { kStart, kWaited, kLoaded, kReduced, kStaged, kFirst, kLast, kEnd, kPhases };
constexpr int kStampWords = 16;

struct Stamps {
  unsigned long long clock[kPhases];
  unsigned long long global_start, global_end, unit_wait, tile_ends;
};

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ unsigned sm_id() {
  unsigned id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}

template <bool STAMP>
__device__ __forceinline__ void mark(Stamps& st, Phase p) {
  if constexpr (STAMP) st.clock[p] = clock64();
}

// Phases from..to at once: those a kernel does not have last no time.
template <bool STAMP>
__device__ __forceinline__ void mark_until(Stamps& st, Phase from, Phase to) {
  if constexpr (STAMP) {
    const unsigned long long c = clock64();
    for (int p = from; p <= to; ++p) st.clock[p] = c;
  }
}

// The block's start: its clock, then the timer (the end takes them in the same order: the spans match).
template <bool STAMP>
__device__ __forceinline__ void mark_start(Stamps& st) {
  if constexpr (STAMP) {
    st.clock[kStart] = clock64();
    st.global_start = global_ns();
  }
}

__device__ __forceinline__ void write_stamps(unsigned long long* buf, int launch_id, Stamps& st, int units,
                                             unsigned long long landed = 0) {
  st.clock[kEnd] = clock64();
  st.global_end = global_ns();
  const unsigned long long i = atomicAdd(buf, 1ull);
  if (i >= buf[1]) return;  // full: the record is dropped (the count still says how many came)
  unsigned long long* r = buf + kStampWords * (i + 1);
  const unsigned block = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  r[0] = ((unsigned long long)(unsigned)launch_id << 32) | block;
  r[1] = ((unsigned long long)sm_id() << 32) | (gridDim.x * gridDim.y * gridDim.z);
  r[2] = st.global_start;
  r[3] = st.global_end;
#pragma unroll
  for (int j = 0; j < kPhases; ++j) r[4 + j] = st.clock[j];
  r[4 + kPhases] = st.unit_wait;
  r[5 + kPhases] = st.tile_ends;
  r[6 + kPhases] = (unsigned long long)units;
  r[7 + kPhases] = landed;
}

// The host side: the buffer later launches stamp into (null: none), and the launches made since the last
// timeline_stamps call, kStampTableCols numbers each: launch id, kind, then what the kind's launch was --
// the skinny product: rows of x, K, output columns, flags (1 gated, 2 x in registers), grid, parts of K, tiles; the
// recurrence: rows, Dk, value heads x Dv, 1 with the conv inside (else 0), grid, blocks per value head, value
// heads; the attention step: rows, D, query heads, 1 when gated (else 0), grid, splits (blocks per cluster), KV
// heads; the norm: rows, width, 0, 1 with the residual add, grid, parts of fp32 sums x comes in (0: x itself), 0;
// the segments' sums: rows, 0, output columns, gated, grid, segments, 0; the conv: rows, conv width, channels, 0,
// grid, 0, 0; the streamed recurrence: rows, Dk, value heads x Dv, 1 with the conv inside (else 0), grid, (row,
// head) items, value heads.
enum StampKind : int64_t {
  kSkinnyProduct = 0, kGdnRecurrence = 1, kAttentionStep = 2, kNorm = 3, kSegmentSums = 4, kGdnConv = 5,
  kGdnPipe = 6
};
constexpr int kStampTableCols = 9;

struct StampState {
  unsigned long long* buf = nullptr;
  int next_id = 0;
  std::vector<int64_t> table;
};

inline StampState& stamp_state() {
  static StampState state;
  return state;
}

// A stamping launch's id, with its row in the table (the seven numbers after the kind).
inline int stamp_launch(StampKind kind, std::initializer_list<int64_t> shape) {
  StampState& state = stamp_state();
  TORCH_CHECK(shape.size() == kStampTableCols - 2, "stamp_launch: ", kStampTableCols - 2, " numbers per launch");
  const int id = state.next_id++;
  state.table.push_back(id);
  state.table.push_back(kind);
  state.table.insert(state.table.end(), shape);
  return id;
}

// A launch's stamping target: while the timeline stamps, its buffer and the launch's id (its row added to the table);
// otherwise a null buffer and no row. The launch then picks its stamping instantiation by the buffer.
struct StampTarget {
  unsigned long long* buf;
  int id;
};

inline StampTarget stamp_target(StampKind kind, std::initializer_list<int64_t> shape) {
  unsigned long long* buf = stamp_state().buf;
  return {buf, buf ? stamp_launch(kind, shape) : 0};
}

// The op (registered in skinny.cu). With `stamp`, sets the buffer (int64 [kStampWords x (1 + records)], word 1 the
// room for records) that the launches from now on stamp into; without, none. Returns the launches stamped since
// the previous call, [L, kStampTableCols] on the CPU. A graph captured while a buffer is set stamps into it at
// every replay.
inline at::Tensor timeline_stamps(const at::Tensor& buf, bool stamp) {
  TORCH_CHECK(!stamp || (buf.is_cuda() && buf.is_contiguous() && buf.scalar_type() == at::kLong &&
                         buf.numel() >= 2 * kStampWords),
              "segki::timeline_stamps: the buffer must be a contiguous CUDA int64 tensor of at least ",
              2 * kStampWords, " words (a header and one record)");  // checked first: a refused buffer loses nothing
  StampState& state = stamp_state();
  const int64_t rows = (int64_t)state.table.size() / kStampTableCols;
  auto table = at::empty({rows, kStampTableCols}, at::TensorOptions().dtype(at::kLong));
  std::copy(state.table.begin(), state.table.end(), table.data_ptr<int64_t>());
  state.table.clear();
  state.buf = stamp ? reinterpret_cast<unsigned long long*>(buf.data_ptr<int64_t>()) : nullptr;
  return table;
}

}  // namespace segki
