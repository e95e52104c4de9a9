// LoRA paths of one projection group (q|k|v, the GDN input projections, gate|up, or one projection) added to
// their base outputs in two launches, for decode rows (no autograd):
//   lora_shrink: p[i, row, s, j] = x[row, slice s] . A_i[j, slice s]   (K in slices over blocks, fp32 sums)
//   lora_expand: t[i, row, j] = sum over s of p[i, row, s, j]  (in slice order)
//                res_i[row, n] = out_i[row, n] + scale_i * (t[i, row] . B_i[n])
// with peft's roundings (its lora.Linear.forward): x cast to the adapters' dtype W (fp32 adapters: exact), each
// product's sums rounded to W, the scaled path rounded to W, the base output promoted to W for the add and the sum
// rounded to the output's dtype. W is fp32 or the outputs' half dtype. Instead of peft's five or six launches a
// projection (the cast, two products, the scale, the add, the rounding), two a group. Reference:
// segki_lightning/ops/reference/lora.py.
#include <type_traits>

#include "common.cuh"

namespace segki {
namespace {

constexpr int kMaxMembers = 4;   // the GDN input projection's four (qkv, z, b, a) at most
constexpr int kRankTile = 4;     // rank rows a shrink block sums at once
constexpr int kRowTile = 8;      // rows a shrink block (A's slice read once for them) and an expand block take
constexpr int kPerThread = 4;    // elements of K a shrink thread loads for each row, all before its first product
constexpr int kThreads = 256;
constexpr int kSliceK = kThreads * kPerThread;   // elements of K a shrink block sums: K in slices over blocks

template <typename W>
struct Group {
  const W* a[kMaxMembers];          // [r_i, K]
  const W* b[kMaxMembers];          // [N_i, r_i]
  const void* out[kMaxMembers];     // the base outputs: rows of N_i values, out_ld[i] apart
  void* res[kMaxMembers];           // the results, [rows, N_i] contiguous (N_i: member i's column count)
  int64_t out_ld[kMaxMembers];
  int rank[kMaxMembers];
  int cols[kMaxMembers];            // N_i
  int block_start[kMaxMembers + 1]; // member i's expand column blocks: [block_start[i], block_start[i + 1])
  float scale[kMaxMembers];
  int members;
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

// grid (slices x rank tiles, row tiles, members), kThreads threads: block (s + slices * j, rt, i) sums slice s of
// K (kSliceK elements) of member i's rank rows [4j, 4j + 4) against x's rows [ROWS rt, ROWS rt + ROWS). Every thread
// loads its kPerThread elements of the slice for each rank row and row before the first product (one round trip to
// memory, not one per element: the whole-K loop it replaces took 5-14 us a call at any row count), then the block
// sums; the slice's fp32 sums go to p[i, row, s, j], which the expand adds in slice order.
template <typename T, typename W, int ROWS>
__global__ void lora_shrink_kernel(const T* __restrict__ x, int K, int rows, Group<W> g, int slices,
                                   float* __restrict__ p, int R) {
  pdl_start();  // x comes from the kernel before
  const int i = blockIdx.z, s = blockIdx.x % slices, j0 = blockIdx.x / slices * kRankTile;
  const int row0 = blockIdx.y * ROWS, r = g.rank[i];
  if (j0 >= r) return;
  const int nj = min(kRankTile, r - j0), nr = min(ROWS, rows - row0), k0 = s * kSliceK + threadIdx.x;
  const W* a = g.a[i] + (int64_t)j0 * K;
  float av[kRankTile][kPerThread], xv[ROWS][kPerThread];
#pragma unroll
  for (int e = 0; e < kPerThread; ++e) {
    const int k = k0 + e * kThreads;
#pragma unroll
    for (int jj = 0; jj < kRankTile; ++jj) av[jj][e] = k < K && jj < nj ? as_float(a[(int64_t)jj * K + k]) : 0.f;
#pragma unroll
    for (int rr = 0; rr < ROWS; ++rr)
      xv[rr][e] = k < K && rr < nr ? as_float(x[(int64_t)(row0 + rr) * K + k]) : 0.f;
  }
  float acc[ROWS * kRankTile];
#pragma unroll
  for (int rr = 0; rr < ROWS; ++rr)
#pragma unroll
    for (int jj = 0; jj < kRankTile; ++jj) {
      float v = 0.f;
#pragma unroll
      for (int e = 0; e < kPerThread; ++e) v += xv[rr][e] * av[jj][e];
      acc[rr * kRankTile + jj] = v;
    }
  __shared__ float scratch[ROWS * kRankTile][32];
  block_sums<ROWS * kRankTile>(acc, scratch);
#pragma unroll
  for (int q = 0; q < ROWS * kRankTile; ++q) {
    const int rr = q / kRankTile, jj = q % kRankTile;
    if (threadIdx.x == q && rr < nr && jj < nj)
      p[(((int64_t)i * rows + row0 + rr) * slices + s) * R + j0 + jj] = acc[q];   // [members, rows, slices, R]
  }
}

// grid (every member's column blocks, row tiles), kThreads threads, kRowTile * r_i floats of shared memory: block
// (c, rt) of member i first adds the shrink's slices for its rows (in slice order, then rounded to W: t = x A_i^T),
// then each thread adds one output column for up to kRowTile rows, its B row read once for them; every base output
// it adds to is loaded before the first result is stored (one round trip, not one per row).
template <typename T, typename W>
__global__ void lora_expand_kernel(Group<W> g, const float* __restrict__ p, int slices, int R, int rows) {
  extern __shared__ float ts[];   // [kRowTile, r_i]
  pdl_start();  // p comes from lora_shrink, out from the product before it
  int i = 0;
  while (i + 1 < g.members && (int)blockIdx.x >= g.block_start[i + 1]) ++i;
  const int r = g.rank[i], width = g.cols[i], row0 = blockIdx.y * kRowTile;
  const int nr = min(kRowTile, rows - row0);
  for (int q = threadIdx.x; q < nr * r; q += kThreads) {
    const float* pq = p + (((int64_t)i * rows + row0 + q / r) * slices) * R + q % r;
    float v = 0.f;
    for (int s = 0; s < slices; ++s) v += pq[(int64_t)s * R];
    ts[q] = round_w<W>(v);
  }
  __syncthreads();
  const int n = ((int)blockIdx.x - g.block_start[i]) * kThreads + threadIdx.x;
  if (n >= width) return;
  const T* out = static_cast<const T*>(g.out[i]);
  const int64_t ld = g.out_ld[i];
  float base[kRowTile];
#pragma unroll
  for (int rr = 0; rr < kRowTile; ++rr) base[rr] = rr < nr ? as_float(out[(row0 + rr) * ld + n]) : 0.f;
  const W* b = g.b[i] + (int64_t)n * r;
  float acc[kRowTile] = {};
  for (int j0 = 0; j0 < r; j0 += 16) {
    float bv[16];
#pragma unroll
    for (int jj = 0; jj < 16; ++jj) bv[jj] = j0 + jj < r ? as_float(b[j0 + jj]) : 0.f;
#pragma unroll
    for (int rr = 0; rr < kRowTile; ++rr)
#pragma unroll
      for (int jj = 0; jj < 16; ++jj)
        if (j0 + jj < r) acc[rr] += ts[rr * r + j0 + jj] * bv[jj];
  }
  T* res = static_cast<T*>(g.res[i]);
  const float scale = g.scale[i];
#pragma unroll
  for (int rr = 0; rr < kRowTile; ++rr)
    if (rr < nr)
      res[(int64_t)(row0 + rr) * width + n] = from_float<T>(base[rr] + round_w<W>(round_w<W>(acc[rr]) * scale));
}

std::vector<at::Tensor> lora_add(const at::Tensor& x, at::TensorList outs, at::TensorList a, at::TensorList b,
                                 at::ArrayRef<double> scales) {
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
  int max_rank = 0;
  std::vector<int64_t> ld(m);
  for (int i = 0; i < m; ++i) {
    check_cuda_half(a[i], op, "A", wtype);
    check_cuda_half(b[i], op, "B", wtype);
    TORCH_CHECK(a[i].dim() == 2 && a[i].size(1) == K && b[i].dim() == 2 && b[i].size(1) == a[i].size(0), op,
                ": member ", i, ": A ", a[i].sizes(), " and B ", b[i].sizes(), " do not fit x's ", K, " columns");
    ld[i] = check_rows_half(outs[i], op, "out", dtype);
    TORCH_CHECK(outs[i].size(-1) == b[i].size(0) && outs[i].numel() == rows * b[i].size(0), op, ": member ", i,
                ": output ", outs[i].sizes(), " is not ", rows, " rows of B's ", b[i].size(0), " columns");
    max_rank = std::max<int>(max_rank, (int)a[i].size(0));
  }
  TORCH_CHECK(max_rank >= 1 && max_rank <= 1024 && rows <= 65535 * kRowTile, op,
              ": ranks of 1 to 1024 and at most ", 65535 * kRowTile, " rows");
  c10::cuda::CUDAGuard guard(x.device());
  std::vector<at::Tensor> res;
  const int slices = (int)((K + kSliceK - 1) / kSliceK);
  auto p = at::empty({m, rows, slices, max_rank}, x.options().dtype(at::kFloat));   // the shrink's slice sums
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  SEGKI_DISPATCH_HALF(dtype, op, [&] {
    auto run = [&](auto w_tag) {
      using W = decltype(w_tag);
      Group<W> g = {};
      g.members = m;
      for (int i = 0; i < m; ++i) {
        res.push_back(at::empty(outs[i].sizes(), outs[i].options().memory_format(at::MemoryFormat::Contiguous)));
        g.a[i] = reinterpret_cast<const W*>(a[i].data_ptr());
        g.b[i] = reinterpret_cast<const W*>(b[i].data_ptr());
        g.out[i] = outs[i].data_ptr();
        g.res[i] = res.back().data_ptr();
        g.out_ld[i] = ld[i];
        g.rank[i] = (int)a[i].size(0);
        g.cols[i] = (int)b[i].size(0);
        g.block_start[i + 1] = g.block_start[i] + (g.cols[i] + kThreads - 1) / kThreads;
        g.scale[i] = (float)scales[i];
      }
      if (rows == 0) return;
      const dim3 shrink_grid(slices * ((max_rank + kRankTile - 1) / kRankTile), 1, m);
      const T* xp = reinterpret_cast<const T*>(x.data_ptr());
      if (rows == 1) {   // one row: no row tile to fill
        launch_pdl(lora_shrink_kernel<T, W, 1>, shrink_grid, dim3(kThreads), stream, dim3(1), xp, (int)K, (int)rows,
                   g, slices, p.data_ptr<float>(), max_rank);
      } else {
        launch_pdl(lora_shrink_kernel<T, W, kRowTile>,
                   dim3(shrink_grid.x, (unsigned)((rows + kRowTile - 1) / kRowTile), m), dim3(kThreads), stream,
                   dim3(1), xp, (int)K, (int)rows, g, slices, p.data_ptr<float>(), max_rank);
      }
      launch_pdl_smem(lora_expand_kernel<T, W>,
                      dim3(g.block_start[m], (unsigned)((rows + kRowTile - 1) / kRowTile)), dim3(kThreads),
                      kRowTile * max_rank * sizeof(float), stream, dim3(1), g,
                      static_cast<const float*>(p.data_ptr<float>()), slices, max_rank, (int)rows);
    };
    if (wtype == at::kFloat) run(float{});
    else run(T{});
  });
  return res;
}

}  // namespace

TORCH_LIBRARY_IMPL(segki, CUDA, m) { m.impl("lora_add", &lora_add); }

}  // namespace segki
