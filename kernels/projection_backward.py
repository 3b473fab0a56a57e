"""The projection GEMMs of the training backward: plain torch matrix products.

For ``y_i = hidden @ W_i.T (+ b_i)`` and its output gradients ``grads[i]``::

    grad_hidden = grads[0] @ W_0 + grads[1] @ W_1 + ...     # addmm per further projection
    grad_W_i    = grads[i].T @ hidden
    grad_b_i    = grads[i].sum(0)

Written as torch ops, so that in a compiled graph they are ``aten.mm`` / ``aten.addmm`` nodes that
Inductor lowers itself (cuBLAS, or its own templates under ``max-autotune``), and eagerly they are
cuBLAS calls. Hand-written Triton GEMMs (pointer, TMA, persistent, warp-specialized, split-store)
and a two-stream route were measured against cuBLAS on the H200 and lost or tied
(``benchmarks/NOTES-backward.md``), so they are gone.
"""

from __future__ import annotations

import torch


def projection_gemms(
    grads: list[torch.Tensor],
    hidden: torch.Tensor,
    weights: list[torch.Tensor],
    need_hidden_grad: bool = True,
    need_weight_grad: bool = True,
    need_bias_grad: bool = False,
) -> tuple[torch.Tensor | None, list[torch.Tensor | None], list[torch.Tensor | None]]:
    """(grad_hidden [M, K], [grad_W_i [N_i, K]], [grad_b_i [N_i]]), None where not requested.

    Args:
        grads: the projection outputs' gradients, [M, N_i] each (any strides: column slices of
            one [M, sum N_i] buffer are fine).
        hidden: [M, K] the projections' input.
        weights: [N_i, K] each, one per grad.

    Raises ``ValueError`` naming the first argument that does not fit.
    """
    if len(grads) != len(weights) or not grads:
        raise ValueError(f"projection_gemms: grads and weights: one weight per grad, at least one; "
                         f"got {len(grads)} and {len(weights)}")
    if hidden.dim() != 2:
        raise ValueError(f"projection_gemms: hidden: expected a 2-D [M, K] tensor, got shape {tuple(hidden.shape)}")
    M, K = hidden.shape
    for i, (g, w) in enumerate(zip(grads, weights)):
        if g.dim() != 2 or g.shape[0] != M:
            raise ValueError(f"projection_gemms: grads[{i}]: expected [M = {M}, N], got shape {tuple(g.shape)}")
        if w.dim() != 2 or tuple(w.shape) != (g.shape[1], K):
            raise ValueError(f"projection_gemms: weights[{i}]: expected [N = {g.shape[1]}, K = {K}], "
                             f"got shape {tuple(w.shape)}")
    grad_hidden = None
    if need_hidden_grad:
        grad_hidden = torch.mm(grads[0], weights[0])
        for g, w in zip(grads[1:], weights[1:]):
            grad_hidden = torch.addmm(grad_hidden, g, w)
    grad_weights = [torch.mm(g.t(), hidden) if need_weight_grad else None for g in grads]
    grad_biases = [g.sum(0) if need_bias_grad else None for g in grads]
    return grad_hidden, grad_weights, grad_biases
