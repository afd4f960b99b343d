// bst_fast: the fused pair-tile engine of the belief-state loss on the CPU (docs/contract.md §2-§5).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace bst_fast {

// The pair set of one row (docs/contract.md §2), prefix by prefix: calls fn(i, j0, n) for every prefix i with
// pairs, whose suffixes are j = j0 .. j0 + n - 1. Gaps beyond the row's length change nothing, so
// they and the start are clamped first, and the last suffix is min(gmax, len - 1 - i) past i, not
// i + gmax: no sum below can overflow for any len, start >= 0 and 1 <= min_gap <= max_gap.
template <typename F>
void for_each_prefix(int64_t len, int64_t start, int64_t min_gap, int64_t max_gap, F&& fn) {
  const int64_t gmin = std::min(min_gap, std::max<int64_t>(len, 2));
  const int64_t gmax = std::min(max_gap, std::max<int64_t>(len, 2));
  for (int64_t i = std::min(start, len); i <= len - 1 - gmin; ++i) {
    fn(i, i + gmin, std::min(gmax, len - 1 - i) - gmin + 1);
  }
}

// loss, dA, dB, dW (layers after the first), dc (their biases).
using PairLossResult =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>>;

// The loss over pairs (i, j) with hidden state act(A[r, i] + Bm[r, j]) fed through the remaining
// head layers `weights`/`biases` (docs/contract.md §3), and, when need_grad, its gradients with respect to
// A, Bm, weights and biases, all computed in one pass over tiles of pairs (without need_grad the
// gradients come back empty, shape (0,)).
//   A, Bm:     (B, L, h1) float32: the split first layer, A = f W1f^T + c1, Bm = b W1b^T.
//   weights:   (h2, h1), ..., (2V, h_last) float32; biases: (h2), ..., (2V).
//   tokens:    (B, L) int64; lengths, prefix_start: (B,) int64.
//   row, i, j: a pair list (n,) int64, or all absent for all pairs of docs/contract.md §2.
//   weight:    () scale of every pair or (B,) scale of each row's pairs (all pairs; (B,) is
//              row_mean, docs/contract.md §9), or (n,) per-pair weights (a pair list).
//   meet_token: both labels of a pair with j - i = 1 (docs/contract.md §8); min_gap = 1 needs it.
PairLossResult pair_loss(const at::Tensor& A, const at::Tensor& Bm, at::TensorList weights,
                         at::TensorList biases, const at::Tensor& tokens,
                         const at::Tensor& lengths, const at::Tensor& prefix_start,
                         int64_t min_gap, int64_t max_gap, const std::optional<at::Tensor>& row,
                         const std::optional<at::Tensor>& i, const std::optional<at::Tensor>& j,
                         const at::Tensor& weight, double next_weight,
                         const std::string& activation, bool need_grad,
                         std::optional<int64_t> meet_token = std::nullopt);

// k[r] pairs of row r drawn uniformly without replacement from P_r (docs/contract.md §5), sorted by (i, j);
// one random stream per row, derived from seed, so the draw does not depend on thread count.
std::tuple<at::Tensor, at::Tensor, at::Tensor> sample_pairs(const at::Tensor& lengths,
                                                            const at::Tensor& prefix_start,
                                                            int64_t min_gap, int64_t max_gap,
                                                            const at::Tensor& k, int64_t seed);

}  // namespace bst_fast
