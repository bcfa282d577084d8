// The Mogrifier window kernel's two loops (zoo/mogrifier.py, _MogrifierWindow) in C++.
//
// Why C++: at batch 20 a Mogrifier step is about a hundred small ATen ops (five rounds, the LSTM's pointwise ops and
// their derivatives), each a few microseconds of Python on top of its own dispatch. Run from here instead, a training
// step took 5-14% less time (2 x 650, batch 20, interleaved with the Python loops in one process). TorchScript would
// remove that overhead too, but torch.jit.script is deprecated; torch.compile was slower than eager here (its CPU
// linear is not oneDNN's packed one in training). So the loops are written out once more, op for op as their Python
// twins in zoo/mogrifier.py: the same ATen calls in the same order, so that the two agree bit for bit, which
// tests/test_native.py checks.
//
// The window GEMMs (the weights' gradients) stay in Python (zoo/kernels.py); only the per-step loops are here. Tried
// and dropped: writing their operands into window buffers a row block per step instead of concatenating per-step
// tensors. Alone it was within noise at batch 20, and at batch 64 in a process that also trains other models it took
// 635-688 against 465-515 ms per step, with twice the page faults (36-40 against 19-22 thousand per step): large
// buffers that live from the forward to the backward come as fresh pages from a fragmented heap.
//
// Saved tensors, per step, in this order (the Python path keeps the same ones):
//   xs: x^{-1}, x^1, x^3, ...  (1 + odd rounds)      hs: h^0, h^2, ...   (1 + even rounds)
//   mids: each round's first product (low rank only)  gates: sigm(pre) of each round
//   sig (B, 4n) sigm of the LSTM pre-activations, tanh(g), c_prev, tanh(c)

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <vector>

namespace {

using at::Tensor;
using OptionalTensor = std::optional<Tensor>;
using OptionalTensorList = c10::List<OptionalTensor>;

// oneDNN's packed linear, the op torch.compile emits for a CPU linear (zoo/kernels.py feature-tests it first).
Tensor packed_linear(const Tensor& x, const Tensor& packed, const OptionalTensor& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<Tensor(const Tensor&, const Tensor&, const OptionalTensor&, c10::string_view,
                                     c10::List<std::optional<c10::Scalar>>, std::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<std::optional<c10::Scalar>>(), std::nullopt);
}

// add + x @ W.T through the packed weight.
Tensor packed_linear_add(const Tensor& x, const Tensor& add, const Tensor& packed) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "binary")
                       .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, const OptionalTensor&,
                                     c10::string_view)>();
  return op.call(x, add, packed, std::nullopt, "add");
}

struct Rounds {
  std::vector<Tensor> firsts;
  std::vector<OptionalTensor> lefts, biases;
  int64_t count() const { return static_cast<int64_t>(firsts.size()); }
  bool low_rank() const { return count() > 0 && lefts[0].has_value(); }
};

Rounds read_rounds(const std::vector<Tensor>& firsts, const OptionalTensorList& lefts,
                   const OptionalTensorList& biases) {
  Rounds rounds;
  rounds.firsts = firsts;
  for (const auto& left : lefts) rounds.lefts.push_back(left);
  for (const auto& bias : biases) rounds.biases.push_back(bias);
  TORCH_CHECK(rounds.lefts.size() == firsts.size() && rounds.biases.size() == firsts.size(),
              "mogrifier_window: one first, left and bias entry per round");
  return rounds;
}

// Per-step layout of the saved list (zoo/mogrifier.py, _WindowLayout).
struct Layout {
  int64_t rounds, odd, even, mids;
  Layout(int64_t rounds, bool low_rank)
      : rounds(rounds), odd((rounds + 1) / 2), even(rounds / 2), mids(low_rank ? rounds : 0) {}
  int64_t xs() const { return 0; }
  int64_t hs() const { return 1 + odd; }
  int64_t gate(int64_t i) const { return hs() + 1 + even + mids + i; }     // round i (0-based)
  int64_t lstm() const { return hs() + 1 + even + mids + rounds; }         // sig, tanh_g, c_prev, tanh_c
  int64_t per_step() const { return lstm() + 4; }
};

// Forward loop. Returns y (B, T, n), h_T, c_T and the saved tensors (Layout, step after step).
std::tuple<Tensor, Tensor, Tensor, std::vector<Tensor>> forward(
    const Tensor& x, const Tensor& h0, const Tensor& c0, const OptionalTensorList& keep,
    const OptionalTensor& state_mask, const Tensor& weight_x, const Tensor& weight_h, bool packed,
    const Tensor& bias, const std::vector<Tensor>& firsts, const OptionalTensorList& lefts,
    const OptionalTensorList& biases) {
  const Rounds rounds = read_rounds(firsts, lefts, biases);
  const int64_t steps = x.size(1), n = h0.size(1), r = rounds.count();
  const Layout layout(r, rounds.low_rank());
  TORCH_CHECK(static_cast<int64_t>(keep.size()) == steps, "mogrifier_window: one keep entry per step");
  const Tensor inputs = x.transpose(0, 1);  // (T, B, m)
  std::vector<Tensor> saved;
  saved.reserve(steps * layout.per_step());
  std::vector<Tensor> outputs;
  outputs.reserve(steps);
  Tensor h = h0, c = c0;
  std::vector<Tensor> xs, hs, mids, gates;
  for (int64_t t = 0; t < steps; ++t) {
    const OptionalTensor keep_t = keep.get(t);
    if (keep_t.has_value()) {
      const Tensor k = keep_t->unsqueeze(1);  // (B, 1)
      h = h * k;
      c = c * k;
    }
    if (state_mask.has_value()) h = h * *state_mask;
    xs.assign({inputs.select(0, t)});
    hs.assign({h});
    mids.clear();
    gates.clear();
    for (int64_t i = 1; i <= r; ++i) {  // odd rounds gate x reading h (eq. 1), even rounds gate h reading x (eq. 2)
      std::vector<Tensor>& read = (i % 2) ? hs : xs;
      std::vector<Tensor>& chain = (i % 2) ? xs : hs;
      Tensor pre = at::mm(read.back(), rounds.firsts[i - 1].t());  // (B, k) or (B, width)
      if (rounds.lefts[i - 1].has_value()) {
        mids.push_back(pre);
        pre = at::mm(pre, rounds.lefts[i - 1]->t());
      }
      if (rounds.biases[i - 1].has_value()) pre = pre + *rounds.biases[i - 1];
      Tensor gate = at::sigmoid(pre);
      gates.push_back(gate);
      chain.push_back(at::mul(gate, chain.back()).mul_(2));
    }
    Tensor pre;  // (B, 4n) = W_h h^up + b + W_x x^up, summed in that order as in Python
    if (packed) {
      pre = packed_linear(hs.back(), weight_h, bias);
      pre = packed_linear_add(xs.back(), pre, weight_x);
    } else {
      pre = at::addmm(bias, hs.back(), weight_h.t());
      pre = at::addmm(pre, xs.back(), weight_x.t());
    }
    const Tensor sig = at::sigmoid(pre);
    const Tensor tanh_g = at::tanh(pre.slice(1, 2 * n, 3 * n));
    const Tensor c_prev = c;
    c = at::addcmul(sig.slice(1, n, 2 * n) * c, sig.slice(1, 0, n), tanh_g);
    const Tensor tanh_c = at::tanh(c);
    h = sig.slice(1, 3 * n, 4 * n) * tanh_c;
    saved.insert(saved.end(), xs.begin(), xs.end());
    saved.insert(saved.end(), hs.begin(), hs.end());
    saved.insert(saved.end(), mids.begin(), mids.end());
    saved.insert(saved.end(), gates.begin(), gates.end());
    saved.insert(saved.end(), {sig, tanh_g, c_prev, tanh_c});
    outputs.push_back(h);
  }
  return {at::stack(outputs, 1), h, c, saved};
}

// grad @ W for a step's gate gradient (B, 4n): through oneDNN on `operand` (W's transposed view, or W^T packed), or
// a plain mm on W.
Tensor input_grad(const Tensor& grad, const Tensor& operand, bool onednn) {
  return onednn ? packed_linear(grad, operand, std::nullopt) : at::mm(grad, operand);
}

// Backward loop (BPTT by hand; zoo/mogrifier.py explains the derivatives). Returns
//   [grad_x (B, T, m), dh0, dc0, the gate gradients (T*B, 4n)]
//   + per round: d(pre-sigmoid) (T*B, out), and at low rank d(first product) (T*B, k)
// with rows in step order, for the weights' window GEMMs.
std::vector<Tensor> backward(const std::vector<Tensor>& saved, const Tensor& grad_y, const Tensor& grad_h,
                             const Tensor& grad_c, const OptionalTensorList& keep, const OptionalTensor& state_mask,
                             const Tensor& operand_x, const Tensor& operand_h, bool onednn,
                             const std::vector<Tensor>& firsts, const OptionalTensorList& lefts,
                             const OptionalTensorList& biases) {
  const Rounds rounds = read_rounds(firsts, lefts, biases);
  const int64_t r = rounds.count();
  const Layout layout(r, rounds.low_rank());
  const int64_t steps = static_cast<int64_t>(saved.size()) / layout.per_step();
  const int64_t n = grad_h.size(1);
  const Tensor grad_ys = grad_y.transpose(0, 1);  // (T, B, n)
  Tensor dh = grad_h, dc = grad_c;
  std::vector<Tensor> grad_inputs(steps), grad_gates(steps);
  std::vector<std::vector<Tensor>> grad_pre(r, std::vector<Tensor>(steps)), grad_mid(r, std::vector<Tensor>(steps));
  for (int64_t t = steps - 1; t >= 0; --t) {
    const Tensor* step = saved.data() + t * layout.per_step();
    const Tensor &sig = step[layout.lstm()], &tanh_g = step[layout.lstm() + 1];
    const Tensor &c_prev = step[layout.lstm() + 2], &tanh_c = step[layout.lstm() + 3];
    dh = dh + grad_ys.select(0, t);
    const Tensor i_gate = sig.slice(1, 0, n), f_gate = sig.slice(1, n, 2 * n), o_gate = sig.slice(1, 3 * n, 4 * n);
    dc = dc + at::tanh_backward(dh * o_gate, tanh_c);
    Tensor d_pre = at::empty_like(sig);  // (B, 4n), gate order i, f, g, o
    Tensor d_i = d_pre.slice(1, 0, n), d_f = d_pre.slice(1, n, 2 * n);
    Tensor d_g = d_pre.slice(1, 2 * n, 3 * n), d_o = d_pre.slice(1, 3 * n, 4 * n);
    at::sigmoid_backward_out(d_i, dc * tanh_g, i_gate);
    at::sigmoid_backward_out(d_f, dc * c_prev, f_gate);
    at::tanh_backward_out(d_g, dc * i_gate, tanh_g);
    at::sigmoid_backward_out(d_o, dh * tanh_c, o_gate);
    grad_gates[t] = d_pre;
    dc = dc * f_gate;
    Tensor dx = input_grad(d_pre, operand_x, onednn);  // grads of x^up, h^up
    dh = input_grad(d_pre, operand_h, onednn);
    for (int64_t i = r; i >= 1; --i) {
      const Tensor& gate = step[layout.gate(i - 1)];  // sigm(p)
      Tensor d_out, gated;
      if (i % 2) {  // x^i = 2 gate * x^{i-2}, the gate read h^{i-1}
        gated = step[layout.xs() + (i + 1) / 2 - 1];
        d_out = dx;
        dx = at::mul(dx, gate).mul_(2);
      } else {
        gated = step[layout.hs() + i / 2 - 1];
        d_out = dh;
        dh = at::mul(dh, gate).mul_(2);
      }
      const Tensor d_p = at::sigmoid_backward(at::mul(d_out, gated).mul_(2), gate);  // d/dp of 2 sigm(p) * u
      grad_pre[i - 1][t] = d_p;
      Tensor d_read = d_p;
      if (rounds.lefts[i - 1].has_value()) {
        d_read = at::mm(d_read, *rounds.lefts[i - 1]);
        grad_mid[i - 1][t] = d_read;
      }
      d_read = at::mm(d_read, rounds.firsts[i - 1]);
      if (i % 2)
        dh = dh + d_read;
      else
        dx = dx + d_read;
    }
    grad_inputs[t] = dx;
    if (state_mask.has_value()) dh = dh * *state_mask;
    const OptionalTensor keep_t = keep.get(t);
    if (keep_t.has_value()) {
      const Tensor k = keep_t->unsqueeze(1);
      dh = dh * k;
      dc = dc * k;
    }
  }
  std::vector<Tensor> result{at::stack(grad_inputs, 1), dh, dc, at::cat(grad_gates)};
  for (int64_t i = 0; i < r; ++i) {
    result.push_back(at::cat(grad_pre[i]));
    if (rounds.lefts[i].has_value()) result.push_back(at::cat(grad_mid[i]));
  }
  return result;
}

}  // namespace

TORCH_LIBRARY(lm_zoo, m) {
  m.def(
      "mogrifier_window_forward(Tensor x, Tensor h0, Tensor c0, Tensor?[] keep, Tensor? state_mask, Tensor weight_x, "
      "Tensor weight_h, bool packed, Tensor bias, Tensor[] firsts, Tensor?[] lefts, Tensor?[] biases) "
      "-> (Tensor, Tensor, Tensor, Tensor[])");
  m.def(
      "mogrifier_window_backward(Tensor[] saved, Tensor grad_y, Tensor grad_h, Tensor grad_c, Tensor?[] keep, "
      "Tensor? state_mask, Tensor operand_x, Tensor operand_h, bool onednn, Tensor[] firsts, Tensor?[] lefts, "
      "Tensor?[] biases) -> Tensor[]");
}

// CompositeExplicitAutograd: the kernels call ATen ops, so they run on any device; the autograd.Function in Python
// calls them with grad mode off.
TORCH_LIBRARY_IMPL(lm_zoo, CompositeExplicitAutograd, m) {
  m.impl("mogrifier_window_forward", &forward);
  m.impl("mogrifier_window_backward", &backward);
}
