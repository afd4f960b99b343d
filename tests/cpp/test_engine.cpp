// C++ test of the pair-tile engine: loss and gradients against a materialised libtorch computation,
// the sampler's pairs, and errors on bad input.
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>

#include "bst_fast.h"

namespace {

int failures = 0;

void expect(bool ok, const char* what) {
  std::printf("%s %s\n", ok ? "ok  " : "FAIL", what);
  if (!ok) ++failures;
}

double rel(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).norm().item<double>() /
         b.to(at::kDouble).norm().item<double>();
}

void test_against_materialised() {
  torch::manual_seed(0);
  const int64_t B = 2, L = 11, H1 = 7, H2 = 5, V = 9;
  auto opt = torch::dtype(torch::kFloat64);
  auto A = torch::randn({B, L, H1}, opt).requires_grad_();
  auto Bm = torch::randn({B, L, H1}, opt).requires_grad_();
  auto W2 = torch::randn({H2, H1}, opt).requires_grad_();
  auto c2 = torch::randn({H2}, opt).requires_grad_();
  auto W3 = torch::randn({2 * V, H2}, opt).requires_grad_();
  auto c3 = torch::randn({2 * V}, opt).requires_grad_();
  auto tokens = torch::randint(0, V, {B, L}, torch::kLong);
  auto lengths = torch::tensor({11, 7}, torch::kLong);
  auto start = torch::tensor({1, 0}, torch::kLong);
  const double lam = 0.3;

  // Materialised: every pair of docs/contract.md §2 with min_gap 2, no max_gap.
  std::vector<int64_t> rr, ii, jj;
  for (int64_t r = 0; r < B; ++r)
    for (int64_t i = start[r].item<int64_t>(); i < L; ++i)
      for (int64_t j = i + 2; j <= lengths[r].item<int64_t>() - 1; ++j) rr.push_back(r), ii.push_back(i), jj.push_back(j);
  auto r_t = torch::tensor(rr), i_t = torch::tensor(ii), j_t = torch::tensor(jj);
  auto z1 = A.index({r_t, i_t}) + Bm.index({r_t, j_t});
  auto x = torch::addmm(c3, torch::gelu(torch::addmm(c2, torch::gelu(z1), W2.t())), W3.t());
  auto lp = torch::log_softmax(x.view({-1, 2, V}), -1);
  auto y0 = tokens.index({r_t, i_t + 1}), y1 = tokens.index({r_t, j_t - 1});
  auto ar = torch::arange(static_cast<int64_t>(rr.size()));
  auto ce = -(lam * lp.index({ar, 0, y0}) + (1 - lam) * lp.index({ar, 1, y1}));
  auto ref = ce.mean();
  ref.backward();

  auto f32 = [](const at::Tensor& t) { return t.detach().to(at::kFloat); };
  std::vector<at::Tensor> W = {f32(W2), f32(W3)}, c = {f32(c2), f32(c3)};
  auto scale = torch::tensor(1.0 / static_cast<double>(rr.size()), opt);
  auto [loss, dA, dB, dW, dc] = bst_fast::pair_loss(
      f32(A), f32(Bm), W, c, tokens, lengths, start, 2, L, std::nullopt, std::nullopt,
      std::nullopt, scale, lam, "gelu", true);
  expect(std::abs(loss.item<double>() - ref.item<double>()) / ref.item<double>() < 1e-5, "loss matches");
  expect(rel(dA, A.grad()) < 1e-4, "dA matches");
  expect(rel(dB, Bm.grad()) < 1e-4, "dB matches");
  expect(rel(dW[0], W2.grad()) < 1e-4 && rel(dW[1], W3.grad()) < 1e-4, "dW matches");
  expect(rel(dc[0], c2.grad()) < 1e-4 && rel(dc[1], c3.grad()) < 1e-4, "dc matches");

  // The same pairs given as a list give the same loss.
  auto w = torch::full({static_cast<int64_t>(rr.size())}, 1.0 / static_cast<double>(rr.size()), opt);
  auto listed = bst_fast::pair_loss(f32(A), f32(Bm), W, c, tokens, lengths, start, 2, L, r_t, i_t,
                                    j_t, w, lam, "gelu", false);
  expect(std::abs(std::get<0>(listed).item<double>() - loss.item<double>()) < 1e-5, "pair list matches all pairs");

  // Bad input raises, never crashes.
  bool threw = false;
  try {
    auto bad_j = j_t.clone();
    bad_j[0] = L + 5;
    bst_fast::pair_loss(f32(A), f32(Bm), W, c, tokens, lengths, start, 2, L, r_t, i_t, bad_j, w,
                        lam, "gelu", true);
  } catch (const c10::Error&) {
    threw = true;
  }
  expect(threw, "an out-of-range pair raises c10::Error");
}

// docs/contract.md §8 and §9: min_gap 1 with meet_token (both labels of a gap-1 pair), every row's
// pairs weighted by its own scale (row_mean: 1 / (|P_r| B), given per row).
void test_meet_token_and_row_scale() {
  torch::manual_seed(1);
  const int64_t B = 3, L = 9, H1 = 6, V = 5, meet = 2;
  auto opt = torch::dtype(torch::kFloat64);
  auto A = torch::randn({B, L, H1}, opt).requires_grad_();
  auto Bm = torch::randn({B, L, H1}, opt).requires_grad_();
  auto W2 = torch::randn({2 * V, H1}, opt), c2 = torch::randn({2 * V}, opt);
  auto tokens = torch::randint(0, V, {B, L}, torch::kLong);
  auto lengths = torch::tensor({9, 4, 1}, torch::kLong);  // the last row has no pair
  auto start = torch::zeros({B}, torch::kLong);
  std::vector<int64_t> rr, ii, jj;
  std::vector<double> ww;
  for (int64_t r = 0; r < B; ++r) {
    const int64_t n = lengths[r].item<int64_t>();
    for (int64_t i = 0; i < L; ++i)
      for (int64_t j = i + 1; j <= n - 1; ++j) rr.push_back(r), ii.push_back(i), jj.push_back(j);
    for (int64_t k = 0; k < n * (n - 1) / 2; ++k) ww.push_back(1.0 / static_cast<double>(n * (n - 1) / 2 * B));
  }
  auto r_t = torch::tensor(rr), i_t = torch::tensor(ii), j_t = torch::tensor(jj);
  auto x = torch::addmm(c2, torch::gelu(A.index({r_t, i_t}) + Bm.index({r_t, j_t})), W2.t());
  auto lp = torch::log_softmax(x.view({-1, 2, V}), -1);
  auto gap1 = (j_t - i_t) == 1;
  auto y0 = torch::where(gap1, meet, tokens.index({r_t, i_t + 1}));
  auto y1 = torch::where(gap1, meet, tokens.index({r_t, j_t - 1}));
  auto ar = torch::arange(static_cast<int64_t>(rr.size()));
  auto ref = (-(0.5 * lp.index({ar, 0, y0}) + 0.5 * lp.index({ar, 1, y1})) * torch::tensor(ww, opt)).sum();
  ref.backward();

  auto f32 = [](const at::Tensor& t) { return t.detach().to(at::kFloat); };
  auto n_r = torch::tensor({36.0, 6.0, 1.0}, opt);  // |P_r| (the empty row's scale is never read)
  auto row_scale = 1.0 / (n_r * static_cast<double>(B));
  auto [loss, dA, dB, dW, dc] = bst_fast::pair_loss(
      f32(A), f32(Bm), {f32(W2)}, {f32(c2)}, tokens, lengths, start, 1, L, std::nullopt,
      std::nullopt, std::nullopt, row_scale, 0.5, "gelu", true, meet);
  expect(std::abs(loss.item<double>() - ref.item<double>()) / ref.item<double>() < 1e-5, "meet_token and row scale: loss");
  expect(rel(dA, A.grad()) < 1e-4 && rel(dB, Bm.grad()) < 1e-4, "meet_token and row scale: dA, dB");

  bool threw = false;
  try {
    bst_fast::pair_loss(f32(A), f32(Bm), {f32(W2)}, {f32(c2)}, tokens, lengths, start, 1, L,
                        std::nullopt, std::nullopt, std::nullopt, row_scale, 0.5, "gelu", true);
  } catch (const c10::Error&) {
    threw = true;
  }
  expect(threw, "min_gap 1 without meet_token raises c10::Error");
}

void test_sampler() {
  auto lengths = torch::tensor({12, 3, 9}, torch::kLong);
  auto start = torch::tensor({0, 0, 2}, torch::kLong);
  auto k = torch::tensor({10, 0, 4}, torch::kLong);
  auto [r, i, j] = bst_fast::sample_pairs(lengths, start, 2, 100, k, 7);
  expect(r.numel() == 14, "sampler returns sum(k) pairs");
  bool valid = true;
  for (int64_t p = 0; p < r.numel(); ++p) {
    const int64_t rp = r[p].item<int64_t>(), ip = i[p].item<int64_t>(), jp = j[p].item<int64_t>();
    valid = valid && ip >= start[rp].item<int64_t>() && jp >= ip + 2 && jp <= lengths[rp].item<int64_t>() - 1;
    if (p > 0 && r[p - 1].item<int64_t>() == rp)
      valid = valid && (i[p - 1].item<int64_t>() < ip || (i[p - 1].item<int64_t>() == ip && j[p - 1].item<int64_t>() < jp));
  }
  expect(valid, "sampled pairs are valid, distinct and sorted");
  auto again = bst_fast::sample_pairs(lengths, start, 2, 100, k, 7);
  expect(torch::equal(std::get<2>(again), j), "the same seed gives the same pairs");
}

}  // namespace

int main() {
  test_against_materialised();
  test_meet_token_and_row_scale();
  test_sampler();
  std::printf("%d failure(s)\n", failures);
  return failures == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
