// LoRA paths of one projection group (q|k|v, the GDN input projections, gate|up, or one projection) added to
// their base outputs in two launches, for decode rows (no autograd):
//   lora_shrink: t[i, row, j] = x[row] . A_i[j]             (every member's rank rows, fp32 sums)
//   lora_expand: res_i[row, n] = out_i[row, n] + scale_i * (t[i, row] . B_i[n])
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
constexpr int kRowTile = 8;      // rows an expand thread adds at once (its B row read once for them)
constexpr int kThreads = 256;

template <typename W>
struct Group {
  const W* a[kMaxMembers];          // [r_i, K]
  const W* b[kMaxMembers];          // [N_i, r_i]
  const void* out[kMaxMembers];     // the base outputs: rows of N_i values, out_ld[i] apart
  void* res[kMaxMembers];           // the results, [rows, N_i] contiguous (N_i: member i's column count)
  int64_t out_ld[kMaxMembers];
  int rank[kMaxMembers];
  int col_start[kMaxMembers + 1];   // member i's columns: [col_start[i], col_start[i + 1]) of all members'
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

// grid (rank tiles, rows, members), kThreads threads: block (j, row, i) sums rank rows [4j, 4j + 4) of member i
// against x's row `row`, each thread over every kThreads-th column, then across the block.
template <typename T, typename W>
__global__ void lora_shrink_kernel(const T* __restrict__ x, int K, Group<W> g, float* __restrict__ t, int R) {
  pdl_start();  // x comes from the kernel before
  const int i = blockIdx.z, row = blockIdx.y, j0 = blockIdx.x * kRankTile, r = g.rank[i];
  if (j0 >= r) return;
  const int nj = min(kRankTile, r - j0);
  const T* xr = x + (int64_t)row * K;
  const W* a = g.a[i] + (int64_t)j0 * K;
  float acc[kRankTile] = {};
  for (int k = threadIdx.x; k < K; k += kThreads) {
    const float xv = as_float(xr[k]);
#pragma unroll
    for (int jj = 0; jj < kRankTile; ++jj)
      if (jj < nj) acc[jj] += xv * as_float(a[(int64_t)jj * K + k]);
  }
  __shared__ float scratch[kRankTile][32];
  block_sums<kRankTile>(acc, scratch);
  if (threadIdx.x < nj) {
    float v = acc[0];
#pragma unroll
    for (int jj = 1; jj < kRankTile; ++jj)
      if (threadIdx.x == jj) v = acc[jj];
    t[((int64_t)i * gridDim.y + row) * R + j0 + threadIdx.x] = round_w<W>(v);   // [members, rows, R]
  }
}

// grid (column blocks over all members' columns, row tiles), kThreads threads: one output column of one member
// for up to kRowTile rows, its B row read 16 ranks at a time.
template <typename T, typename W>
__global__ void lora_expand_kernel(Group<W> g, const float* __restrict__ t, int R, int rows) {
  pdl_start();  // t comes from lora_shrink, out from the product before it
  const int col = blockIdx.x * kThreads + threadIdx.x, row0 = blockIdx.y * kRowTile;
  if (col >= g.col_start[g.members]) return;
  int i = 0;
  while (col >= g.col_start[i + 1]) ++i;
  const int n = col - g.col_start[i], width = g.col_start[i + 1] - g.col_start[i], r = g.rank[i];
  const int nr = min(kRowTile, rows - row0);
  const W* b = g.b[i] + (int64_t)n * r;
  const float* ti = t + ((int64_t)i * rows + row0) * R;
  float acc[kRowTile] = {};
  for (int j0 = 0; j0 < r; j0 += 16) {
    float bv[16];
#pragma unroll
    for (int jj = 0; jj < 16; ++jj) bv[jj] = j0 + jj < r ? as_float(b[j0 + jj]) : 0.f;
#pragma unroll
    for (int rr = 0; rr < kRowTile; ++rr) {
      if (rr >= nr) break;
      const float* tr = ti + (int64_t)rr * R + j0;
#pragma unroll
      for (int jj = 0; jj < 16; ++jj)
        if (j0 + jj < r) acc[rr] += tr[jj] * bv[jj];
    }
  }
  const T* out = static_cast<const T*>(g.out[i]);
  T* res = static_cast<T*>(g.res[i]);
#pragma unroll
  for (int rr = 0; rr < kRowTile; ++rr) {
    if (rr >= nr) break;
    const float path = round_w<W>(round_w<W>(acc[rr]) * g.scale[i]);
    const int64_t row = row0 + rr;
    res[row * width + n] = from_float<T>(as_float(out[row * g.out_ld[i] + n]) + path);
  }
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
  int max_rank = 0, cols = 0;
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
    cols += (int)b[i].size(0);
  }
  TORCH_CHECK(max_rank >= 1 && rows <= 65535, op, ": ranks >= 1 and at most 65535 rows");
  c10::cuda::CUDAGuard guard(x.device());
  std::vector<at::Tensor> res;
  auto t = at::empty({m, rows, max_rank}, x.options().dtype(at::kFloat));
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
        g.col_start[i + 1] = g.col_start[i] + (int)b[i].size(0);
        g.scale[i] = (float)scales[i];
      }
      if (rows == 0) return;
      launch_pdl(lora_shrink_kernel<T, W>, dim3((max_rank + kRankTile - 1) / kRankTile, rows, m), dim3(kThreads),
                 stream, dim3(1), reinterpret_cast<const T*>(x.data_ptr()), (int)K, g, t.data_ptr<float>(),
                 max_rank);
      launch_pdl(lora_expand_kernel<T, W>, dim3((cols + kThreads - 1) / kThreads, (rows + kRowTile - 1) / kRowTile),
                 dim3(kThreads), stream, dim3(1), g, static_cast<const float*>(t.data_ptr<float>()), max_rank,
                 (int)rows);
    };
    if (wtype == at::kFloat) run(float{});
    else run(T{});
  });
  return res;
}

}  // namespace

TORCH_LIBRARY_IMPL(segki, CUDA, m) { m.impl("lora_add", &lora_add); }

}  // namespace segki
