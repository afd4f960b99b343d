"""The BST's text heads over [f_i ; b_j], Next logits first and Prev logits last (docs/contract.md §3).

TextHead: the MLP of the paper (and of every fused backend). ResidualSwiGLUHead: the head of the
official implementation (microsoft/BST, model_bst.py TextHead).

A head may also say how its work splits into per-token and per-pair parts, for the "torch" backend:

    pair_parts(f, b, lengths) -> PairParts(prefix, suffix, dtypes, tail, swiglu=())

prefix[k] and suffix[k] are (B, L, w_k) tensors computed once per position, from f, b and the head's
parameters alone (the backend maps their gradients back to those, a window of rows at a time; a part
that reaches another tensor requiring grad is refused). For a pair (r, i, j) the backend forms
x_k = prefix[k][r, i] + suffix[k][r, j], summed in float32 (float64 for float64 parts) and rounded
once to dtypes[k], and tail([x_0, x_1, ...]) (each x_k (n, w_k) for n pairs) returns the (n, 2V)
logits, equal to head(cat([f_i, b_j])). For k in `swiglu` the part is a [gate | up] table and
x_k = swiglu(gate sum, up sum), (n, w_k / 2), from the float32 (float64) sums, rounded once. A part may be [f ; 0] and [0 ; b]: its sum is the
concatenation. Positions at or beyond lengths are in no pair; a part that multiplies f or b by a
weight zeroes them first (0 * NaN = NaN in dW).
"""
from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from ._checks import ArgumentTypeError, plain_number
from ._pairs import ACTIVATIONS
from .backends import runtime


class PairParts(NamedTuple):
    """A head's work split into per-position parts and a per-pair tail (see the module docstring)."""

    prefix: List[torch.Tensor]
    suffix: List[torch.Tensor]
    dtypes: List[torch.dtype]  # x_k is rounded once to dtypes[k]
    tail: Callable
    swiglu: Tuple[int, ...] = ()  # parts whose x_k is swiglu(gate, up) of their two halves' sums


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """The head's activation by name (docs/contract.md §3); leaky_relu has slope 0.01, gelu is the erf form."""
    if name == "relu":
        return F.relu(x)
    if name == "leaky_relu":
        return F.leaky_relu(x, 0.01)
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "silu":
        return F.silu(x)
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")


def activation_grad(name: str, grad: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """grad * act'(z): the backward of `activation` by name, through autograd's own kernels."""
    if name == "relu":
        return torch.ops.aten.threshold_backward(grad, z, 0)
    if name == "leaky_relu":
        return torch.ops.aten.leaky_relu_backward(grad, z, 0.01, False)
    if name in ("gelu", "gelu_tanh"):
        return torch.ops.aten.gelu_backward(grad, z, approximate="none" if name == "gelu" else "tanh")
    if name == "silu":
        return torch.ops.aten.silu_backward(grad, z)
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")


def text_head_problem(hidden, n_layers, activation) -> Optional[Tuple[str, str]]:
    """(argument, what it must be) for the first of TextHead's hidden / n_layers / activation out
    of range, else None: one check for the module and for ModelConfig's head_* fields."""
    if not isinstance(n_layers, int) or isinstance(n_layers, bool) or n_layers < 2:
        return "n_layers", "an int >= 2 (the first layer splits into prefix and suffix parts)"
    if isinstance(hidden, bool) or not isinstance(hidden, (int, list, tuple)):  # a float, a string, a bool
        return "hidden", f"a positive int or a list of n_layers - 1 = {n_layers - 1} positive ints"
    widths = [hidden] if isinstance(hidden, int) and not isinstance(hidden, bool) else list(hidden)
    if (not isinstance(hidden, int) and len(widths) != n_layers - 1
            or any(not isinstance(w, int) or isinstance(w, bool) or w < 1 for w in widths)):
        return "hidden", f"a positive int or a list of n_layers - 1 = {n_layers - 1} positive ints"
    if activation not in ACTIVATIONS:
        return "activation", f"one of {ACTIVATIONS}"
    return None


class TextHead(nn.Module):
    """Linear(2m, h_1) -> act -> ... -> Linear(h_{n-1}, 2V); the Next and Prev heads share all but the last layer.

    Args:
        d_model: m, the width of f and b.
        vocab_size: V; the output has 2V logits, Next first.
        hidden: width of every hidden layer, or a list of the n_layers - 1 widths.
        n_layers: number of Linear layers, at least 2 (the first is split into a prefix and a suffix part).
        activation: one of relu, leaky_relu, gelu, gelu_tanh, silu.
    """

    def __init__(self, d_model: int, vocab_size: int, hidden: Union[int, Sequence[int]] = 512,
                 n_layers: int = 2, activation: str = "gelu"):
        super().__init__()
        for name, v in (("d_model", d_model), ("vocab_size", vocab_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        problem = text_head_problem(hidden, n_layers, activation)
        if problem is not None:
            name, want = problem
            raise ValueError(f"{name} must be {want}, got {dict(hidden=hidden, n_layers=n_layers, activation=activation)[name]!r}")
        widths = [hidden] * (n_layers - 1) if isinstance(hidden, int) else list(hidden)
        self.d_model, self.vocab_size, self.activation = d_model, vocab_size, activation
        sizes = [2 * d_model, *widths, 2 * vocab_size]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., 2m) -> (..., 2V)."""
        return self._after_first_layer(self.layers[0](x))

    def _after_first_layer(self, z1: torch.Tensor) -> torch.Tensor:
        x = z1
        for layer in self.layers[1:]:
            x = layer(activation(self.activation, x))
        return x

    def first_layer_states(self, f, b, lengths, compute=None):
        """(A, B), each (B, L, h1) float32 (float64 for float64 inputs): A = f W1f^T + c1,
        B = b W1b^T, so z1_ij = A_i + B_j; compute: the matrix operands' dtype (split_linear).

        The fused backends take these; autograd maps dA, dB back to f, b, W1 and c1. Padding
        (positions >= lengths) is in no pair, but dW1 = dA^T f reads every row: it is zeroed so
        that NaN or inf there cannot reach the gradients (0 * NaN = NaN)."""
        return split_linear(self.layers[0], f, b, lengths, compute)

    def pair_parts(self, f, b, lengths):
        """The first layer per token, A and B in float32 (float64 for float64 inputs); per pair
        A_i + B_j rounded once to the layers' dtype, then act and the later layers (see the module
        docstring)."""
        A, B = self.first_layer_states(f, b, lengths)
        return PairParts([A], [B], [linear_dtype(self.layers[0], f.device.type)], lambda xs: self._after_first_layer(xs[0]))

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"


def has_backward_hooks(module: nn.Module) -> bool:
    """Whether a backward (pre-)hook is registered on `module` or any module inside it."""
    return any(m._backward_hooks or m._backward_pre_hooks for m in module.modules())


def _methods_changed(head: nn.Module, cls: type, names) -> Optional[str]:
    """Which of `cls`'s methods `names` a subclass overrides or the object replaces, or None."""
    for name in names:
        if getattr(type(head), name) is not getattr(cls, name):
            return f"{type(head).__name__} overrides {cls.__name__}.{name}"
        if name in head.__dict__:  # set on the object (as accelerate's hooks and some adapters do)
            return f"its {name} is replaced on the object"
    return None


def _forward_hooked(*modules: nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def text_head_changes(head: TextHead) -> Optional[str]:
    """What makes a TextHead compute other than its layers' weights and biases say, or None: a
    subclass's own forward (or the methods the split uses), a layer that is not a plain nn.Linear
    with a bias (an adapter, a LoRA wrapper), a forward hook. The fused backends and TextHead's own
    pair_parts read the weights and biases alone, so such a head goes through the head as a whole.
    Global module hooks (register_module_forward_hook) are not looked at: profilers and FLOP counters
    register them to observe every module, and would send every head down the slow path."""
    why = _methods_changed(head, TextHead, ("forward", "pair_parts", "first_layer_states", "_after_first_layer"))
    if why:
        return why
    for k, layer in enumerate(head.layers):
        if "forward" in layer.__dict__:
            return f"layers[{k}].forward is replaced on the object"
        if type(layer) is not nn.Linear:
            return f"layers[{k}] is a {type(layer).__name__}, not an nn.Linear"
        if layer.bias is None:
            return f"layers[{k}] has no bias"
    if head.layers[-1].out_features != 2 * head.vocab_size:
        return f"layers[-1] gives {head.layers[-1].out_features} logits, not 2 * vocab_size = {2 * head.vocab_size}"
    if _forward_hooked(*head.modules()):
        return "a forward hook is registered on it"
    if has_backward_hooks(head):
        return "a backward hook is registered on it"

    return None


def split_linear(linear: nn.Linear, f: torch.Tensor, b: torch.Tensor, lengths: Optional[torch.Tensor] = None,
                 compute: Optional[torch.dtype] = None):
    """A Linear over [f ; b] as per-position parts (docs/contract.md §3): (f W_f^T + c, b W_b^T),
    with W = [W_f | W_b]; for a pair their sum is linear([f_i ; b_j]). Accumulated and returned in
    float32 (float64 for float64 inputs), autocast or not: the per-pair sum is rounded once, later,
    by the backend. With `lengths`, f and b are zeroed at positions >= lengths first (zero_padding).

    The products' operands are float32 too (float32 GEMMs: on a GPU off the tensor cores), unless
    the switch split_16bit is on and `compute`, the dtype of the unsplit layer's operands (None:
    linear_dtype's, autocast's or the layer's own), is 16-bit: then they take that dtype, as the
    unsplit layer's would, with float32 accumulation (mm_f32). In the backward that rounds the
    float32 dA and dB to bfloat16, as the unsplit layer's per-pair gradient is rounded; a float16
    compute keeps them float32 (float16's range would lose tiny pair weights' gradients to
    subnormals), so there the backward's GEMMs stay float32."""
    m = f.shape[-1]
    compute = linear_dtype(linear, f.device.type) if compute is None else compute
    return _SplitLinear.apply(f, b, lengths, linear.weight[:, :m], linear.weight[:, m:], linear.bias,
                              split_operands(compute, f.dtype))


def split_operands(compute: torch.dtype, dtype: torch.dtype):
    """The dtypes of a split layer's matrix operands, (forward, backward), for inputs of `dtype`
    whose unsplit layer would compute in `compute` (split_linear says why)."""
    table = torch.float64 if dtype == torch.float64 else torch.float32
    sixteen = runtime.SWITCHES.split_16bit and compute.itemsize == 2 and dtype != torch.float64
    forward = compute if sixteen else table
    return forward, (forward if forward == torch.bfloat16 else table)


class _SplitLinear(torch.autograd.Function):
    """split_linear with its own backward, for memory: autograd through `F.linear(f.float(), ..)`
    keeps the float32 (zero-padded) copies of f and b from the forward to the backward, 8 bytes a
    position and model unit for bf16 states (the step's largest saved tensors after the encoders').
    This keeps f and b as given (often held anyway) and makes the padded float32 copies again in
    the backward, one side at a time. The same products in the same order: the same values (with
    float32 operands; split_16bit's 16-bit ones are rounded again in the backward, as in the forward)."""

    @staticmethod
    def forward(ctx, f, b, lengths, wf, wb, c, operands):
        # operands: the dtypes of the forward's and of the backward's matrix operands (split_linear)
        ctx.save_for_backward(f, b, lengths, wf, wb)
        ctx.bias_dtype, ctx.operand = None if c is None else c.dtype, operands[1]
        with torch.autocast(f.device.type, enabled=False):
            return split_part(f, lengths, wf, c, operands[0]), split_part(b, lengths, wb, None, operands[0])

    @staticmethod
    def backward(ctx, dA, dB):
        f, b, lengths, wf, wb = ctx.saved_tensors
        need, op = ctx.needs_input_grad, ctx.operand
        with torch.autocast(f.device.type, enabled=False):
            df, dwf = split_part_grads(f, dA, wf, lengths, need[0], need[3], op)
            db, dwb = split_part_grads(b, dB, wb, lengths, need[1], need[4], op)
            dc = dA.reshape(-1, dA.shape[-1]).sum(0).to(ctx.bias_dtype) if need[5] else None
        as_weight = lambda g, w: None if g is None else g.to(w.dtype)
        return df, db, None, as_weight(dwf, wf), as_weight(dwb, wb), dc, None


def split_part(x, lengths, w, c, operand):
    """One part of a split layer, x W^T (+ c), accumulated and returned in float32 (float64 for
    float64 x): x zeroed at positions >= lengths (None: none), the product's operands in `operand`
    (split_operands' forward dtype), the bias added in float32."""
    return _linear_f32(_float_input(x, lengths, operand), w.to(operand), None if c is None else c.to(_table_dtype(x)))


def _linear_f32(x, w, c):
    """F.linear(x, w, c) accumulated and returned in float32 (float64), for 16-bit x and w too."""
    if x.dtype.itemsize >= 4:
        return F.linear(x, w, c)
    out = mm_f32(x.reshape(-1, x.shape[-1]), w.t()).view(*x.shape[:-1], w.shape[0])
    return out if c is None else out + c


def split_part_grads(x, dz, w, lengths, need_x: bool, need_w: bool, operand, dx_dtype=None):
    """The gradients of x and w for dz, the gradient of split_part(x, lengths, w, ..), from operands
    in `operand` (split_operands' backward dtype) accumulated in float32 (float64): dx zero at
    padding (as zero_padding's gradient is), in dx_dtype (None: x's); dw in float32 (float64)."""
    d2 = dz.reshape(-1, dz.shape[-1]).to(operand)
    dx_dtype = x.dtype if dx_dtype is None else dx_dtype
    dx = _zero_padding(mm_f32(d2, w.to(operand)).view(x.shape), lengths).to(dx_dtype) if need_x else None
    # x^T dz, transposed: the product autograd takes for F.linear's weight, so that a BLAS sums it in
    # the same order (dz^T x is 1 ulp away on an AMD EPYC)
    dw = mm_f32(_float_input(x, lengths, operand).reshape(-1, x.shape[-1]).t(), d2).t() if need_w else None
    return dx, dw


def mm_f32(a, b):
    """a @ b with a float32 result: accumulated and returned in float32, also for bf16/fp16 operands."""
    if a.dtype == torch.float32 or a.dtype == torch.float64:
        return a @ b
    if a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except TypeError:  # a torch without mm's out_dtype: float32 products (slower, not rounded)
            return a.float() @ b.float()
    return a.float() @ b.float()  # the CPU (interpreter tests): exact products, float32 sums


def _table_dtype(f: torch.Tensor) -> torch.dtype:
    return torch.float64 if f.dtype == torch.float64 else torch.float32


def _float_input(x, lengths, dtype):
    """x zeroed at padding (when lengths is given) in `dtype`."""
    return _zero_padding(x, lengths).to(dtype)


def _zero_padding(x, lengths):
    return x if lengths is None else zero_padding(x, lengths)


def linear_dtype(linear: nn.Linear, device_type: str) -> torch.dtype:
    """The dtype `linear(x)` has here: autocast's for a 16- or 32-bit layer under autocast, else
    the layer's. A split layer's per-pair sum is rounded to it, as the unsplit layer's output is."""
    if torch.is_autocast_enabled(device_type) and linear.weight.dtype != torch.float64:
        return torch.get_autocast_dtype(device_type)
    return linear.weight.dtype


def concat_parts(f: torch.Tensor, b: torch.Tensor):
    """[f ; 0] and [0 ; b]: per-position parts whose pair sum is the concatenation [f_i ; b_j]."""
    return torch.cat([f, torch.zeros_like(f)], -1), torch.cat([torch.zeros_like(b), b], -1)


def zero_padding(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """x (B, L, k) with the positions at or beyond lengths[r] set to zero."""
    pad = torch.arange(x.shape[1], device=x.device)[None, :] >= lengths[:, None]
    return x.masked_fill(pad[..., None], 0.0)


def swiglu_hidden(d_model: int) -> int:
    """The official head's SwiGLU width for [f ; b] of 2m: 8 * 2m / 3 rounded to a multiple of 128
    (model_bst.py: 128 * round(h / 128)), at least 128."""
    return max(128, 128 * round(8 * 2 * d_model / 3 / 128))


class _SwiGLU(nn.Module):
    """silu(gate) * up with [gate | up] = gate_up(x) (the official model_base.SwiGLU)."""

    def __init__(self, d_in: int, hidden: int, bias: bool):
        super().__init__()
        self.gate_up = nn.Linear(d_in, 2 * hidden, bias=bias)

    def forward(self, x):
        return swiglu(*self.gate_up(x).chunk(2, dim=-1))


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def swiglu_grad(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    """(dgate, dup) of swiglu at (gate, up) for the output gradient `grad`: grad * up * silu'(gate)
    and grad * silu(gate) (kernels/activation.swiglu_grad is the same formula in Triton)."""
    return torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)


class _Norm(nn.Module):
    """The official LayerNorm class (model_base.LayerNorm): a LayerNorm with weight and bias, or
    without a bias an RMSNorm with a weight."""

    def __init__(self, width: int, bias: bool, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width)) if bias else None

    def forward(self, x):
        if self.bias is not None:
            return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, {'layer_norm' if self.bias is not None else 'rms_norm'}, eps={self.eps}"


class ResidualSwiGLUHead(nn.Module):
    """The official BST head (microsoft/BST model_bst.py TextHead), with TextHead's conventions.

    x = [f ; b] (2m wide); x = x + Down(SwiGLU(x)); x = Norm(x); the halves x[:m] and x[m:] go
    through one shared lm_head (m -> V, no bias): Next logits from the first, Prev logits from the
    second. Output (..., 2V), Next first.

    Args:
        d_model: m, the width of f and b.
        vocab_size: V.
        hidden: the SwiGLU width; default 8 * 2m / 3 rounded to a multiple of 128, as the official code.
        bias: biases in gate_up and Down, and the norm's kind. As the official LayerNorm class:
            bias=True is a LayerNorm with a bias; bias=False (the official default) is an RMSNorm
            with a weight (F.rms_norm). eps 1e-5 either way.

    Parameters are named as the official module's (mlp.0.gate_up, mlp.2, norm, lm_head), so its
    state dict loads. `tie(embedding)` shares lm_head's (V, m) weight with a token embedding.
    The gate/up projection splits per token (pair_parts): the "torch" backend
    computes it once per position instead of once per pair.
    """

    def __init__(self, d_model: int, vocab_size: int, hidden: Optional[int] = None, bias: bool = False):
        super().__init__()
        for name, v in (("d_model", d_model), ("vocab_size", vocab_size)) + ((("hidden", hidden),) if hidden is not None else ()):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.d_model, self.vocab_size = d_model, vocab_size
        self.hidden = swiglu_hidden(d_model) if hidden is None else hidden
        bias = plain_number(bias)
        if not isinstance(bias, bool):  # bool("no") is True: a LayerNorm and biases nobody asked for
            raise ArgumentTypeError(f"bias must be True or False, got {bias!r}")
        self.bias = bias
        two_m = 2 * d_model
        self.mlp = nn.Sequential(_SwiGLU(two_m, self.hidden, self.bias), nn.Identity(),
                                 nn.Linear(self.hidden, two_m, bias=self.bias))
        self.norm = _Norm(two_m, self.bias)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        for q in self.modules():  # the official initialisation
            if isinstance(q, nn.Linear):
                nn.init.normal_(q.weight, mean=0.0, std=0.02)
                if q.bias is not None:
                    nn.init.zeros_(q.bias)

    def tie(self, embedding: nn.Embedding) -> "ResidualSwiGLUHead":
        """Share lm_head's weight with `embedding` (V rows of width m): one Parameter, both gradients."""
        if tuple(embedding.weight.shape) != tuple(self.lm_head.weight.shape):
            raise ValueError(f"the embedding's weight {tuple(embedding.weight.shape)} must have lm_head's shape "
                             f"(vocab_size, d_model) = {tuple(self.lm_head.weight.shape)}")
        self.lm_head.weight = embedding.weight
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., 2m) -> (..., 2V)."""
        return self._after_swiglu(x, self.mlp[0](x))

    def _after_swiglu(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        x = self.norm(x + self.mlp[2](self.mlp[1](h)))
        halves = x.unflatten(-1, (2, self.d_model))  # (..., 2, m): Next half, Prev half
        return self.lm_head(halves).flatten(-2)

    def pair_parts(self, f, b, lengths):
        """Per token [f ; 0] and [0 ; b] (the residual [f_i ; b_j] is their sum), in the head's
        dtype, and the gate_up part (f Wf^T + c and b Wb^T, [gate | up]) in float32, a swiglu part:
        per pair the backend forms silu(gate) * up from the float32 sums and rounds it once; then
        Down, the norm and lm_head (see the module docstring)."""
        # float32 (float64 for float64) tables: two bf16 parts rounded apart and then added miss
        # docs/contract.md §6's bound (2x the materialised error) on some gradients.
        gf, gb = split_linear(self.mlp[0].gate_up, f, b, lengths)
        xf, xb = concat_parts(zero_padding(f, lengths), zero_padding(b, lengths))
        return PairParts([xf, gf], [xb, gb], [f.dtype, linear_dtype(self.mlp[0].gate_up, f.device.type)],
                         lambda xs: self._after_swiglu(*xs), swiglu=(1,))

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, bias={self.bias}"


def swiglu_head_changes(head: ResidualSwiGLUHead) -> Optional[str]:
    """What makes a ResidualSwiGLUHead compute other than its pair_parts says, or None. pair_parts
    reads gate_up's weight and bias and never calls the head's forward, mlp[0] or gate_up; Down,
    the norm and lm_head it runs as modules (their hooks and wrappers apply). So a subclass's forward,
    an mlp[0] or gate_up that is not the plain module (an adapter, a LoRA wrapper) or a forward hook
    on the head, mlp[0] or gate_up makes the head go through whole (text_head_changes says why
    global hooks are not looked at)."""
    why = _methods_changed(head, ResidualSwiGLUHead, ("forward", "_after_swiglu"))
    if why:
        return why
    act = head.mlp[0]
    if type(act) is not _SwiGLU:
        return f"mlp[0] is a {type(act).__name__}, not the head's SwiGLU"
    if type(act.gate_up) is not nn.Linear:
        return f"mlp[0].gate_up is a {type(act.gate_up).__name__}, not an nn.Linear"
    for name, module in (("mlp[0]", act), ("mlp[0].gate_up", act.gate_up)):
        if "forward" in module.__dict__:
            return f"{name}.forward is replaced on the object"
    if _forward_hooked(head, act, act.gate_up):
        return "a forward hook is registered on it, its mlp[0] or mlp[0].gate_up"
    return None


def split_changes(head: nn.Module) -> Optional[str]:
    """Why a bst_fast head's own pair_parts no longer says what the head computes, or None (also for
    any other head, and for a pair_parts set on the object: a split of its own is its author's to
    keep right)."""
    if "pair_parts" in head.__dict__:
        return None
    if isinstance(head, TextHead) and type(head).pair_parts is TextHead.pair_parts:
        return text_head_changes(head)
    if isinstance(head, ResidualSwiGLUHead) and type(head).pair_parts is ResidualSwiGLUHead.pair_parts:
        return swiglu_head_changes(head)
    return None
