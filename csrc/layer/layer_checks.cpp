// The C++ path's input checks (layer.h): nn/checks.py's check_input, with the same messages
// (docs/errors.md quotes them; tests/test_native_path.py compares the two paths' errors).
#include <c10/core/ScalarType.h>

#include <string>

#include "layer.h"
#include "check.h"

namespace syncbn::layer {
namespace {

// torch's name of a dtype, as Python prints it ("torch.float64").
std::string torch_name(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kLong: return "torch.int64";
    case at::kInt: return "torch.int32";
    case at::kShort: return "torch.int16";
    case at::kChar: return "torch.int8";
    case at::kByte: return "torch.uint8";
    case at::kBool: return "torch.bool";
    case at::kComplexFloat: return "torch.complex64";
    case at::kComplexDouble: return "torch.complex128";
    default: return std::string("torch.") + c10::toString(t);
  }
}

// A shape as a Python tuple prints it: "(2, 5, 3)", "(4,)".
std::string tuple_text(at::IntArrayRef sizes) {
  std::string text = "(";
  for (size_t i = 0; i < sizes.size(); ++i) {
    text += (i ? ", " : "") + std::to_string(sizes[i]);
  }
  return text + (sizes.size() == 1 ? ",)" : ")");
}

}  // namespace

void check_layer_input(
    const at::Tensor& input, int64_t num_features, const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& running_mean) {
  SYNCBN_CHECK_VALUE(
      input.dim() >= 2, "SyncBatchNorm expects input of shape (N, C, *) with at least 2 dims, got ",
      input.dim(), "-D input of shape ", tuple_text(input.sizes()));
  SYNCBN_CHECK_TYPE(
      at::isFloatingType(input.scalar_type()),
      "SyncBatchNorm input must be floating point (float16, bfloat16, float32, float64), got ",
      torch_name(input.scalar_type()), ": convert it, e.g. input.float()");
  SYNCBN_CHECK_VALUE(
      input.size(1) == num_features, "SyncBatchNorm input has ", input.size(1),
      " channels (dim 1) but the layer was built with num_features=", num_features,
      ": use SyncBatchNorm(", input.size(1), ") or fix the preceding layer (input shape ",
      tuple_text(input.sizes()), ")");
  const bool has_weight = weight.has_value() && weight->defined();
  const c10::optional<at::Tensor>& reference = has_weight ? weight : running_mean;
  if (!reference.has_value() || !reference->defined()) return;
  const char* name = has_weight ? "weight" : "running_mean";
  SYNCBN_CHECK_VALUE(
      reference->device() == input.device(), "SyncBatchNorm input is on ", input.device().str(),
      " but the layer's parameters/buffers are on ", reference->device().str(),
      ": move the model with model.to('", input.device().str(), "')");
  const bool half = input.scalar_type() == at::kHalf || input.scalar_type() == at::kBFloat16;
  SYNCBN_CHECK_TYPE(
      input.scalar_type() == reference->scalar_type() ||
          (half && reference->scalar_type() == at::kFloat),
      "SyncBatchNorm input dtype ", torch_name(input.scalar_type()),
      " does not match the layer's ", name, " dtype ", torch_name(reference->scalar_type()),
      ": cast the model (model.to(", torch_name(input.scalar_type()),
      ")) or the input; float16/bfloat16 inputs may also use float32 parameters");
}


}  // namespace syncbn::layer
