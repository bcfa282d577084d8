"""Training with row-sparse gradients for the vocabulary-sized matrices (``LanguageModel(sparse_gradients=True)``).

At Google Billion Word's V = 793,471 a step touches a few thousand rows of the input embedding and of an NCE output
layer, yet a dense gradient is ``(V, D)``: 6.5 GB at D = 2048, allocated, zero-filled, clipped and applied at every
step. dpnn's ``LookupTable`` and ``NCEModule`` (Léonard 2016, ``../shared/papers/004``) update only the touched rows;
PyTorch does the same with sparse COO gradients (``nn.Embedding(sparse=True)``, ``F.embedding(..., sparse=True)``).
Two parts of a training step do not take them, and are handled here:

* **Gradient-norm clipping.** ``torch.nn.utils.clip_grad_norm_`` (what Lightning's ``gradient_clip_val`` calls) has no
  sparse kernel for its norm. :func:`clip_grad_norm` computes the same total norm with the sparse gradients coalesced
  first: an uncoalesced gradient holds one entry per lookup, so a word seen twice appears as two rows whose squared
  norms would be added instead of the squared norm of their sum.
* **Optimizers.** Only some accept sparse gradients, and some of those would silently turn dense or grow:
  :func:`check_optimizer` lets through SGD without momentum or weight decay (the 4 x 2048 GBW recipe's ``--momentum
  -1``) and Adagrad without weight decay. SGD's momentum buffer would be a sparse tensor that gains the rows of every
  step without ever being coalesced (memory without bound, measured); Adam refuses sparse gradients outright.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from zoo.errors import ConfigError

#: What to do instead, appended to every refusal.
REMEDY = "use SGD without momentum or weight decay, or Adagrad, or set model.init_args.sparse_gradients false"


def clip_grad_norm(parameters: Iterable[Tensor], max_norm: float) -> Tensor:
    """Scale the gradients in place so that their joint 2-norm is at most ``max_norm``; dense and sparse alike.

    The same rule as ``torch.nn.utils.clip_grad_norm_`` (scale by ``max_norm / (norm + 1e-6)`` when that is below 1),
    which has no sparse norm kernel. Sparse gradients are replaced by their coalesced form, which the optimizer
    then applies with one row update per touched word instead of one per lookup.

    Args:
        parameters: the parameters whose ``.grad`` to clip; those without one are skipped.
        max_norm: the largest allowed norm.

    Returns:
        The total norm before clipping (a scalar tensor), as ``clip_grad_norm_`` returns it.
    """
    dense: list[Tensor] = []
    sparse: list[Tensor] = []
    for parameter in parameters:
        if parameter.grad is None:
            continue
        if parameter.grad.is_sparse:
            parameter.grad = parameter.grad.coalesce()
            sparse.append(parameter.grad)
        else:
            dense.append(parameter.grad)
    if not dense and not sparse:
        return torch.zeros(())
    # As torch does: the norm of the per-tensor norms, in the gradients' own precision.
    norms = [torch.nn.utils.get_total_norm(dense)] if dense else []
    norms += [torch.linalg.vector_norm(g.values()) for g in sparse]  # coalesced: one row per word
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0]) for n in norms]))
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for grad in dense:
        grad.mul_(scale.to(grad.device, grad.dtype))
    for grad in sparse:
        grad.values().mul_(scale.to(grad.device, grad.dtype))
    return total


def has_sparse_gradients(parameters: Iterable[Tensor]) -> bool:
    """Whether any of the parameters holds a sparse gradient now."""
    return any(p.grad is not None and p.grad.is_sparse for p in parameters)


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Refuse, in one line, an optimizer that cannot apply row-sparse gradients as they are meant.

    Args:
        optimizer: the optimizer a run with sparse gradients would use.

    Raises:
        ConfigError: for anything but SGD without momentum and weight decay or Adagrad without weight decay.
    """
    name = type(optimizer).__name__
    groups = optimizer.param_groups
    if isinstance(optimizer, torch.optim.SGD):
        if any(group.get("momentum", 0) or group.get("weight_decay", 0) for group in groups):
            raise ConfigError(
                "sparse_gradients with SGD momentum or weight decay: a momentum buffer of sparse gradients grows "
                f"without bound and weight decay needs the dense weights; {REMEDY}"
            )
        return
    if isinstance(optimizer, torch.optim.Adagrad):
        if any(group.get("weight_decay", 0) for group in groups):
            raise ConfigError(
                f"sparse_gradients with Adagrad weight decay: Adagrad refuses it on sparse gradients; {REMEDY}"
            )
        return
    raise ConfigError(f"sparse_gradients with {name}: it does not apply row-sparse gradients; {REMEDY}")
