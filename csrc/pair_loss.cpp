// The fused pair-tile engine: loss and gradients of the belief-state objective without a pair tensor.
//
// Per tile of TP pairs (one thread owns a tile; every buffer below is per thread):
//   z1 = A[r,i] + Bm[r,j]                          (TP, h1)   the split first layer, docs/contract.md §3
//   h_k = act(z_k),  z_{k+1} = h_k W_k^T + c_k      hidden layers
//   x = h_last W_n^T + c_n                           (TP, 2V)   Next logits | Prev logits
//   loss += sum_p w_p (lam CE(x_next, y_next) + (1 - lam) CE(x_prev, y_prev))
//     (y_next = tokens[r, i+1], y_prev = tokens[r, j-1]; both meet_token when j - i = 1, §8)
// and, in the same pass, since the loss is a plain weighted sum of per-pair terms,
//   g = dloss/dx = (softmax(x) - onehot(y)) * w_p * lam_half
//   dW_n += g^T h_last, dc_n += sum_p g, dh_last = g W_n, back through the hidden layers to dz1,
//   dA[r,i] += dz1, dBm[r,j] += dz1.
// The logits of a tile are held whole (TP x 2V floats, a few MB): the softmax gradient needs the
// logsumexp of the full row, and holding the tile avoids computing the logits twice.
// Accumulators are per thread (float32) and reduced once at the end, so the result depends on
// the thread count but not on timing.
#include "bst_fast.h"

#include <ATen/Parallel.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <limits>
#include <utility>
#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#endif

namespace bst_fast {
namespace {

// Softmax probabilities of confident predictions fall below 1e-38 and turn subnormal; x86 FPUs
// handle subnormals ~100x slower, which made late training steps 10x slower. Each worker flushes
// them to zero while it runs a tile (they are far below float32 rounding of anything summed here)
// and restores the caller's mode afterwards.
//
// Only where no thread can be started meanwhile: a new thread copies its creator's mode and keeps
// it for good, so a torch op inside the tile that first opens the intra-op pool (or opens it
// anew after set_num_threads) would leave those workers flushing every later op's subnormals.
// Inside a parallel region nested torch ops run inline; with one intra-op thread none is started.
// A tile run inline by a caller with a larger pool (one tile, grain 2) is left unflushed.
class FlushSubnormals {
 public:
#if defined(__SSE__) || defined(__x86_64__)
  explicit FlushSubnormals(bool on) : on_(on), saved_(_mm_getcsr()) {
    if (on_) _mm_setcsr(saved_ | 0x8040);  // FTZ | DAZ
  }
  ~FlushSubnormals() {
    if (on_) _mm_setcsr(saved_);
  }

 private:
  bool on_;
  unsigned int saved_;
#else
  explicit FlushSubnormals(bool) {}
#endif
};

enum class Act { Relu, LeakyRelu, Gelu, GeluTanh, Silu };

Act parse_activation(const std::string& name) {
  if (name == "relu") return Act::Relu;
  if (name == "leaky_relu") return Act::LeakyRelu;
  if (name == "gelu") return Act::Gelu;
  if (name == "gelu_tanh") return Act::GeluTanh;
  if (name == "silu") return Act::Silu;
  TORCH_CHECK(false, "activation must be one of relu, leaky_relu, gelu, gelu_tanh, silu, got '",
              name, "'");
}

void act_out(Act act, at::Tensor& out, const at::Tensor& z) {
  switch (act) {
    case Act::Relu: at::clamp_min_out(out, z, 0); break;
    case Act::LeakyRelu: at::leaky_relu_out(out, z, 0.01); break;
    case Act::Gelu: at::gelu_out(out, z, "none"); break;
    case Act::GeluTanh: at::gelu_out(out, z, "tanh"); break;
    case Act::Silu: at::silu_out(out, z); break;
  }
}

// dz = dh * act'(z)
at::Tensor act_backward(Act act, const at::Tensor& dh, const at::Tensor& z) {
  switch (act) {
    case Act::Relu: return at::threshold_backward(dh, z, 0);
    case Act::LeakyRelu: return at::leaky_relu_backward(dh, z, 0.01, false);
    case Act::Gelu: return at::gelu_backward(dh, z, "none");
    case Act::GeluTanh: return at::gelu_backward(dh, z, "tanh");
    case Act::Silu: return at::silu_backward(dh, z);
  }
  return dh;
}

// The pair set as a walkable sequence: either an explicit list or the implicit triangle of
// docs/contract.md §2, stored as one segment (r, i, j0, n) per prefix, so a tile is a range of flat indices.
struct PairWalk {
  const int64_t *row = nullptr, *pi = nullptr, *pj = nullptr;
  std::vector<int64_t> seg_r, seg_i, seg_j0, seg_start;  // seg_start has one extra end entry
  int64_t total = 0;

  // Calls fn(p, r, i, j) for flat indices [begin, end).
  template <typename F>
  void walk(int64_t begin, int64_t end, F&& fn) const {
    if (row != nullptr) {
      for (int64_t p = begin; p < end; ++p) fn(p - begin, row[p], pi[p], pj[p]);
      return;
    }
    auto s = std::upper_bound(seg_start.begin(), seg_start.end(), begin) - seg_start.begin() - 1;
    for (int64_t p = begin; p < end; ++p) {
      while (p >= seg_start[s + 1]) ++s;
      fn(p - begin, seg_r[s], seg_i[s], seg_j0[s] + (p - seg_start[s]));
    }
  }
};

PairWalk all_pairs(const int64_t* len, const int64_t* start, int64_t B, int64_t min_gap,
                   int64_t max_gap) {
  PairWalk w;
  for (const auto r : c10::irange(B)) {
    for_each_prefix(len[r], start[r], min_gap, max_gap, [&](int64_t i, int64_t j0, int64_t n) {
      w.seg_r.push_back(r);
      w.seg_i.push_back(i);
      w.seg_j0.push_back(j0);
      w.seg_start.push_back(w.total);
      w.total += n;
    });
  }
  w.seg_start.push_back(w.total);
  return w;
}

// Pairs per tile: the (TP, 2V) logits tile stays around 2 MB, and TP is never so small that the
// GEMMs lose their efficiency.
int64_t tile_pairs(int64_t two_v) {
  return std::clamp<int64_t>((int64_t{1} << 19) / two_v, 32, 256);
}

struct Accum {  // one thread's gradient sums
  at::Tensor dA, dB;
  std::vector<at::Tensor> dW, dc;
  double loss = 0.0;
};

void check_inputs(const at::Tensor& A, const at::Tensor& Bm, at::TensorList weights,
                  at::TensorList biases, const at::Tensor& tokens, const at::Tensor& lengths,
                  const at::Tensor& prefix_start, int64_t min_gap, int64_t max_gap) {
  TORCH_CHECK(A.dim() == 3, "A must be (B, L, h1), got ", A.sizes());
  TORCH_CHECK(Bm.sizes() == A.sizes(), "Bm must have the shape of A ", A.sizes(), ", got ",
              Bm.sizes());
  TORCH_CHECK(A.scalar_type() == at::kFloat && Bm.scalar_type() == at::kFloat,
              "A and Bm must be float32, got ", A.scalar_type(), " and ", Bm.scalar_type());
  TORCH_CHECK(A.device().is_cpu() && Bm.device().is_cpu(), "A and Bm must be CPU tensors");
  const int64_t B = A.size(0), L = A.size(1);
  TORCH_CHECK(!weights.empty(), "weights must hold at least the output layer");
  TORCH_CHECK(weights.size() == biases.size(), "weights and biases must have one entry per layer, got ",
              weights.size(), " and ", biases.size());
  int64_t width = A.size(2);
  for (const auto k : c10::irange(weights.size())) {
    TORCH_CHECK(weights[k].dim() == 2 && weights[k].size(1) == width &&
                    weights[k].scalar_type() == at::kFloat && weights[k].device().is_cpu(),
                "weights[", k, "] must be a float32 CPU (out, ", width, ") matrix, got ",
                weights[k].sizes(), " ", weights[k].scalar_type());
    width = weights[k].size(0);
    TORCH_CHECK(biases[k].dim() == 1 && biases[k].size(0) == width &&
                    biases[k].scalar_type() == at::kFloat && biases[k].device().is_cpu(),
                "biases[", k, "] must be a float32 CPU (", width, ",) vector, got ",
                biases[k].sizes());
  }
  TORCH_CHECK(width % 2 == 0 && width > 0, "the last layer must have 2V outputs, got ", width);
  TORCH_CHECK(tokens.dim() == 2 && tokens.size(0) == B && tokens.size(1) == L &&
                  tokens.scalar_type() == at::kLong && tokens.device().is_cpu(),
              "tokens must be int64 CPU (", B, ", ", L, "), got ", tokens.sizes(), " ",
              tokens.scalar_type());
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"lengths", &lengths},
                                 {"prefix_start", &prefix_start}}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == B && t->scalar_type() == at::kLong &&
                    t->device().is_cpu(),
                name, " must be int64 CPU (", B, ",), got ", t->sizes(), " ", t->scalar_type(),
                " on ", t->device());
  }
  TORCH_CHECK(min_gap >= 1, "min_gap must be >= 2 (or 1 with meet_token), got ", min_gap);
  TORCH_CHECK(max_gap >= min_gap, "max_gap must be >= min_gap (", min_gap, "), got ", max_gap);
  auto len = lengths.contiguous();
  auto ps = prefix_start.contiguous();
  for (const auto r : c10::irange(B)) {
    const int64_t n = len.data_ptr<int64_t>()[r];
    // ValueError, as the eager checks of _pairs.py say it (torch.compile skips those)
    TORCH_CHECK_VALUE(n >= 0 && n <= L, "lengths must lie in [0, L=", L, "], got lengths[", r, "] = ", n);
    TORCH_CHECK_VALUE(ps.data_ptr<int64_t>()[r] >= 0, "prefix_start must be >= 0, got prefix_start[", r,
                      "] = ", ps.data_ptr<int64_t>()[r]);
  }
}

}  // namespace

PairLossResult pair_loss(const at::Tensor& A_in, const at::Tensor& Bm_in,
                         at::TensorList weights_in, at::TensorList biases_in,
                         const at::Tensor& tokens_in, const at::Tensor& lengths_in,
                         const at::Tensor& prefix_start_in, int64_t min_gap, int64_t max_gap,
                         const std::optional<at::Tensor>& row_in,
                         const std::optional<at::Tensor>& i_in,
                         const std::optional<at::Tensor>& j_in, const at::Tensor& weight_in,
                         double next_weight, const std::string& activation, bool need_grad,
                         std::optional<int64_t> meet_token) {
  // The op's autograd rule lives in Python; below it, the ATen calls must not record a graph.
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  check_inputs(A_in, Bm_in, weights_in, biases_in, tokens_in, lengths_in, prefix_start_in,
               min_gap, max_gap);
  TORCH_CHECK(next_weight >= 0.0 && next_weight <= 1.0, "next_weight must lie in [0, 1], got ",
              next_weight);
  const Act act = parse_activation(activation);
  const auto A = A_in.contiguous(), Bm = Bm_in.contiguous();
  const auto tokens = tokens_in.contiguous();
  const auto lengths = lengths_in.contiguous(), prefix_start = prefix_start_in.contiguous();
  std::vector<at::Tensor> W, c;
  for (const auto k : c10::irange(weights_in.size())) {
    W.push_back(weights_in[k].contiguous());
    c.push_back(biases_in[k].contiguous());
  }
  const int64_t B = A.size(0), L = A.size(1), H1 = A.size(2);
  const int64_t n_layers = static_cast<int64_t>(W.size());  // hidden layers + the output layer
  const int64_t two_v = W.back().size(0), V = two_v / 2;
  const int64_t* len = lengths.data_ptr<int64_t>();
  const int64_t* tok = tokens.data_ptr<int64_t>();
  // docs/contract.md §8: a pair with j - i = 1 has no token between prefix and suffix to predict.
  TORCH_CHECK(min_gap >= 2 || meet_token.has_value(),
              "min_gap must be >= 2 unless meet_token is given (both labels of a pair with j - i = 1), got ",
              min_gap);
  TORCH_CHECK(!meet_token.has_value() || (*meet_token >= 0 && *meet_token < V),
              "meet_token must lie in [0, vocab_size=", V, "), got ", meet_token.value_or(0));
  // Only a pair set with gap-1 pairs reads it: with min_gap >= 2 the labels are gathered as always.
  const bool meets = meet_token.has_value() && min_gap == 1;
  const int64_t meet = meet_token.value_or(0);

  // The pairs, checked here as well as in Python so that no call through torch.ops can read
  // out of bounds.
  const bool listed = row_in.has_value();
  TORCH_CHECK(listed == i_in.has_value() && listed == j_in.has_value(),
              "row, i and j must be given together");
  PairWalk walk;
  TORCH_CHECK(at::isFloatingType(weight_in.scalar_type()), "weight must be floating point, got ",
              weight_in.scalar_type());
  at::Tensor row, pi, pj, weight = weight_in.to(at::kDouble).contiguous();
  if (listed) {
    row = row_in->contiguous(), pi = i_in->contiguous(), pj = j_in->contiguous();
    for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"row", &row},
                                   {"i", &pi}, {"j", &pj}}) {
      TORCH_CHECK(t->dim() == 1 && t->size(0) == row.size(0) && t->scalar_type() == at::kLong &&
                      t->device().is_cpu(),
                  name, " must be an int64 CPU vector as long as row (", row.size(0), "), got ",
                  t->sizes(), " ", t->scalar_type(), " on ", t->device());
    }
    TORCH_CHECK(weight.dim() == 1 && weight.size(0) == row.size(0),
                "weight must hold one entry per pair (", row.size(0), "), got ", weight.sizes());
    walk.row = row.data_ptr<int64_t>();
    walk.pi = pi.data_ptr<int64_t>();
    walk.pj = pj.data_ptr<int64_t>();
    walk.total = row.size(0);
    const int64_t* ps = prefix_start.data_ptr<int64_t>();
    for (const auto p : c10::irange(walk.total)) {
      const int64_t r = walk.row[p], i = walk.pi[p], j = walk.pj[p];
      // Bounds first: once 0 <= i, j < L, the gap j - i cannot overflow.
      TORCH_CHECK_VALUE(r >= 0 && r < B && i >= 0 && i < L && j >= 0 && j < L && i >= ps[r] &&
                            j - i >= min_gap && j - i <= max_gap && j <= len[r] - 1,
                        "pairs[", p, "] = (row=", r, ", i=", i, ", j=", j,
                        ") is not a valid pair of docs/contract.md §2");
    }
  } else {
    TORCH_CHECK(weight.dim() == 0 || (weight.dim() == 1 && weight.size(0) == B),
                "weight must be a 0-dim scale for all pairs or one scale per row (", B, ",), got ",
                weight.sizes());
    walk = all_pairs(len, prefix_start.data_ptr<int64_t>(), B, min_gap, max_gap);
  }
  // As belief_state_loss says in eager mode (under torch.compile only this check runs): a mean
  // over no pair is not 0.
  TORCH_CHECK_VALUE(walk.total > 0, "the batch has no valid pair at all: every row is too short for min_gap, ",
                    "prefix_start and lengths (or the pair list is empty)");
  // After the pair count: with no pair, the all-pairs scale 1/|P| is inf, and that is not what
  // the caller got wrong.
  for (const auto p : c10::irange(weight.numel())) {  // pair weights: scales of a mean, never of a sign
    const double w = weight.data_ptr<double>()[p];
    // the engine computes in float32: a weight past its range would turn the loss into inf
    TORCH_CHECK_VALUE(std::isfinite(w) && w >= 0 && w <= FLT_MAX, "weight[", p, "] must be finite, >= 0 and at most ",
                      "float32's largest (", FLT_MAX, "), got ", w);
  }
  for (const auto r : c10::irange(B)) {
    for (const auto t : c10::irange(len[r])) {
      const int64_t y = tok[r * L + t];
      // IndexError, as belief_state_loss raises in eager mode (compiled, only this check runs)
      TORCH_CHECK_INDEX(y >= 0 && y < V, "tokens must lie in [0, vocab_size=", V, ") at valid positions, got tokens[",
                        r, ", ", t, "] = ", y);
    }
  }

  const double* wts = weight.data_ptr<double>();
  const bool per_row = !listed && weight.dim() == 1;  // all pairs, each row its own scale (row_mean)
  const double scale = listed || per_row ? 0.0 : wts[0];
  const float lam[2] = {static_cast<float>(next_weight), static_cast<float>(1.0 - next_weight)};
  const int64_t TP = tile_pairs(two_v);
  const int64_t n_tiles = (walk.total + TP - 1) / TP;
  const float* a_ptr = A.data_ptr<float>();
  const float* b_ptr = Bm.data_ptr<float>();

  const auto f32 = A.options();
  std::vector<Accum> acc(std::max<int64_t>(at::get_num_threads(), 1));
  auto new_accum = [&](Accum& s) {
    if (!need_grad) return;
    s.dA = at::zeros_like(A);
    s.dB = at::zeros_like(Bm);
    for (const auto k : c10::irange(n_layers)) {
      s.dW.push_back(at::zeros_like(W[k]));
      s.dc.push_back(at::zeros_like(c[k]));
    }
  };

  // One tile runs inline: opening a parallel region costs more than a tiny call's work.
  const int64_t grain = n_tiles <= 1 ? 2 : 1;  // parallel_for runs inline when range < grain
  at::parallel_for(0, n_tiles, grain, [&](int64_t tile_begin, int64_t tile_end) {
    at::AutoDispatchBelowADInplaceOrView below_autograd_in_worker;  // dispatch state is per thread
    FlushSubnormals flush(at::in_parallel_region() || at::get_num_threads() == 1);
    const int tid = at::get_thread_num();
    Accum& s = acc.at(tid);
    if (need_grad && !s.dA.defined()) new_accum(s);
    // Per-thread buffers, reused by every tile of this thread.
    std::vector<at::Tensor> z(n_layers), h(n_layers);  // z[k], h[k]: input of layer k (k >= 1)
    z[0] = at::empty({TP, H1}, f32);
    h[0] = at::empty({TP, H1}, f32);
    for (const auto k : c10::irange(1, n_layers)) {
      z[k] = at::empty({TP, W[k - 1].size(0)}, f32);
      h[k] = at::empty({TP, W[k - 1].size(0)}, f32);
    }
    auto logits = at::empty({TP, two_v}, f32);
    auto logp = at::empty({TP, 2, V}, f32);
    std::vector<int64_t> pr(TP), pi_(TP), pj_(TP);
    std::vector<float> pw(TP);

    for (int64_t t = tile_begin; t < tile_end; ++t) {
      const int64_t begin = t * TP, end = std::min(begin + TP, walk.total), n = end - begin;
      float* z1 = z[0].data_ptr<float>();
      walk.walk(begin, end, [&](int64_t p, int64_t r, int64_t i, int64_t j) {
        pr[p] = r, pi_[p] = i, pj_[p] = j;
        pw[p] = static_cast<float>(listed ? wts[begin + p] : per_row ? wts[r] : scale);
        const float* a = a_ptr + (r * L + i) * H1;
        const float* bb = b_ptr + (r * L + j) * H1;
        float* out = z1 + p * H1;
        for (int64_t k = 0; k < H1; ++k) out[k] = a[k] + bb[k];
      });
      std::vector<at::Tensor> zt(n_layers), ht(n_layers);
      for (const auto k : c10::irange(n_layers)) {
        zt[k] = z[k].narrow(0, 0, n);
        ht[k] = h[k].narrow(0, 0, n);
        if (k > 0) at::addmm_out(zt[k], c[k - 1], ht[k - 1], W[k - 1].t());
        act_out(act, ht[k], zt[k]);
      }
      auto x = logits.narrow(0, 0, n);
      at::addmm_out(x, c.back(), ht.back(), W.back().t());
      // Each half's top logit mx, with e = exp(z - mx) in lp, the label's term ey and the sum ry of
      // the others: the loss is (mx - zy) + log1p(ry + (ey - 1)) and the label's gradient
      // -ry / (ry + ey). For a confident model (the label on top, ey = 1) both keep the tiny ry
      // whole, where a float32 log-softmax lost it to the rounding of mx near 50 and of 1 + ry.
      auto lp = logp.narrow(0, 0, n);
      auto x3 = x.view({n, 2, V}), e3 = lp.view({n, 2, V});
      const auto mx = x3.amax(-1, /*keepdim=*/true);
      at::sub_out(e3, x3, mx);
      e3.exp_();
      float* e = lp.data_ptr<float>();
      std::vector<float> ey(2 * n);
      std::vector<int64_t> label(2 * n);
      for (const auto p : c10::irange(n)) {
        const bool meet_pair = meets && pj_[p] - pi_[p] == 1;
        label[2 * p] = (p * 2) * V + (meet_pair ? meet : tok[pr[p] * L + pi_[p] + 1]);
        label[2 * p + 1] = (p * 2 + 1) * V + (meet_pair ? meet : tok[pr[p] * L + pj_[p] - 1]);
        for (const int h : {0, 1}) ey[2 * p + h] = e[label[2 * p + h]], e[label[2 * p + h]] = 0.0f;
      }
      const auto ry_t = e3.sum(-1, /*keepdim=*/true);

      const float* xp = x.data_ptr<float>();
      const float* mp = mx.data_ptr<float>();
      const float* ry = ry_t.data_ptr<float>();
      double tile_loss = 0.0;
      for (const auto p : c10::irange(n)) {
        double ce[2];
        for (const int h : {0, 1}) {
          const int64_t q = 2 * p + h;
          ce[h] = (mp[q] - xp[label[q]]) + std::log1p(ry[q] + (ey[q] - 1.0f));
        }
        tile_loss += static_cast<double>(pw[p]) * (lam[0] * ce[0] + lam[1] * ce[1]);
      }
      s.loss += tile_loss;
      if (!need_grad) continue;

      // g = (softmax - onehot) * w * lam, written over e: e * w * lam / (ry + ey), and at the
      // label -ry / (ry + ey) * w * lam.
      auto coef = at::empty({n, 2, 1}, f32);
      float* cp = coef.data_ptr<float>();
      for (const auto p : c10::irange(n)) {
        for (const int h : {0, 1}) cp[2 * p + h] = pw[p] * lam[h] / (ry[2 * p + h] + ey[2 * p + h]);
      }
      lp.view({n, 2, V}).mul_(coef);
      for (const auto q : c10::irange(2 * n)) e[label[q]] = -ry[q] * cp[q];
      auto g2 = lp.view({n, two_v});
      s.dW.back().addmm_(g2.t(), ht.back());
      s.dc.back().add_(g2.sum(0));
      auto dh = at::mm(g2, W.back());  // (n, h_last)
      for (int64_t k = n_layers - 1; k >= 1; --k) {
        auto dz = act_backward(act, dh, zt[k]);
        s.dW[k - 1].addmm_(dz.t(), ht[k - 1]);
        s.dc[k - 1].add_(dz.sum(0));
        dh = at::mm(dz, W[k - 1]);
      }
      auto dz1 = act_backward(act, dh, zt[0]).contiguous();
      const float* d = dz1.data_ptr<float>();
      float* dA = s.dA.data_ptr<float>();
      float* dB = s.dB.data_ptr<float>();
      for (const auto p : c10::irange(n)) {
        float* ra = dA + (pr[p] * L + pi_[p]) * H1;
        float* rb = dB + (pr[p] * L + pj_[p]) * H1;
        const float* dp = d + p * H1;
        for (int64_t k = 0; k < H1; ++k) ra[k] += dp[k];
        for (int64_t k = 0; k < H1; ++k) rb[k] += dp[k];
      }
    }
  });

  // Reduce the per-thread sums once, in thread order, into the first thread's accumulators.
  double sum = 0.0;
  for (const auto& s : acc) sum += s.loss;
  // The float32 loss as the other backends give it: past float32's range it is +-inf (a diverging
  // model's summed loss), not the error at::scalar_tensor raises for a double it cannot hold.
  const float loss = std::isfinite(sum) && std::fabs(sum) > std::numeric_limits<float>::max()
                         ? std::copysign(std::numeric_limits<float>::infinity(), sum)
                         : static_cast<float>(sum);
  if (!need_grad) {  // no gradient was computed: empty tensors say so (and cost no memory)
    std::vector<at::Tensor> dW, dc;  // distinct tensors: outputs must not alias each other
    for (int64_t k = 0; k < 2 * n_layers; ++k) (k < n_layers ? dW : dc).push_back(at::empty({0}, f32));
    return {at::scalar_tensor(loss, f32), at::empty({0}, f32), at::empty({0}, f32), dW, dc};
  }
  Accum out;
  for (auto& s : acc) {
    if (!s.dA.defined()) continue;
    if (!out.dA.defined()) {
      out = std::move(s);
      continue;
    }
    out.dA.add_(s.dA);
    out.dB.add_(s.dB);
    for (const auto k : c10::irange(n_layers)) {
      out.dW[k].add_(s.dW[k]);
      out.dc[k].add_(s.dc[k]);
    }
  }
  if (!out.dA.defined()) new_accum(out);  // no pair at all: zero gradients
  return {at::scalar_tensor(loss, f32), out.dA, out.dB, out.dW, out.dc};
}

}  // namespace bst_fast
