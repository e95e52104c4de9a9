// LoRA paths of one projection group (q|k|v, the GDN input projections, gate|up, or one projection) added to
// their base outputs in two launches, for decode rows (no autograd):
//   lora_shrink: part[i, s, row, j] = x[row, slice s] . A_i[j, slice s]   (K in slices: fp32 partial sums)
//   lora_expand: t = the slices' partials summed in slice order; res_i[row, n] = out_i[row, n] + scale_i * (t . B_i[n])
// with peft's roundings (its lora.Linear.forward): x cast to the adapters' dtype W (fp32 adapters: exact), each
// product's sums rounded to W, the scaled path rounded to W, the base output promoted to W for the add and the sum
// rounded to the output's dtype. W is fp32 or the outputs' half dtype. Instead of peft's five or six launches a
// projection (the cast, two products, the scale, the add, the rounding), two a group. The expand can also finish
// what the projection's own launch would have fused after it: the residual add of an output projection (one
// member: res + residual, rounded) or the MLP's SiLU gate (gate|up: silu(gate') * up', rounded once); and the shrink
// can take x before the RMSNorm that a product runs in its prologue (the norm then needs no launch of its own).
// Reference: segki_lightning/ops/reference/lora.py.
//
// Each A is read once per row tile of 8 rows (a shrink block stages a slice of it in shared memory for its rows,
// one warp a row), each B row once per expand block (its thread keeps it in registers for the block's rows): at
// 64 rows the first form (a block per row and 4 ranks) re-read each A 64 times from L2 (results/lora_gpu/). Both
// grids take the rows in tiles of 8: with every row in each expand block, its few blocks (20 for a 2560-column
// down projection) walked 64 rows one after another, and the partials' bound left the shrink 32 blocks; 4B r=16
// at 64 rows then ran at 0.39x full weights (NOTES v66).
#include <type_traits>

#include "common.cuh"

namespace segki {
namespace {

constexpr int kMaxMembers = 4;   // the GDN input projection's four (qkv, z, b, a) at most
constexpr int kMaxRank = 64;     // ranks a member may have (the expand keeps a B row in registers)
constexpr int kMaxRows = 64;     // rows of x
constexpr int kTileRows = 8;     // rows a shrink block (one warp a row) and an expand block take
constexpr int kTileFloats = 8192;  // A's tile in a shrink block's shared memory: RT rank rows x a slice of K, 32 KB
constexpr int kMaxPartials = 4096;   // t's partial sums an expand block reads a member (its rows x ranks x slices)
constexpr int kExpandThreads = 128;  // columns an expand block takes: one thread a column

template <typename W>
struct Group {
  const W* a[kMaxMembers];            // [r_i, K]
  const W* b[kMaxMembers];            // [N_i, r_i]
  const void* out[kMaxMembers];       // the base outputs: rows of N_i values, out_ld[i] apart
  void* res[kMaxMembers];             // the results, [rows, N_i] contiguous (silu: one, [rows, N_0])
  int64_t out_ld[kMaxMembers];
  int rank[kMaxMembers];
  int cols[kMaxMembers];              // N_i
  int tile_start[kMaxMembers + 1];    // member i's expand blocks: [tile_start[i], tile_start[i + 1])
  float scale[kMaxMembers];
  int members;
  const void* residual;               // one member: added to its result after the rounding, or nullptr
  int64_t residual_ld;
  bool silu;                          // two members (gate, up): the one result silu(gate') * up'
  const void* norm_w;                 // the RMSNorm x goes through first (its weight, [K]), or nullptr
  float norm_eps;
  bool norm_unit_offset;
};

__device__ __forceinline__ float as_float(float v) { return v; }
__device__ __forceinline__ float as_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float as_float(__half v) { return __half2float(v); }

// A float rounded to W's precision (fp32: itself).
template <typename W>
__device__ __forceinline__ float round_w(float v) {
  if constexpr (std::is_same_v<W, float>) return v;
  else return round_to<W>(v);
}

// grid (slices of K, members, row tiles), kTileRows warps: block (s, i, rt) stages RT rank rows at a time of
// member i's A, columns [s * slice, (s + 1) * slice), in shared memory; warp w sums row rt * 8 + w of x against
// them, each lane over every 32nd column, then across the warp; with a norm, x's row normalized on the way (its
// sum of squares over the whole row first; each value rounded to x's dtype, as the norm kernel writes it and the
// product's norm prologue stages it). A is read after the wait: an optimizer step before an eager call may have
// written it.
template <typename T, typename W, int RT>
__global__ void __launch_bounds__(kTileRows * 32)
    lora_shrink_kernel(const T* __restrict__ x, int K, int rows, int slice, Group<W> g, float* __restrict__ part,
                       int R) {
  pdl_start();  // x comes from the kernel before
  __shared__ float a_s[kTileFloats];   // [RT, kn]
  const int s = blockIdx.x, i = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row = blockIdx.z * kTileRows + warp, r = g.rank[i], k0 = s * slice, kn = min(slice, K - k0);
  const T* xr = x + (int64_t)row * K + k0;
  float* p = part + (((int64_t)i * gridDim.x + s) * rows + row) * R;   // [members, slices, rows, R]
  const T* norm_w = static_cast<const T*>(g.norm_w);
  float inv = 0.f;
  if (norm_w != nullptr && row < rows) {
    float ss = 0.f;
    for (int k = lane; k < K; k += 32) {
      const float v = as_float(x[(int64_t)row * K + k]);
      ss = fmaf(v, v, ss);
    }
    inv = rms_inverse(warp_sum(ss), K, g.norm_eps);
  }
  for (int j0 = 0; j0 < r; j0 += RT) {
    const int nj = min(RT, r - j0);
    __syncthreads();  // the last tile's reads are done
    for (int e = threadIdx.x; e < RT * kn; e += blockDim.x) {
      const int jj = e / kn;
      a_s[e] = jj < nj ? as_float(g.a[i][(int64_t)(j0 + jj) * K + k0 + e - jj * kn]) : 0.f;
    }
    __syncthreads();
    if (row >= rows) continue;
    float acc[RT] = {};
    for (int kk = lane; kk < kn; kk += 32) {
      float xv = as_float(xr[kk]);   // x in W: exact (W is fp32 or x's own dtype)
      if (norm_w != nullptr) xv = round_to<T>(rms_scaled<T>(xv, inv, as_float(norm_w[k0 + kk]), g.norm_unit_offset));
#pragma unroll
      for (int jj = 0; jj < RT; ++jj) acc[jj] += xv * a_s[jj * kn + kk];
    }
    float mine = 0.f;
#pragma unroll
    for (int jj = 0; jj < RT; ++jj) {
      const float v = warp_sum(acc[jj]);
      if (lane == jj) mine = v;
    }
    if (lane < nj) p[j0 + lane] = mine;
  }
}

// Member i's path at column n, row by row: t's row (shared memory) . B_i[n] (held in registers), rounded and scaled
// as peft does.
template <typename W, int RMAX>
struct ColumnPath {
  float bv[RMAX];
  int r;
  float scale;

  __device__ __forceinline__ ColumnPath(const Group<W>& g, int i, int n) : r(g.rank[i]), scale(g.scale[i]) {
    const W* b = g.b[i] + (int64_t)n * r;
#pragma unroll
    for (int j = 0; j < RMAX; ++j) bv[j] = j < r ? as_float(b[j]) : 0.f;
  }

  __device__ __forceinline__ float operator()(const float* t_row) const {
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < RMAX; ++j)
      if (j < r) acc += t_row[j] * bv[j];
    return round_w<W>(round_w<W>(acc) * scale);
  }
};

// grid (expand blocks of every member (silu: of the gate's columns), row tiles), kExpandThreads threads, dynamic
// shared memory for t of the block's members and rows ([members, kTileRows, R]): first the slices' partials summed
// (slice order) into t, rounded to W; then one column per thread, the tile's rows (its B row in registers: RMAX >=
// every rank).
template <typename T, typename W, int RMAX>
__global__ void __launch_bounds__(kExpandThreads)
    lora_expand_kernel(Group<W> g, const float* __restrict__ part, int slices, int R, int rows) {
  pdl_start();  // part comes from lora_shrink, out from the product before it
  extern __shared__ float t_s[];
  int i = 0;
  while ((int)blockIdx.x >= g.tile_start[i + 1]) ++i;
  const int first = g.silu ? 0 : i, nm = g.silu ? 2 : 1;
  const int r0 = blockIdx.y * kTileRows, nr = min(kTileRows, rows - r0);   // the tile's rows [r0, r0 + nr)
  for (int mm = 0; mm < nm; ++mm) {
    const int ii = first + mm, r = g.rank[ii];
    const float* pi = part + (int64_t)ii * slices * rows * R;
    for (int e = threadIdx.x; e < nr * r; e += blockDim.x) {
      const int lr = e / r, j = e - lr * r;
      float v = 0.f;
      for (int s = 0; s < slices; ++s) v += pi[((int64_t)s * rows + r0 + lr) * R + j];
      t_s[(mm * kTileRows + lr) * R + j] = round_w<W>(v);
    }
  }
  __syncthreads();
  const int n = ((int)blockIdx.x - g.tile_start[i]) * kExpandThreads + threadIdx.x;
  if (n >= g.cols[i]) return;
  const ColumnPath<W, RMAX> path(g, first, n);
  const T* out = static_cast<const T*>(g.out[first]) + n;
  T* res = static_cast<T*>(g.res[first]) + n;
  const int width = g.cols[i];
  if (g.silu) {   // the gate's result and the up's, each rounded, then silu(gate) * up rounded once
    const ColumnPath<W, RMAX> up_path(g, 1, n);
    const T* up = static_cast<const T*>(g.out[1]) + n;
    for (int lr = 0; lr < nr; ++lr) {
      const int64_t row = r0 + lr;
      const float gv = round_to<T>(as_float(out[row * g.out_ld[0]]) + path(t_s + lr * R));
      const float uv = round_to<T>(as_float(up[row * g.out_ld[1]]) + up_path(t_s + (kTileRows + lr) * R));
      res[(int64_t)row * width] = from_float<T>(silu(gv) * uv);
    }
    return;
  }
  const T* resid = static_cast<const T*>(g.residual) + n;
  for (int lr = 0; lr < nr; ++lr) {
    const int64_t row = r0 + lr;
    float v = as_float(out[row * g.out_ld[first]]) + path(t_s + lr * R);
    if (g.residual != nullptr) v = round_to<T>(v) + as_float(resid[row * g.residual_ld]);
    res[(int64_t)row * width] = from_float<T>(v);
  }
}

// Columns of K a shrink block takes: thin slices where the rows are few (enough blocks to cover the SMs about twice),
// as few slices as each expand block can sum for its rows (kMaxPartials), whole multiples of 32 columns.
int slice_cols(int64_t K, int members, int64_t rows, int rank) {
  const int64_t row_tiles = (rows + kTileRows - 1) / kTileRows, tile_rows = std::min<int64_t>(rows, kTileRows);
  const int64_t wanted = (2 * sm_count() + members * row_tiles - 1) / (members * row_tiles);
  const int64_t slices = std::max<int64_t>({1, std::min<int64_t>(wanted, kMaxPartials / (tile_rows * rank)),
                                            (K + kTileFloats - 1) / kTileFloats});   // a slice fits one A row's tile
  const int64_t cols = ((K + slices - 1) / slices + 31) / 32 * 32;
  return (int)std::max<int64_t>(cols, 64);
}

std::vector<at::Tensor> lora_add(const at::Tensor& x, at::TensorList outs, at::TensorList a, at::TensorList b,
                                 at::ArrayRef<double> scales, const c10::optional<at::Tensor>& residual, bool silu,
                                 const c10::optional<at::Tensor>& norm_w, double norm_eps, bool norm_unit_offset) {
  const char* op = "segki::lora_add";
  const int m = (int)outs.size();
  TORCH_CHECK(m >= 1 && m <= kMaxMembers && (int)a.size() == m && (int)b.size() == m && (int)scales.size() == m,
              op, ": 1 to ", kMaxMembers, " members, each with an output, A, B and a scale");
  const at::ScalarType dtype = x.scalar_type();
  check_cuda_half(x, op, "x", dtype);
  const int64_t K = x.size(-1), rows = x.numel() / std::max<int64_t>(K, 1);
  const at::ScalarType wtype = a[0].scalar_type();
  TORCH_CHECK(wtype == at::kFloat || wtype == dtype, op, ": adapters of dtype ", wtype, " with outputs of ", dtype,
              " (fp32 or the outputs' dtype)");
  TORCH_CHECK(rows >= 1 && rows <= kMaxRows, op, ": 1 to ", kMaxRows, " rows (got ", rows, ")");
  TORCH_CHECK(!silu || m == 2, op, ": silu takes two members (gate, up), got ", m);
  TORCH_CHECK(!residual.has_value() || (m == 1 && !silu), op, ": a residual goes with one member and no silu");
  int max_rank = 0;
  std::vector<int64_t> ld(m);
  for (int i = 0; i < m; ++i) {
    check_cuda_half(a[i], op, "A", wtype);
    check_cuda_half(b[i], op, "B", wtype);
    TORCH_CHECK(a[i].dim() == 2 && a[i].size(1) == K && b[i].dim() == 2 && b[i].size(1) == a[i].size(0), op,
                ": member ", i, ": A ", a[i].sizes(), " and B ", b[i].sizes(), " do not fit x's ", K, " columns");
    TORCH_CHECK(a[i].size(0) >= 1 && a[i].size(0) <= kMaxRank, op, ": member ", i, ": rank ", a[i].size(0),
                " (1 to ", kMaxRank, ")");
    ld[i] = check_rows_half(outs[i], op, "out", dtype);
    TORCH_CHECK(outs[i].size(-1) == b[i].size(0) && outs[i].numel() == rows * b[i].size(0), op, ": member ", i,
                ": output ", outs[i].sizes(), " is not ", rows, " rows of B's ", b[i].size(0), " columns");
    max_rank = std::max<int>(max_rank, (int)a[i].size(0));
  }
  TORCH_CHECK(!silu || outs[0].sizes() == outs[1].sizes(), op, ": silu's gate ", outs[0].sizes(), " and up ",
              outs[1].sizes(), " differ");
  int64_t residual_ld = 0;
  if (residual.has_value()) {
    residual_ld = check_rows_half(*residual, op, "residual", dtype);
    TORCH_CHECK(residual->numel() == outs[0].numel() && residual->size(-1) == outs[0].size(-1), op, ": residual ",
                residual->sizes(), " is not shaped as the output ", outs[0].sizes());
  }
  if (norm_w.has_value()) {
    check_cuda_half(*norm_w, op, "norm_w", dtype);
    TORCH_CHECK(norm_w->numel() == K, op, ": norm_w of ", norm_w->numel(), " values for x's ", K, " columns");
  }
  c10::cuda::CUDAGuard guard(x.device());
  const int row_tiles = (int)((rows + kTileRows - 1) / kTileRows);
  const int slice = slice_cols(K, m, rows, max_rank), slices = (int)((K + slice - 1) / slice);
  auto part = at::empty({m, slices, rows, max_rank}, x.options().dtype(at::kFloat));
  std::vector<at::Tensor> res;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  SEGKI_DISPATCH_HALF(dtype, op, [&] {
    auto run = [&](auto w_tag) {
      using W = decltype(w_tag);
      Group<W> g = {};
      g.members = m;
      g.silu = silu;
      g.residual = residual.has_value() ? residual->data_ptr() : nullptr;
      g.residual_ld = residual_ld;
      g.norm_w = norm_w.has_value() ? norm_w->data_ptr() : nullptr;
      g.norm_eps = (float)norm_eps;
      g.norm_unit_offset = norm_unit_offset;
      for (int i = 0; i < m; ++i) {
        if (!silu || i == 0)
          res.push_back(at::empty(outs[i].sizes(), outs[i].options().memory_format(at::MemoryFormat::Contiguous)));
        g.a[i] = reinterpret_cast<const W*>(a[i].data_ptr());
        g.b[i] = reinterpret_cast<const W*>(b[i].data_ptr());
        g.out[i] = outs[i].data_ptr();
        g.res[i] = res.back().data_ptr();
        g.out_ld[i] = ld[i];
        g.rank[i] = (int)a[i].size(0);
        g.cols[i] = (int)b[i].size(0);
        const int tiles = silu && i == 1 ? 0 : (g.cols[i] + kExpandThreads - 1) / kExpandThreads;
        g.tile_start[i + 1] = g.tile_start[i] + tiles;
        g.scale[i] = (float)scales[i];
      }
      const float* parts = part.data_ptr<float>();
      auto shrink = [&](auto kernel) {
        launch_pdl(kernel, dim3(slices, m, row_tiles), dim3(kTileRows * 32), stream, dim3(1),
                   reinterpret_cast<const T*>(x.data_ptr()), (int)K, (int)rows, slice, g, part.data_ptr<float>(),
                   max_rank);
      };
      if (slice * 16 <= kTileFloats) shrink(lora_shrink_kernel<T, W, 16>);
      else if (slice * 4 <= kTileFloats) shrink(lora_shrink_kernel<T, W, 4>);
      else shrink(lora_shrink_kernel<T, W, 1>);
      const int smem = (silu ? 2 : 1) * kTileRows * max_rank * (int)sizeof(float);   // at most 4 KB
      auto expand = [&](auto kernel) {
        launch_pdl_smem(kernel, dim3(g.tile_start[m], row_tiles), dim3(kExpandThreads), smem, stream, dim3(1), g,
                        parts, slices, max_rank, (int)rows);
      };
      if (max_rank <= 16) expand(lora_expand_kernel<T, W, 16>);
      else if (max_rank <= 32) expand(lora_expand_kernel<T, W, 32>);
      else expand(lora_expand_kernel<T, W, 64>);
    };
    if (wtype == at::kFloat) run(float{});
    else run(T{});
  });
  return res;
}

}  // namespace

TORCH_LIBRARY_IMPL(segki, CUDA, m) { m.impl("lora_add", &lora_add); }

}  // namespace segki
