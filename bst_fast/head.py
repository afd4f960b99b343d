"""TextHead: the BST's MLP over [f_i ; b_j] with Next logits first and Prev logits last (SPEC §3)."""
from __future__ import annotations

from typing import Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from ._pairs import ACTIVATIONS


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """The head's activation by name (SPEC §3); leaky_relu has slope 0.01, gelu is the erf form."""
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
        for name, v in (("d_model", d_model), ("vocab_size", vocab_size), ("n_layers", n_layers)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if n_layers < 2:
            raise ValueError(f"n_layers must be >= 2 (the first layer splits into prefix and suffix parts), got {n_layers}")
        if isinstance(hidden, int) and not isinstance(hidden, bool):
            widths = [hidden] * (n_layers - 1)
        else:
            widths = list(hidden)
            if len(widths) != n_layers - 1:
                raise ValueError(f"hidden as a list must hold n_layers - 1 = {n_layers - 1} widths, got {len(widths)}")
        if any(not isinstance(w, int) or isinstance(w, bool) or w < 1 for w in widths):
            raise ValueError(f"hidden widths must be positive ints, got {hidden!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.d_model, self.vocab_size, self.activation = d_model, vocab_size, activation
        sizes = [2 * d_model, *widths, 2 * vocab_size]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., 2m) -> (..., 2V)."""
        for layer in self.layers[:-1]:
            x = activation(self.activation, layer(x))
        return self.layers[-1](x)

    def split_first_layer(self):
        """(W1f, W1b, c1): the first layer as a prefix part and a suffix part (SPEC §3)."""
        w = self.layers[0].weight  # (h1, 2m)
        return w[:, : self.d_model], w[:, self.d_model :], self.layers[0].bias

    def first_layer_states(self, f, b, lengths):
        """(A, B), each (B, L, h1) float32: A = f W1f^T + c1, B = b W1b^T, so z1_ij = A_i + B_j.

        The fused backends take these; autograd maps dA, dB back to f, b, W1 and c1. Padding
        (positions >= lengths) is in no pair, but dW1 = dA^T f reads every row: it is zeroed so
        that NaN or inf there cannot reach the gradients (0 * NaN = NaN)."""
        w1f, w1b, c1 = self.split_first_layer()
        pad = (torch.arange(f.shape[1], device=f.device)[None, :] >= lengths[:, None])[..., None]
        A = F.linear(f.float().masked_fill(pad, 0.0), w1f.float(), c1.float())
        B = F.linear(b.float().masked_fill(pad, 0.0), w1b.float())
        return A, B

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"
