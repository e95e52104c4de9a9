// The logits processors of the decode loop, before the fused sampler (reference: ops/reference/sampling.py:
// process_logits): transformers' repetition penalty over a [B, V] mask of the tokens each row has seen, min-p after
// temperature, and the log-sum-exp of the raw logits / T (the raw log-probs' denominator). Two launches over the
// vocabulary split in slices, as the sampler's: (1) the penalised copy (fp32 arithmetic, rounded to the logits'
// dtype), its slice max, and the raw logits' slice max and sum of exps; (2) each block merges its row's slices,
// masks its slice below the min-p floor, and slice 0 writes the log-sum-exp. It replaced ~25 PyTorch kernels a
// decode step (a clone, gather/scatter, max, compare, masked write and a multi-pass fp32 log-sum-exp).
#include "common.cuh"

namespace segki {
namespace {

constexpr int kThreads = 256;

// transformers' RepetitionPenaltyLogitsProcessor on one logit of a seen token, in round-to-nearest fp32 as PyTorch
// computes it (no fused or approximate arithmetic)
__device__ __forceinline__ float penalised(float x, float p) { return x < 0.f ? __fmul_rn(x, p) : __fdiv_rn(x, p); }

// grid (splits, B): partials [B, splits, 3] = raw max of logits/T, sum exp(logits/T - that max), max of the output.
template <typename T>
__global__ void __launch_bounds__(kThreads) process_split_kernel(
    const T* __restrict__ logits, const bool* __restrict__ seen, const float* __restrict__ penalty,
    const float* __restrict__ temperature, T* __restrict__ out, float* __restrict__ part, int vocab) {
  pdl_start();  // everything below reads what earlier kernels wrote
  __shared__ float scratch[32];
  const int split = blockIdx.x, splits = gridDim.x, b = blockIdx.y;
  const int per = ((vocab + splits - 1) / splits + 7) / 8 * 8;
  const int v0 = min(vocab, split * per), v1 = min(vocab, v0 + per);
  const T* row = logits + (size_t)b * vocab;
  T* dst = out + (size_t)b * vocab;
  const bool* mark = seen == nullptr ? nullptr : seen + (size_t)b * vocab;
  const float t = temperature[b] > 0.f ? temperature[b] : 1.f, p = penalty[b];
  const bool vec = vocab % 8 == 0;
  float raw_max = -INFINITY, out_max = -INFINITY;
  if (vec) {
    for (int j = v0 + threadIdx.x * 8; j < v1; j += kThreads * 8) {
      float f[8], y[8];
      unpack8<T>(ld_cached(row + j), f);
      const uint2 m = mark == nullptr ? make_uint2(0u, 0u) : *reinterpret_cast<const uint2*>(mark + j);
      const unsigned char* hit = reinterpret_cast<const unsigned char*>(&m);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        raw_max = fmaxf(raw_max, __fdiv_rn(f[i], t));
        y[i] = hit[i] ? round_to<T>(penalised(f[i], p)) : f[i];
        out_max = fmaxf(out_max, y[i]);
      }
      *reinterpret_cast<uint4*>(dst + j) = pack8<T>(y);
    }
  } else {
    for (int j = v0 + threadIdx.x; j < v1; j += kThreads) {
      const float f = to_float<T>(row[j]);
      const float y = mark != nullptr && mark[j] ? round_to<T>(penalised(f, p)) : f;
      raw_max = fmaxf(raw_max, __fdiv_rn(f, t));
      out_max = fmaxf(out_max, y);
      dst[j] = from_float<T>(y);
    }
  }
  raw_max = block_max(raw_max, scratch);
  out_max = block_max(out_max, scratch);
  float se = 0.f;
  if (raw_max > -INFINITY) {  // the slice again, from L2
    if (vec) {
      for (int j = v0 + threadIdx.x * 8; j < v1; j += kThreads * 8) {
        float f[8];
        unpack8<T>(ld_cached(row + j), f);
#pragma unroll
        for (int i = 0; i < 8; ++i) se += expf(__fdiv_rn(f[i], t) - raw_max);
      }
    } else {
      for (int j = v0 + threadIdx.x; j < v1; j += kThreads) se += expf(__fdiv_rn(to_float<T>(row[j]), t) - raw_max);
    }
  }
  se = block_sum(se, scratch);
  if (threadIdx.x == 0) {
    float* q = part + ((size_t)b * splits + split) * 3;
    q[0] = raw_max;
    q[1] = se;
    q[2] = out_max;
  }
}

// grid (splits, B): merge the row's partials; -inf below the min-p floor max + T log(min_p) in this slice
// (min_p null: none); slice 0 writes the row's log-sum-exp.
template <typename T>
__global__ void __launch_bounds__(kThreads) process_mask_kernel(
    T* __restrict__ out, const float* __restrict__ part, const float* __restrict__ min_p,
    const float* __restrict__ temperature, float* __restrict__ lse, int vocab) {
  pdl_start();
  __shared__ float floor_shared;
  const int split = blockIdx.x, splits = gridDim.x, b = blockIdx.y, lane = threadIdx.x;
  if (threadIdx.x < 32) {
    const float* q = part + (size_t)b * splits * 3;
    float m = -INFINITY, top = -INFINITY;
    for (int s = lane; s < splits; s += 32) {
      m = fmaxf(m, q[s * 3]);
      top = fmaxf(top, q[s * 3 + 2]);
    }
    m = warp_max(m);
    top = warp_max(top);
    float se = 0.f;
    for (int s = lane; s < splits; s += 32)
      if (q[s * 3] > -INFINITY) se += q[s * 3 + 1] * expf(q[s * 3] - m);
    se = warp_sum(se);
    if (lane == 0) {
      const float t = temperature[b] > 0.f ? temperature[b] : 1.f;
      // as PyTorch rounds it: log, the product, then the sum (no fused multiply-add); log(0) = -inf: no floor
      floor_shared = min_p == nullptr ? -INFINITY : __fadd_rn(top, __fmul_rn(t, logf(min_p[b])));
      if (split == 0) lse[b] = m + logf(se);
    }
  }
  __syncthreads();
  const float floor = floor_shared;
  if (!(floor > -INFINITY)) return;
  const int per = ((vocab + splits - 1) / splits + 7) / 8 * 8;
  const int v0 = min(vocab, split * per), v1 = min(vocab, v0 + per);
  T* row = out + (size_t)b * vocab;
  const T ninf = from_float<T>(-INFINITY);
  if (vocab % 8 == 0) {
    for (int j = v0 + threadIdx.x * 8; j < v1; j += kThreads * 8) {
      uint4 u = *reinterpret_cast<const uint4*>(row + j);
      T* h = reinterpret_cast<T*>(&u);
      bool any = false;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const bool below = to_float<T>(h[i]) < floor;
        any = any || below;
        if (below) h[i] = ninf;
      }
      if (any) *reinterpret_cast<uint4*>(row + j) = u;
    }
  } else {
    for (int j = v0 + threadIdx.x; j < v1; j += kThreads)
      if (to_float<T>(row[j]) < floor) row[j] = ninf;
  }
}

std::tuple<at::Tensor, at::Tensor> process_logits(const at::Tensor& logits, const std::optional<at::Tensor>& seen,
                                                  const at::Tensor& penalty, const std::optional<at::Tensor>& min_p,
                                                  const at::Tensor& temperature) {
  const char* op = "segki::process_logits";
  check_cuda_half(logits, op, "logits", logits.scalar_type());
  TORCH_CHECK(logits.dim() == 2, op, ": logits must be [B, V]");
  const int bsz = (int)logits.size(0), vocab = (int)logits.size(1);
  auto per_row = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.is_cuda() && t.dim() == 1 && t.size(0) == bsz && t.scalar_type() == at::kFloat &&
                    t.is_contiguous(), op, ": ", name, " must be a contiguous CUDA float32 tensor [B]");
  };
  per_row(penalty, "penalty");
  per_row(temperature, "temperature");
  if (min_p.has_value()) per_row(*min_p, "min_p");
  if (seen.has_value())
    TORCH_CHECK(seen->is_cuda() && seen->scalar_type() == at::kBool && seen->is_contiguous() &&
                    seen->sizes() == logits.sizes(), op, ": seen must be a contiguous CUDA bool tensor [B, V]");
  auto out = at::empty_like(logits);
  auto lse = at::empty({bsz}, logits.options().dtype(at::kFloat));
  if (bsz == 0) return {out, lse};
  c10::cuda::CUDAGuard guard(logits.device());
  // the sampler's slicing: ~8 blocks an SM over all rows, at most 64 slices a row
  const int splits = std::max(1, std::min({(8 * sm_count() + bsz - 1) / bsz, 64, (vocab + 2047) / 2048}));
  auto part = at::empty({bsz, splits, 3}, logits.options().dtype(at::kFloat));
  auto stream = at::cuda::getCurrentCUDAStream();
  SEGKI_DISPATCH_HALF(logits.scalar_type(), op, [&] {
    launch_pdl(process_split_kernel<T>, dim3(splits, bsz), dim3(kThreads), stream, dim3(1),
               reinterpret_cast<const T*>(logits.data_ptr()), seen.has_value() ? seen->data_ptr<bool>() : nullptr,
               penalty.data_ptr<float>(), temperature.data_ptr<float>(), reinterpret_cast<T*>(out.data_ptr()),
               part.data_ptr<float>(), vocab);
    launch_pdl(process_mask_kernel<T>, dim3(splits, bsz), dim3(kThreads), stream, dim3(1),
               reinterpret_cast<T*>(out.data_ptr()), part.data_ptr<float>(),
               min_p.has_value() ? min_p->data_ptr<float>() : nullptr, temperature.data_ptr<float>(),
               lse.data_ptr<float>(), vocab);
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(segki, CUDA, m) { m.impl("process_logits", &process_logits); }

}  // namespace segki
