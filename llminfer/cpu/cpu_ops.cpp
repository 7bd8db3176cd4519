// The native CPU kernels' ops, registered with torch as torch.ops.llminfer.* (built by llminfer/cpu/__init__.py from
// the units cpu_kernels.h names, into one extension). Chapter 08.

#include <torch/library.h>

#include "cpu_kernels.h"

using namespace llminfer_cpu;

TORCH_LIBRARY(llminfer, m) {
  // y = x · Wᵀ, W as its parts: [weight], [codes, scale] (int8) or [codes, scale, offset] (int4 tiles)
  m.def("gemv(Tensor x, Tensor[] parts, int group=0, bool int8_activations=False) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
  // the native-call contract (cpu_layers.cpp): a layer stack prepared once, its fields in the order layer_fields()
  // names, its caches of cache_kind 0 (contiguous) or 1 (a paged pool); a number names it until release_stack.
  // A step hands over x, cos, sin and the positions, and over a pool the tokens' sequences and the block tables
  m.def("prepare_stack(Tensor?[] tensors, float[] eps, int[] activations, int n_heads, float scale, int cache_kind, "
        "Tensor[] k_caches, Tensor[] v_caches) -> int", &prepare_stack);
  m.def("run_stack(int stack, Tensor x, Tensor cos, Tensor sin, Tensor positions, Tensor? token_seq=None, "
        "Tensor? block_tables=None) -> Tensor");
  m.def("release_stack(int stack) -> ()", &release_stack);
  m.def("layer_fields() -> str[]", &layer_fields);
  m.def("paged_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, Tensor token_seq, "
        "Tensor positions, float scale) -> Tensor");
  m.def("stream_read(Tensor data, int width=0) -> int", &stream_read);
  // float32 values rounded to bfloat16 (as the layers round a bfloat16 model's activations), still float32
  m.def("round_bfloat16(Tensor x) -> Tensor", [](const at::Tensor& x) -> at::Tensor {
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "round_bfloat16: x must be float32 on the CPU, "
                "got ", x.scalar_type(), " on ", x.device());
    at::Tensor out = x.contiguous().clone();
    round_bf16(out.data_ptr<float>(), out.numel());
    return out;
  });
  m.def("matvec_max_rows() -> int", []() -> int64_t { return kMatvecMaxRows; });
  m.def("split_keys() -> int", []() -> int64_t { return kSplitKeys; });
  // the instruction sets in use (bits of Feature); set_cpu_features(bits, decode) sets them and each format's decode
  // loops' (float32, bfloat16, int8, int4, W4A8), returning the bits the CPU lacks (0: set)
  m.def("cpu_features() -> int", []() -> int64_t { return features(); });
  m.def("set_cpu_features(int bits, int[] decode=[]) -> int", [](int64_t bits, at::IntArrayRef decode) -> int64_t {
    return set_features(bits, decode.vec());
  });
  m.def("matvec_features(int kind) -> int", [](int64_t kind) -> int64_t {
    TORCH_CHECK(kind >= 0 && kind < kMatvecKinds, "matvec_features: kind ", kind, " is not one of 0..", kMatvecKinds - 1);
    return matvec_features(kind);
  });
}

TORCH_LIBRARY_IMPL(llminfer, CPU, m) {
  m.impl("gemv", &gemv);
  m.impl("decode_attention", &decode_attention);
  m.impl("run_stack", &run_stack);
  m.impl("paged_attention", &paged_attention);
}
