// Op schemas of the `segki` library. Each kernel family registers its CUDA implementation beside its
// kernel (TORCH_LIBRARY_IMPL in the .cu file); the pure-PyTorch references live in
// segki_lightning/ops/reference with the same names and signatures. The projections that follow a norm in a
// decoder layer take it as an optional prologue (norm_w, norm_eps, norm_unit_offset): their x is normalized first.
#include <torch/library.h>

TORCH_LIBRARY(segki, m) {
  m.def("linear(Tensor x, Tensor w, Tensor? b, Tensor? residual=None) -> Tensor");
  m.def("skinny_linear(Tensor x, Tensor w, Tensor? residual=None, bool gated=False, Tensor? norm_w=None,"
        " float norm_eps=0.0, bool norm_unit_offset=False) -> Tensor");
  // the skinny product's fp32 sums in its deferred segments of K, [segs, ..., N], for add_rms_norm_sums
  m.def("skinny_linear_sums(Tensor x, Tensor w) -> Tensor");
  // the decode step's timeline switch (csrc/timeline.cuh, benchmarks/step_timeline.py; its reference stamps nothing)
  m.def("timeline_stamps(Tensor buf, bool stamp) -> Tensor");
  m.def("gated_mlp_front(Tensor x, Tensor w_gate, Tensor w_up,"
        " Tensor? norm_w=None, float norm_eps=0.0, bool norm_unit_offset=False) -> Tensor");
  m.def("qkv_proj(Tensor x, Tensor w_q, Tensor w_k, Tensor w_v, Tensor? b_q, Tensor? b_k, Tensor? b_v,"
        " Tensor? norm_w=None, float norm_eps=0.0, bool norm_unit_offset=False) -> (Tensor, Tensor, Tensor)");
  m.def("gdn_in_proj(Tensor x, Tensor w_qkv, Tensor w_z, Tensor w_b, Tensor w_a,"
        " Tensor? norm_w=None, float norm_eps=0.0, bool norm_unit_offset=False)"
        " -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("gdn_in_proj_conv(Tensor x, Tensor w_qkv, Tensor w_z, Tensor w_b, Tensor w_a, Tensor(a!) conv_state,"
        " Tensor conv_weight, Tensor? conv_bias, Tensor? norm_w=None, float norm_eps=0.0,"
        " bool norm_unit_offset=False) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("rms_norm(Tensor x, Tensor w, float eps, bool unit_offset) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor w, float eps, bool unit_offset) -> (Tensor, Tensor)");
  // add_rms_norm of x given as fp32 sums [parts, ..., H], added in part order and rounded to the residual's dtype
  m.def("add_rms_norm_sums(Tensor sums, Tensor residual, Tensor w, float eps, bool unit_offset) -> (Tensor, Tensor)");
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor lengths, float scale,"
        " Tensor? gate=None) -> Tensor");
  m.def("attention_prologue(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor? q_norm_w,"
        " Tensor? k_norm_w, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor positions, float eps,"
        " bool unit_offset, bool gated) -> Tensor");
  // attention_prologue then decode_attention (gate: the second half of each gated query head), in one launch where
  // it can
  m.def("decode_attention_step(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor? q_norm_w,"
        " Tensor? k_norm_w, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor positions, Tensor lengths, float eps,"
        " bool unit_offset, bool gated, float scale) -> Tensor");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  // each outs[i] plus its LoRA path scales[i] * (x @ a[i]^T) @ b[i]^T, as peft's lora.Linear.forward rounds it
  m.def("lora_add(Tensor x, Tensor[] outs, Tensor[] a, Tensor[] b, float[] scales) -> Tensor[]");
  m.def("gdn_decode_step(Tensor qkv, Tensor z, Tensor b, Tensor a, Tensor(a!) conv_state, Tensor conv_weight,"
        " Tensor? conv_bias, Tensor(b!) recurrent_state, Tensor A_log, Tensor dt_bias, Tensor norm_weight,"
        " float norm_eps, int num_k_heads, int head_k_dim, int head_v_dim) -> Tensor");
  m.def("gdn_recurrent_step(Tensor mixed, Tensor z, Tensor b, Tensor a, Tensor(a!) recurrent_state, Tensor A_log,"
        " Tensor dt_bias, Tensor norm_weight, float norm_eps, int num_k_heads, int head_k_dim, int head_v_dim)"
        " -> Tensor");
  m.def("sample_tokens(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor seed,"
        " Tensor offset) -> (Tensor, Tensor)");
  // repetition penalty (over a [B, V] mask of seen tokens) and min-p before the sampler; returns the processed
  // logits and the raw logits' log-sum-exp over T
  m.def("process_logits(Tensor logits, Tensor? seen, Tensor penalty, Tensor? min_p, Tensor temperature)"
        " -> (Tensor, Tensor)");
  m.def("record_tokens(Tensor tok, Tensor lp, Tensor(a!) finished, Tensor(b!) offset, Tensor(c!) token,"
        " Tensor(d!) out_tokens, Tensor(e!) out_logprobs, Tensor(f!) out_mask, Tensor eos, int pad,"
        " Tensor(g!)? lengths=None) -> ()");
}
