// Registers the bst_fast ops with the dispatcher; Python adds register_fake and register_autograd.
#include <torch/library.h>

#include "bst_fast.h"

TORCH_LIBRARY(bst_fast, m) {
  m.def(
      "pair_loss(Tensor A, Tensor Bm, Tensor[] weights, Tensor[] biases, Tensor tokens, "
      "Tensor lengths, Tensor prefix_start, int min_gap, int max_gap, Tensor? row, Tensor? i, "
      "Tensor? j, Tensor weight, float next_weight, str activation, bool need_grad, "
      "int? meet_token=None) -> (Tensor, Tensor, Tensor, Tensor[], Tensor[])");
  m.def(
      "sample_pairs(Tensor lengths, Tensor prefix_start, int min_gap, int max_gap, Tensor k, "
      "int seed) -> (Tensor, Tensor, Tensor)");
}

namespace {
bst_fast::PairLossResult pair_loss_cpu(const at::Tensor& A, const at::Tensor& Bm,
                                       at::TensorList weights, at::TensorList biases,
                                       const at::Tensor& tokens, const at::Tensor& lengths,
                                       const at::Tensor& prefix_start, int64_t min_gap,
                                       int64_t max_gap, const std::optional<at::Tensor>& row,
                                       const std::optional<at::Tensor>& i,
                                       const std::optional<at::Tensor>& j,
                                       const at::Tensor& weight, double next_weight,
                                       c10::string_view activation, bool need_grad,
                                       std::optional<int64_t> meet_token) {
  return bst_fast::pair_loss(A, Bm, weights, biases, tokens, lengths, prefix_start, min_gap,
                             max_gap, row, i, j, weight, next_weight, std::string(activation),
                             need_grad, meet_token);
}
}  // namespace

TORCH_LIBRARY_IMPL(bst_fast, CPU, m) {
  m.impl("pair_loss", &pair_loss_cpu);
  m.impl("sample_pairs", &bst_fast::sample_pairs);
}
