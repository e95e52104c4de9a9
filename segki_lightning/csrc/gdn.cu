// Fused Gated-DeltaNet decode step (after the input projections), two kernels instead of the ~15 ops
// transformers runs per layer and token:
//   1. conv: shift the conv state left by one, append the new q|k|v token, depthwise conv + SiLU.
//   2. recurrence: per (row, value head, 32 columns): q/k L2-norm, gates, delta-rule update of the fp32
//      state in place (Dk/4 entries of one column per thread, in registers), output, gated RMSNorm.
// Rounding points follow ops/reference/gdn.py (the conv output, the core output and the normed value are
// rounded to the activation dtype exactly where the reference does).
#include "common.cuh"

#include <cooperative_groups.h>

namespace segki {
namespace {

constexpr int kMaxWidth = 8;

template <typename T>
__global__ void gdn_conv_kernel(const T* __restrict__ qkv, T* __restrict__ conv_state, const T* __restrict__ w,
                                const T* __restrict__ bias, T* __restrict__ mixed, int c_total, int width) {
  pdl_start();  // everything below reads what earlier kernels wrote
  const int c = blockIdx.x * blockDim.x + threadIdx.x, b = blockIdx.y;
  if (c >= c_total) return;
  T* st = conv_state + ((size_t)b * c_total + c) * width;
  float win[kMaxWidth];
  for (int i = 0; i + 1 < width; ++i) win[i] = to_float<T>(st[i + 1]);
  win[width - 1] = to_float<T>(qkv[(size_t)b * c_total + c]);
  float acc = 0.f;
  for (int i = 0; i < width; ++i) {
    st[i] = from_float<T>(win[i]);
    acc += win[i] * to_float<T>(w[(size_t)c * width + i]);
  }
  if (bias) acc += to_float<T>(bias[c]);
  mixed[(size_t)b * c_total + c] = from_float<T>(silu(acc));
}

// grid (Hv * tiles, B) in clusters of `tiles` blocks (one cluster per value head), block 128 threads: a
// block owns 32 state columns of its head; thread (ty, jl) keeps rows [ty*Dk/4, (ty+1)*Dk/4) of column
// tile*32 + jl in registers. The gated RMSNorm over the head's Dv outputs sums the tiles' partial squares
// through distributed shared memory.
template <typename T, int DK>
__global__ void __launch_bounds__(128) gdn_recurrent_kernel(
    const T* __restrict__ mixed, const T* __restrict__ z, const T* __restrict__ bgate, const T* __restrict__ agate,
    float* __restrict__ state, const void* __restrict__ a_log, const void* __restrict__ dt_bias, bool gates_fp32,
    const T* __restrict__ norm_w, T* __restrict__ out, int hk, int hv, int dv, float eps) {
  pdl_start();  // everything below reads what earlier kernels wrote
  constexpr int R = DK / 4;
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int tiles = dv / 32;
  const int h = blockIdx.x / tiles, tile = blockIdx.x % tiles, b = blockIdx.y;
  const int jl = threadIdx.x & 31, ty = threadIdx.x >> 5, j = tile * 32 + jl;
  const int c_total = 2 * hk * DK + hv * dv;
  const int kh = h / (hv / hk);
  __shared__ float sq[DK], sk[DK], red[4][32], scratch[32];
  __shared__ float sq_part;
  // the state slice (the bulk of the bytes) is requested first; the q/k norms below overlap its latency
  float* st = state + (((size_t)b * hv + h) * DK + ty * R) * dv + j;
  float s[R];
#pragma unroll
  for (int i = 0; i < R; ++i) s[i] = st[(size_t)i * dv];
  const T* row = mixed + (size_t)b * c_total;
  float qq = 0.f, kk = 0.f;
  for (int i = threadIdx.x; i < DK; i += 128) {
    const float qv = to_float<T>(row[kh * DK + i]);
    const float kv = to_float<T>(row[hk * DK + kh * DK + i]);
    sq[i] = qv;
    sk[i] = kv;
    qq += qv * qv;
    kk += kv * kv;
  }
  const float q_scale = rsqrtf(block_sum(qq, scratch) + 1e-6f) * rsqrtf((float)DK);
  const float k_scale = rsqrtf(block_sum(kk, scratch) + 1e-6f);
  const float v = to_float<T>(row[2 * hk * DK + h * dv + j]);
  auto param = [&](const void* p) {  // A_log / dt_bias are stored in fp32 or in the activation dtype
    return gates_fp32 ? static_cast<const float*>(p)[h] : to_float<T>(static_cast<const T*>(p)[h]);
  };
  const float x = to_float<T>(agate[(size_t)b * hv + h]) + param(dt_bias);
  const float g = -expf(param(a_log)) * (x > 20.f ? x : log1pf(expf(x)));
  const float beta = round_to<T>(sigmoid(to_float<T>(bgate[(size_t)b * hv + h])));
  const float decay = expf(g);

  float part = 0.f;
#pragma unroll
  for (int i = 0; i < R; ++i) {
    s[i] *= decay;
    part += s[i] * (sk[ty * R + i] * k_scale);
  }
  red[ty][jl] = part;
  __syncthreads();
  const float delta = (v - (red[0][jl] + red[1][jl] + red[2][jl] + red[3][jl])) * beta;
  __syncthreads();
  part = 0.f;
#pragma unroll
  for (int i = 0; i < R; ++i) {
    s[i] += sk[ty * R + i] * k_scale * delta;
    st[(size_t)i * dv] = s[i];
    part += s[i] * (sq[ty * R + i] * q_scale);
  }
  red[ty][jl] = part;
  __syncthreads();
  const float o = round_to<T>(red[0][jl] + red[1][jl] + red[2][jl] + red[3][jl]);
  if (ty == 0) {
    const float w = warp_sum(o * o);
    if (jl == 0) sq_part = w;
  }
  cluster.sync();
  float total = 0.f;
  for (int r = 0; r < tiles; ++r) total += *cluster.map_shared_rank(&sq_part, r);
  cluster.sync();  // peers' shared memory stays alive until every block has read it
  if (ty == 0) {
    const float n = round_to<T>(o * rsqrtf(total / dv + eps));
    const float t = round_to<T>(to_float<T>(norm_w[j]) * n);
    const float zz = to_float<T>(z[((size_t)b * hv + h) * dv + j]);
    out[((size_t)b * hv + h) * dv + j] = from_float<T>(t * silu(zz));
  }
}

at::Tensor gdn_decode_step(const at::Tensor& qkv, const at::Tensor& z, const at::Tensor& b, const at::Tensor& a,
                           at::Tensor& conv_state, const at::Tensor& conv_weight,
                           const c10::optional<at::Tensor>& conv_bias, at::Tensor& recurrent_state,
                           const at::Tensor& a_log, const at::Tensor& dt_bias, const at::Tensor& norm_weight,
                           double norm_eps, int64_t num_k_heads, int64_t head_k_dim, int64_t head_v_dim) {
  const char* op = "segki::gdn_decode_step";
  const auto dt = qkv.scalar_type();
  for (auto* t : {&qkv, &z, &b, &a, &conv_weight, &norm_weight})
    check_cuda_half(*t, op, "input", dt);
  check_cuda_half(conv_state, op, "conv_state", dt);
  if (conv_bias) check_cuda_half(*conv_bias, op, "conv_bias", dt);
  TORCH_CHECK(recurrent_state.is_cuda() && recurrent_state.scalar_type() == at::kFloat &&
                  recurrent_state.is_contiguous(), op, ": recurrent_state must be a contiguous fp32 CUDA tensor");
  const int bsz = (int)qkv.size(0), c_total = (int)qkv.size(1), width = (int)conv_state.size(2);
  const int hk = (int)num_k_heads, dk = (int)head_k_dim, dv = (int)head_v_dim;
  const int hv = (int)(z.size(1) / dv);
  TORCH_CHECK(c_total == 2 * hk * dk + hv * dv, op, ": qkv width ", c_total, " != 2*Hk*Dk + Hv*Dv");
  TORCH_CHECK(width <= kMaxWidth && conv_weight.size(0) == c_total && conv_weight.size(1) == width, op,
              ": conv weight ", conv_weight.sizes(), " / state ", conv_state.sizes(), " mismatch (width <= 8)");
  TORCH_CHECK(recurrent_state.sizes() == at::IntArrayRef({bsz, hv, dk, dv}), op, ": recurrent_state ",
              recurrent_state.sizes(), " != [B, Hv, Dk, Dv]");
  TORCH_CHECK(dk == 64 || dk == 128 || dk == 256, op, ": head_k_dim must be 64, 128 or 256");
  TORCH_CHECK(dv % 32 == 0 && dv <= 256 && hv % hk == 0, op,
              ": head_v_dim must be a multiple of 32 up to 256 (one cluster of Dv/32 <= 8 blocks per head)");
  TORCH_CHECK(a_log.is_cuda() && dt_bias.is_cuda(), op, ": A_log and dt_bias must be CUDA tensors");
  // Read the gate parameters where they are (no per-step cast kernels) when both share fp32 or the
  // activation dtype; any other mix is converted once per call.
  const auto pdt = a_log.scalar_type();
  const bool direct = pdt == dt_bias.scalar_type() && (pdt == at::kFloat || pdt == dt) && a_log.is_contiguous() &&
                      dt_bias.is_contiguous();
  const auto a_log_p = direct ? a_log : a_log.to(at::kFloat).contiguous();
  const auto dt_bias_p = direct ? dt_bias : dt_bias.to(at::kFloat).contiguous();
  const bool gates_fp32 = a_log_p.scalar_type() == at::kFloat;
  auto mixed = at::empty_like(qkv);
  auto out = at::empty({bsz, hv * dv}, qkv.options());
  if (bsz == 0) return out;
  c10::cuda::CUDAGuard guard(qkv.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  SEGKI_DISPATCH_HALF(dt, op, [&] {
    launch_pdl(gdn_conv_kernel<T>, dim3((c_total + 255) / 256, bsz), dim3(256), stream, dim3(1),
        reinterpret_cast<const T*>(qkv.data_ptr()), reinterpret_cast<T*>(conv_state.data_ptr()),
        reinterpret_cast<const T*>(conv_weight.data_ptr()),
        conv_bias ? reinterpret_cast<const T*>(conv_bias->data_ptr()) : nullptr,
        reinterpret_cast<T*>(mixed.data_ptr()), c_total, width);
    auto launch = [&](auto dk_const) {
      constexpr int DK = decltype(dk_const)::value;
      // clusters of Dv/32 blocks: one cluster per (value head, row)
      launch_pdl(gdn_recurrent_kernel<T, DK>, dim3(hv * (dv / 32), bsz), dim3(128), stream, dim3(dv / 32),
          reinterpret_cast<const T*>(mixed.data_ptr()), reinterpret_cast<const T*>(z.data_ptr()),
          reinterpret_cast<const T*>(b.data_ptr()), reinterpret_cast<const T*>(a.data_ptr()),
          recurrent_state.data_ptr<float>(), static_cast<const void*>(a_log_p.data_ptr()),
          static_cast<const void*>(dt_bias_p.data_ptr()), gates_fp32,
          reinterpret_cast<const T*>(norm_weight.data_ptr()),
          reinterpret_cast<T*>(out.data_ptr()), hk, hv, dv, (float)norm_eps);
    };
    with_head_dim(dk, launch);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(segki, CUDA, m) { m.impl("gdn_decode_step", &gdn_decode_step); }

}  // namespace segki
