"""int8 inference on a CPU: PyTorch's dynamic quantization of a trained network's LSTM/GRU layers and output layers.

``torch.ao.quantization.quantize_dynamic`` stores the weights of ``nn.LSTM``, ``nn.GRU`` and ``nn.Linear`` as int8
(one scale per tensor) and quantizes each activation on the fly, so the products run through fbgemm/oneDNN's int8
kernels; nothing needs calibrating. lm-zoo applies it module by module rather than to the whole network at once,
because two of its modules are not plain ``nn.Linear``s: the full-softmax head scores targets through slices of its
weight (:func:`zoo.heads.chunked_nll`), which an int8 layer does not have, so it is replaced by
:class:`Int8SoftmaxHead`; and a fused layer falls back to a per-step loop over its float weights for windows the
fused kernel cannot run, which an int8 layer cannot do, so :class:`~zoo.layers.FusedLayer` runs such windows as packed
segments instead (see ``FusedLayer.int8``).

Only what the library quantizes is quantized: the fused ``lstm`` and ``gru`` layers, the optional projection, and the
softmax or adaptive head. The embedding stays float (a lookup has no product to speed up), and so does everything
else.

Two modes (``MODES``): ``int8`` quantizes all of that, and refuses other cells in one line rather than half-quantize
them; ``int8-head`` the output side alone (projection and head), the recurrent layers left float, which also serves
the cells PyTorch has no int8 kernel for. Why the second: PyTorch's int8 LSTM quantizes its input and state at every
time step, which costs more than it saves where a layer's weights are small enough to stay in cache: ptb-lstm-small
(2 x 200) scored its test split faster with the head alone than with the whole network in int8, the 650-unit models
the other way round (``benchmarks/quantize.py`` measures both modes side by side). The MoS head is refused by both.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import Tensor, nn
from torch.ao.quantization import quantize_dynamic

from zoo.errors import ConfigError
from zoo.gru import GRULayer
from zoo.heads import AdaptiveSoftmaxHead, SoftmaxHead, scores_nll
from zoo.language_model import RecurrentLM
from zoo.lstm import LSTMLayer

QUANTIZABLE_LAYERS = (LSTMLayer, GRULayer)  # nn.LSTM / nn.GRU inside: the recurrent modules quantize_dynamic maps
MODES = ("int8", "int8-head")  # --quantize: the whole network, or the output side alone


class Int8SoftmaxHead(nn.Module):
    """The full softmax with an int8 output layer: logits ``W h + b`` from a dynamically quantized ``nn.Linear``.

    Scores targets a few rows at a time, as :class:`~zoo.heads.SoftmaxHead` does, so that no more than
    ``chunk_logits`` logits exist at once.

    Args:
        head: the float head whose weights it quantizes.
    """

    def __init__(self, head: SoftmaxHead) -> None:
        super().__init__()
        float_layer = nn.Linear(head.in_features, head.out_features)
        float_layer.load_state_dict({"weight": head.weight.detach().float(), "bias": head.bias.detach().float()})
        holder = nn.Sequential(float_layer)  # quantize_dynamic swaps children, never the module it is given
        self.output = quantize_dynamic(holder, {nn.Linear}, dtype=torch.qint8)[0]
        self.vocab_size = head.out_features
        self.chunk_logits = head.chunk_logits

    def forward(self, h: Tensor) -> Tensor:
        """Logits ``(B, T, V)`` float32 for ``h (B, T, D)``."""
        return self.output(h.float())

    def token_nll(self, h: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
        """Negative log-likelihood of each target ``(B, T)`` float32 nats, 0 where the target is -100."""
        flat_h, flat_t = h.reshape(-1, h.size(-1)).float(), targets.reshape(-1)  # (N, D), (N,)
        rows = max(1, self.chunk_logits // self.vocab_size)
        # scores_nll is the fused cross-entropy the float heads use: one pass over the logits, where a logsumexp and
        # a gather of our own took twice the cross-entropy's time (benchmarks/quantize.py, profiled on ptb-lstm-small).
        pieces = [
            scores_nll(
                self.output(flat_h[r0 : r0 + rows]).unsqueeze(0), flat_t[r0 : r0 + rows].unsqueeze(0), temperature
            )
            for r0 in range(0, flat_h.size(0), rows)
        ]  # each (1, R)
        return torch.cat(pieces, dim=1).view(targets.shape)


def quantize_int8(model: nn.Module, recurrent: bool = True) -> RecurrentLM:
    """A copy of ``model`` for int8 inference on the CPU (``lm-zoo evaluate|generate|score --quantize int8`` or, with
    ``recurrent=False``, ``--quantize int8-head``).

    Args:
        model: a trained :class:`~zoo.language_model.RecurrentLM` with a ``softmax`` (or ``nce`` /
            ``sampled_softmax``, scored as one) or ``adaptive`` head, and with ``recurrent``, fused ``lstm`` or
            ``gru`` layers.
        recurrent: quantize the recurrent layers too; ``False`` leaves them float, for any architecture.

    Returns:
        The quantized copy, in eval mode (``model`` is left as it was). It runs on the CPU only and cannot be trained.

    Raises:
        ConfigError: the model has a part dynamic quantization does not apply to.
    """
    mode = MODES[0] if recurrent else MODES[1]
    if not isinstance(model, RecurrentLM):
        raise ConfigError(f"--quantize {mode} applies to text models (zoo.RecurrentLM), not {type(model).__name__}")
    # Exactly these classes, fused: a subclass (the Mogrifier's layer is an LSTM layer) or a per-step cell (the capped
    # input gate) computes something nn.LSTM does not.
    unsupported = sorted(
        {type(layer).__name__ for layer in model.rnn.layers if type(layer) not in QUANTIZABLE_LAYERS or not layer.fused}
    )
    if recurrent and unsupported:
        raise ConfigError(
            f"--quantize int8 applies to the fused lstm and gru layers (PyTorch quantizes nn.LSTM and nn.GRU); this "
            f"model has {', '.join(unsupported)}: use --quantize int8-head (the output layer alone) or no --quantize"
        )
    if not isinstance(model.decoder, SoftmaxHead | AdaptiveSoftmaxHead):
        raise ConfigError(
            f"--quantize {mode} applies to the softmax and adaptive heads; this model's is "
            f"{type(model.decoder).__name__}: evaluate it without --quantize"
        )
    quantized = copy.deepcopy(model).float().eval()
    with warnings.catch_warnings():
        # torch.ao's eager quantization warns that it is deprecated in favour of torchao, a package lm-zoo does not
        # require; it is still the library's dynamic quantization, and the tests hold it to the float model.
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        _quantize_modules(quantized, recurrent)
    return quantized


def _quantize_modules(quantized: RecurrentLM, recurrent: bool) -> None:
    """Swap ``quantized``'s projection and head, and with ``recurrent`` its LSTM/GRU layers, for their int8
    versions, in place."""
    for layer in quantized.rnn.layers if recurrent else ():
        quantize_dynamic(layer, {nn.LSTM, nn.GRU}, dtype=torch.qint8, inplace=True)  # layer.rnn becomes int8
        layer.int8 = True
    if quantized.projection is not None:
        quantized.projection = quantize_dynamic(nn.Sequential(quantized.projection), {nn.Linear}, dtype=torch.qint8)[0]
    if isinstance(quantized.decoder, SoftmaxHead):
        quantized.decoder = Int8SoftmaxHead(quantized.decoder)
    else:
        quantize_dynamic(quantized.decoder.adaptive, {nn.Linear}, dtype=torch.qint8, inplace=True)
