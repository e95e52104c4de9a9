// RMSNorm and residual-add + RMSNorm, one block per row, fp32 statistics, both weight forms:
//   unit_offset=false: w * to_T(x * rsqrt(mean(x^2) + eps))        (Llama, Qwen3)
//   unit_offset=true:  to_T(x * rsqrt(mean(x^2) + eps) * (1 + w))  (Qwen3.5), 1 + w from the live weight
// The residual add also takes x as fp32 sums in parts (add_rms_norm_sums: the deferred segments of K of a skinny
// product, csrc/skinny.cu), added in part order and rounded as the product's own epilogue would: the product's sum
// kernel and this one's launch become one.
#include "common.cuh"
#include "timeline.cuh"

namespace segki {
namespace {

constexpr int kThreads = 256;

constexpr int kStride = kThreads * 8;  // columns between a thread's stretches of 8
constexpr int kHeld = 2;                // stretches a thread keeps in registers: rows up to 4096 wide (the 4B's 2560)

// SUMS: x comes as `parts` fp32 sums [parts][rows][h] (with the residual add only). STAMP: the timeline's
// instantiation (timeline.cuh; thread 0 of each block writes its record into `stamps`).
template <typename T, bool ADD, bool SUMS, bool STAMP>
__global__ void __launch_bounds__(kThreads) rms_norm_kernel(const T* __restrict__ x, const float* __restrict__ sums,
                                                            int parts, const T* __restrict__ res,
                                                            const T* __restrict__ w, T* __restrict__ out,
                                                            T* __restrict__ new_res, int h, float eps,
                                                            bool unit_offset, unsigned long long* stamps,
                                                            int launch_id) {
  static_assert(ADD || !SUMS, "x in sums is taken with the residual add");
  Stamps st{};
  mark_start<STAMP>(st);
  __shared__ float scratch[32];
  const size_t row = blockIdx.x;
  const T* xr = x + row * h;
  const int i0 = threadIdx.x * 8;
  auto x_at = [&](int i) {  // eight columns of x; from sums: added in part order, rounded to T
    if constexpr (SUMS) {
      float v[8];
      sum_parts<8, 4>(sums + row * h + i, parts, (size_t)gridDim.x * h, v);  // 4 at once: 80 registers
      return pack8<T>(v);
    } else {
      return ld_cached(xr + i);
    }
  };
  // The held stretches' weights go out before the wait (a parameter no kernel of the step writes); their x (and
  // residual) all at once after it, so pass 2 reads nothing from memory for them: the 4B's 2560-wide rows took a
  // second round trip for the second stretch's weight after the reduction's barriers, and one for its x.
  uint4 wq[kHeld], xq[kHeld], rq[kHeld];
#pragma unroll
  for (int s = 0; s < kHeld; ++s)
    wq[s] = i0 + s * kStride < h ? ld_cached(w + i0 + s * kStride) : make_uint4(0, 0, 0, 0);
  pdl_start();  // everything below reads what earlier kernels wrote
  mark<STAMP>(st, kWaited);
#pragma unroll
  for (int s = 0; s < kHeld; ++s) {
    const int i = i0 + s * kStride;
    xq[s] = i < h ? x_at(i) : make_uint4(0, 0, 0, 0);
    if constexpr (ADD) rq[s] = i < h ? ld_cached(res + row * h + i) : make_uint4(0, 0, 0, 0);
  }
  float held[kHeld][8] = {};
  float ss = 0.f;
  // pass 1: (add,) sum of squares, stretch by stretch in column order (the held ones first: the same order as one loop)
  auto add_in = [&](float (&v)[8], const uint4& xv, const uint4& rv, int i) {
    unpack8<T>(xv, v);
    if constexpr (ADD) {
      float r[8];
      unpack8<T>(rv, r);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = round_to<T>(r[j] + v[j]);
      *reinterpret_cast<uint4*>(new_res + row * h + i) = pack8<T>(v);
    }
    ss = add_squares8(v, ss);
  };
#pragma unroll
  for (int s = 0; s < kHeld; ++s)
    if (i0 + s * kStride < h) add_in(held[s], xq[s], rq[s], i0 + s * kStride);
  for (int i = i0 + kHeld * kStride; i < h; i += kStride) {
    float v[8];
    add_in(v, x_at(i), ADD ? ld_cached(res + row * h + i) : make_uint4(0, 0, 0, 0), i);
  }
  mark<STAMP>(st, kLoaded);
  const float inv = rms_inverse(block_sum(ss, scratch), h, eps);
  mark<STAMP>(st, kReduced);
  auto scale_out = [&](float (&v)[8], const uint4& wv, int i) {
    float wf[8];
    unpack8<T>(wv, wf);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = rms_scaled<T>(v[j], inv, wf[j], unit_offset);
    *reinterpret_cast<uint4*>(out + row * h + i) = pack8<T>(v);
  };
#pragma unroll
  for (int s = 0; s < kHeld; ++s)  // pass 2: normalize and scale; the held values are the ones memory holds
    if (i0 + s * kStride < h) scale_out(held[s], wq[s], i0 + s * kStride);
  const T* src = ADD ? new_res + row * h : xr;
  for (int i = i0 + kHeld * kStride; i < h; i += kStride) {
    float v[8];
    unpack8<T>(ADD ? *reinterpret_cast<const uint4*>(src + i) : ld_cached(src + i), v);
    scale_out(v, ld_cached(w + i), i);
  }
  mark_until<STAMP>(st, kStaged, kLast);
  if constexpr (STAMP) {
    if (threadIdx.x == 0) write_stamps(stamps, launch_id, st, 1);
  }
}

// x: the rows normalized (`name`: what the op calls them).
void check_norm(const char* op, const at::Tensor& x, const at::Tensor& w, const char* name = "x") {
  check_cuda_half(x, op, name, x.scalar_type());
  check_cuda_half(w, op, "weight", x.scalar_type());
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(-1), op, ": weight ", w.sizes(), " does not match width ",
              x.size(-1));
  TORCH_CHECK(x.size(-1) % 8 == 0, op, ": width ", x.size(-1), " must be a multiple of 8");
}

// x: the rows [..., h] (of out's dtype), or with SUMS the fp32 sums [parts, ..., h].
template <bool ADD, bool SUMS = false>
void launch(const char* op, const at::Tensor& x, const at::Tensor* res, const at::Tensor& w, at::Tensor& out,
            at::Tensor* new_res, double eps, bool unit_offset) {
  const int h = (int)out.size(-1);
  const int rows = (int)(out.numel() / h);
  if (rows == 0) return;
  c10::cuda::CUDAGuard guard(x.device());
  const int parts = SUMS ? (int)x.size(0) : 0;
  const StampTarget stamp = stamp_target(kNorm, {rows, h, 0, ADD ? 1 : 0, rows, parts, 0});
  SEGKI_DISPATCH_HALF(out.scalar_type(), op, [&] {
    launch_pdl(stamp.buf ? rms_norm_kernel<T, ADD, SUMS, true> : rms_norm_kernel<T, ADD, SUMS, false>, dim3(rows),
        dim3(kThreads), at::cuda::getCurrentCUDAStream(), dim3(1),
        SUMS ? nullptr : reinterpret_cast<const T*>(x.data_ptr()),
        SUMS ? reinterpret_cast<const float*>(x.data_ptr()) : nullptr, parts,
        res ? reinterpret_cast<const T*>(res->data_ptr()) : nullptr,
        reinterpret_cast<const T*>(w.data_ptr()), reinterpret_cast<T*>(out.data_ptr()),
        new_res ? reinterpret_cast<T*>(new_res->data_ptr()) : nullptr, h, (float)eps, unit_offset, stamp.buf,
        stamp.id);
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, bool unit_offset) {
  check_norm("segki::rms_norm", x, w);
  auto out = at::empty_like(x);
  launch<false>("segki::rms_norm", x, nullptr, w, out, nullptr, eps, unit_offset);
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& res, const at::Tensor& w,
                                                double eps, bool unit_offset) {
  check_norm("segki::add_rms_norm", x, w);
  check_cuda_half(res, "segki::add_rms_norm", "residual", x.scalar_type());
  TORCH_CHECK(res.sizes() == x.sizes(), "segki::add_rms_norm: residual ", res.sizes(), " != x ", x.sizes());
  auto out = at::empty_like(x);
  auto new_res = at::empty_like(x);
  launch<true>("segki::add_rms_norm", x, &res, w, out, &new_res, eps, unit_offset);
  return {out, new_res};
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_sums(const at::Tensor& sums, const at::Tensor& res,
                                                     const at::Tensor& w, double eps, bool unit_offset) {
  const char* op = "segki::add_rms_norm_sums";
  check_norm(op, res, w, "residual");
  check_cuda_dtype(sums, op, "sums", at::kFloat);
  TORCH_CHECK(sums.is_contiguous() && sums.dim() >= 2 && sums.size(0) >= 1 && sums[0].sizes() == res.sizes(), op,
              ": sums ", sums.sizes(), " must be contiguous [parts, ", res.sizes(), "] (parts >= 1)");
  auto out = at::empty_like(res);
  auto new_res = at::empty_like(res);
  launch<true, true>(op, sums, &res, w, out, &new_res, eps, unit_offset);
  return {out, new_res};
}

}  // namespace

at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& w, double eps, bool unit_offset) {
  return rms_norm(x, w, eps, unit_offset);
}

TORCH_LIBRARY_IMPL(segki, CUDA, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("add_rms_norm_sums", &add_rms_norm_sums);
}

}  // namespace segki
