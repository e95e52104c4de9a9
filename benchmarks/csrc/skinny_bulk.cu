// A 16- or 32-row GEMM (out = x . W^T, fp32 out) built the copy-engine way (benchmarks/skinny_bulk.py): one block
// per SM owns a range of 16-row weight tiles and streams them through a ring of shared-memory slots by
// cp.async.bulk (one copy per weight row, into rows padded to 2064 bytes so ldmatrix reads without bank
// conflicts); x sits in shared memory for the block's life; every warp multiplies its 128-column K slice of the
// tile on tensor cores (mma.m16n8k16, bf16 in, fp32 sums) and the 8 slices are summed through shared memory.
// Weights and x have K = 1024 (the 0.8B hidden size). The question it answers: whether the copy-engine design
// streams the 0.8B projections at 16-32 rows (GRPO's rollout batches) faster than cuBLAS, before any of it goes
// into the library's GEMV.
#include <cuda_bf16.h>

#include "bulk.cuh"
#include "common.cuh"

namespace segki_bench {
namespace {

using namespace segki;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kK = 1024;             // row length of W and x
constexpr int kRowPad = kK + 8;      // shared-memory row stride (elements): 2064 bytes, 16 bytes of bank skew
constexpr int kTileRows = 16;        // weight rows per slot: one mma m-tile
constexpr int kSlots = 3;
constexpr int kWarpK = kK / kWarps;  // 128 columns of K per warp
constexpr int kRedStride = kTileRows + 1;

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// Lanes 0-15 of the calling warp copy the 16 rows of weight tile `tile` into `slot`, completing on `bar`.
__device__ __forceinline__ void issue_tile(const __nv_bfloat16* w, int tile, __nv_bfloat16* slot, uint64_t* bar) {
  const int lane = threadIdx.x & 31;
  if (lane == 0) mbar_expect(bar, kTileRows * kK * 2);
  __syncwarp();
  if (lane < kTileRows)
    bulk_load(slot + (size_t)lane * kRowPad, w + ((size_t)tile * kTileRows + lane) * kK, kK * 2, bar);
}

// grid: one block per SM; NT = rows of x / 8 (2 or 4). out [NT * 8, n] fp32.
template <int NT>
__global__ void __launch_bounds__(kThreads, 1) skinny_kernel(const __nv_bfloat16* __restrict__ w,
                                                           const __nv_bfloat16* __restrict__ x,
                                                           float* __restrict__ out, int n) {
  constexpr int M = NT * 8;
  extern __shared__ __align__(128) unsigned char smem[];
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem);                         // [M][kRowPad]
  __nv_bfloat16* ring = xs + M * kRowPad;                                             // [kSlots][16][kRowPad]
  float* red = reinterpret_cast<float*>(ring + kSlots * kTileRows * kRowPad);         // [kWarps][M][kRedStride]
  __shared__ __align__(8) uint64_t full[kSlots];
  const int tiles = n / kTileRows;
  const int t0 = (int)((long long)blockIdx.x * tiles / gridDim.x);
  const int t1 = (int)((long long)(blockIdx.x + 1) * tiles / gridDim.x);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kSlots; ++s) mbar_init(&full[s]);
    bulk_fence_init();
  }
  __syncthreads();
  if (warp == 0)
    for (int s = 0; s < kSlots && t0 + s < t1; ++s) issue_tile(w, t0 + s, ring + s * kTileRows * kRowPad, &full[s]);
  for (int i = threadIdx.x; i < M * kK / 8; i += kThreads) {  // x into padded rows, once
    const int r = i / (kK / 8), c = i % (kK / 8);
    *reinterpret_cast<uint4*>(xs + r * kRowPad + c * 8) = ld_cached(x + (size_t)r * kK + c * 8);
  }
  __syncthreads();
  for (int tile = t0, c = 0; tile < t1; ++tile, ++c) {
    const int slot = c % kSlots;
    const __nv_bfloat16* ws = ring + slot * kTileRows * kRowPad;
    mbar_wait(&full[slot], (unsigned)(c / kSlots) & 1u);
    float acc[NT][4] = {};
#pragma unroll
    for (int kk = 0; kk < kWarpK; kk += 16) {
      const int k0 = warp * kWarpK + kk;
      unsigned a[4];  // rows 0-7 / 8-15 x columns k0-7 / k0+8-15
      ldmatrix_x4(a, ws + ((lane & 7) + 8 * ((lane >> 3) & 1)) * kRowPad + k0 + 8 * (lane >> 4));
#pragma unroll
      for (int j = 0; j < NT; j += 2) {  // x rows 8j-8j+15: b of n-tiles j and j + 1
        unsigned b[4];
        ldmatrix_x4(b, xs + (j * 8 + (lane & 7) + 8 * (lane >> 4)) * kRowPad + k0 + 8 * ((lane >> 3) & 1));
        mma16816<__nv_bfloat16>(acc[j], a[0], a[1], a[2], a[3], b[0], b[1]);
        mma16816<__nv_bfloat16>(acc[j + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
      }
    }
    __syncthreads();  // every warp has read the slot (and the previous tile's sums out of `red`)
    if (warp == 0 && t0 + c + kSlots < t1) {
      bulk_fence_reuse();
      issue_tile(w, tile + kSlots, ring + slot * kTileRows * kRowPad, &full[slot]);
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {  // acc[j]: weight rows g, g + 8 x x rows 8j + 2t, 8j + 2t + 1
      float* r = red + (warp * M + j * 8 + 2 * t) * kRedStride + g;
      r[0] = acc[j][0];
      r[kRedStride] = acc[j][1];
      r[8] = acc[j][2];
      r[kRedStride + 8] = acc[j][3];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < M * kTileRows; i += kThreads) {
      const int m = i / kTileRows, row = i % kTileRows;
      float s = 0.f;
#pragma unroll
      for (int v = 0; v < kWarps; ++v) s += red[(v * M + m) * kRedStride + row];
      out[(size_t)m * n + (size_t)tile * kTileRows + row] = s;
    }
  }
}

void gemm(const at::Tensor& w, const at::Tensor& x, at::Tensor& out) {
  TORCH_CHECK(w.is_cuda() && x.is_cuda() && out.is_cuda() && w.is_contiguous() && x.is_contiguous() &&
                  out.is_contiguous(), "w, x, out: contiguous CUDA tensors");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kFloat,
              "w and x bf16, out fp32");
  const int n = (int)w.size(0), m = (int)x.size(0);
  TORCH_CHECK(w.dim() == 2 && x.dim() == 2 && w.size(1) == kK && x.size(1) == kK && n % kTileRows == 0,
              "w [N, 1024] with N a multiple of 16, x [M, 1024]");
  TORCH_CHECK(m == 16 || m == 32, "x has 16 or 32 rows");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m && out.size(1) == n, "out [M, N]");
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  auto stream = at::cuda::getCurrentCUDAStream();
  const auto* wp = reinterpret_cast<const __nv_bfloat16*>(w.data_ptr());
  const auto* xp = reinterpret_cast<const __nv_bfloat16*>(x.data_ptr());
  auto run = [&](auto kernel, int rows) {
    const int smem = (rows + kSlots * kTileRows) * kRowPad * 2 + kWarps * rows * kRedStride * 4;
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    kernel<<<sms, kThreads, smem, stream>>>(wp, xp, out.data_ptr<float>(), n);
  };
  if (m == 16)
    run(skinny_kernel<2>, 16);
  else
    run(skinny_kernel<4>, 32);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY(segki_skinny, m) { m.def("gemm(Tensor w, Tensor x, Tensor(a!) out) -> ()"); }

TORCH_LIBRARY_IMPL(segki_skinny, CUDA, m) { m.impl("gemm", &gemm); }

}  // namespace segki_bench
