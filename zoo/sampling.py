"""Sampling without the host: the next token drawn on the model's device, and on CUDA one token's step as a graph.

Why: at batch 1 a token's step of a recurrent LM is a handful of small kernels (embedding, one or two per layer, the
softmax's product), microseconds each. :meth:`zoo.RecurrentLM.generate`'s plain path launches them one at a time from
Python and draws each token with ``torch.multinomial`` on the host, so on a GPU every token also waits for a copy of
the probabilities to the host: the GPU idles while the host launches and waits. Here the draw stays on the device,
and on CUDA the whole token step (the network's step, the scores, the draw, the copies into the next step's inputs,
the write of the sampled id into the output) is captured once as a CUDA graph and replayed once per token: one launch
a token, and the host reads the ids once at the end. A ``stop_id`` is checked on the host every
:data:`STOP_CHECK_EVERY` tokens (one wait per check), not every token.

The draw is the exponential race (gpt-fast's ``multinomial_sample_one_no_sync``): with ``E_i ~ Exp(1)`` independent,
``argmax_i p_i / E_i`` is ``i`` with probability ``p_i`` (``E_i / p_i`` is exponential with rate ``p_i``, and the
smallest of independent exponentials is the one of rate ``p_i`` with probability ``p_i / sum p``); a token masked out
by top-k has ``p_i = 0`` and never wins. It draws from the same distribution as the plain path's multinomial, but not
the same ids for a seed: a seed gives the same samples on the plain path on any device, and on this path on a given
GPU. ``tests/test_sampling.py`` holds this path equal to the plain one where both are deterministic (top-k 1), and
its draws to the distribution; the GPU suite holds the captured step equal to the same step run eagerly.

CUDA graphs are on where the training windows' are (:mod:`zoo.settings`: ``LM_ZOO_WINDOW_GRAPHS=0`` or
``LM_ZOO_KERNELS=plain`` turn both off, and then ``generate`` runs its plain path); a step that cannot be captured
warns once and runs this path eagerly.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from zoo import settings
from zoo.state import State

#: Tokens between two checks, on the host, of whether every row has sampled its ``stop_id``.
STOP_CHECK_EVERY = 32
#: Eager runs of the step before its capture, on a side stream (cuDNN and cuBLAS set up their workspaces there).
WARMUP_STEPS = 2

Step = Callable[[Tensor, State], tuple[Tensor, State]]


def next_token_scores(logits: Tensor, temperature: float, top_k: int | None) -> Tensor:
    """``(B, V)`` scores to sample the next token from: the logits divided by ``temperature``, with every token below
    the ``top_k`` most likely at ``-inf``. The plain path and this one both sample from ``softmax`` of these."""
    scores = logits if temperature == 1.0 else logits.float() / temperature
    if top_k is not None and top_k < scores.size(-1):
        kth = torch.topk(scores, top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    return scores


def draw(scores: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One token id per row, ``(B, 1)``, drawn from ``softmax(scores)`` on the scores' device with no host
    synchronisation (the exponential race: see the module doc)."""
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    race = torch.empty_like(probs).exponential_(generator=generator)
    return torch.argmax(probs / race, dim=-1, keepdim=True)


def cut_at_stop(rows: list[list[int]], stop_id: int | None) -> list[list[int]]:
    """Each row up to and including its first ``stop_id`` (rows go on sampling until every row has stopped)."""
    if stop_id is None:
        return rows
    return [row[: row.index(stop_id) + 1] if stop_id in row else row for row in rows]


def device_generator(device: torch.device, generator: torch.Generator | None) -> tuple[torch.Generator, int]:
    """A generator on ``device`` and its seed, drawn from ``generator`` (a seeded CPU generator: the same samples for
    the same seed) or, without one, from torch's global generator (which ``torch.manual_seed`` seeds)."""
    on = generator.device if generator is not None else "cpu"
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=on))
    return torch.Generator(device).manual_seed(seed), seed


def captures(device: torch.device) -> bool:
    """Whether ``generate`` on ``device`` samples through this module's captured step: CUDA with graphs on."""
    return device.type == "cuda" and settings.current().window_graphs and not settings.current().plain_kernels


class _TokenLoop:
    """The static buffers of a sampling run and the step that advances them by one token (the body a graph captures).

    Attributes:
        token: ``(B, 1)`` the last sampled id, the next step's input.
        state: the network's state after it, each tensor updated in place.
        out: ``(B, N)`` the sampled ids; the step writes its token at ``position``.
        position: ``()`` where the last token went (kept modulo ``N``: the warm-up steps write too, and are rewound).
        done: ``(B,)`` rows that have sampled ``stop_id``.
    """

    def __init__(
        self,
        step: Step,
        logits: Tensor,
        state: State,
        max_new_tokens: int,
        temperature: float,
        top_k: int | None,
        stop_id: int | None,
        generator: torch.Generator,
    ) -> None:
        batch, device = logits.size(0), logits.device
        self.step, self.temperature, self.top_k, self.stop_id, self.generator = (
            step, temperature, top_k, stop_id, generator
        )  # fmt: skip
        self.start_state = tuple(s.clone() for s in state)
        self.state = tuple(s.clone() for s in state)
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.out = torch.zeros(batch, max_new_tokens, dtype=torch.long, device=device)
        self.position = torch.zeros((), dtype=torch.long, device=device)
        self.done = torch.zeros(batch, dtype=torch.bool, device=device)

    def start(self, logits: Tensor) -> None:
        """Sample the first token from the prompt's last scores ``(B, V)`` and put every buffer at its start."""
        first = draw(next_token_scores(logits, self.temperature, self.top_k), self.generator)
        self.token.copy_(first)
        for buffer, value in zip(self.state, self.start_state, strict=True):
            buffer.copy_(value)
        self.position.zero_()
        self.out[:, :1].copy_(first)
        self.done.zero_()
        if self.stop_id is not None:
            self.done.logical_or_(first[:, 0] == self.stop_id)

    def advance(self) -> None:
        """One token: the network's step from the last token, the draw, and the writes into the buffers."""
        logits, state = self.step(self.token, self.state)
        token = draw(next_token_scores(logits, self.temperature, self.top_k), self.generator)  # (B, 1)
        self.token.copy_(token)
        for buffer, value in zip(self.state, state, strict=True):
            buffer.copy_(value)
        self.position.add_(1).remainder_(self.out.size(1))
        self.out.scatter_(1, self.position.expand(token.size(0), 1), token)
        if self.stop_id is not None:
            self.done.logical_or_(token[:, 0] == self.stop_id)


def _captured(loop: _TokenLoop) -> Callable[[], None] | None:
    """``loop.advance`` captured as a CUDA graph, its replay returned; ``None`` (after one warning) where capture
    fails. The warm-up and the capture leave the buffers anywhere: :meth:`_TokenLoop.start` comes after."""
    graph = torch.cuda.CUDAGraph()
    try:
        # The draws come from the loop's own generator, which a graph must know to advance it at each replay.
        graph.register_generator_state(loop.generator)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                loop.advance()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            loop.advance()
    except Exception as error:  # noqa: BLE001 - whatever capture refuses, the eager step samples the same way
        warnings.warn(
            f"lm-zoo: the sampling step could not be captured as a CUDA graph ({type(error).__name__}: {error}); it "
            "runs eagerly",
            stacklevel=3,
        )
        return None
    return graph.replay


def sample(
    step: Step,
    logits: Tensor,
    state: State,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    stop_id: int | None = None,
    generator: torch.Generator | None = None,
    capture: bool = True,
) -> list[list[int]]:
    """Sample ``max_new_tokens`` ids per row on the logits' device, the host reading them once at the end.

    Args:
        step: one token's step, ``(B, 1)`` ids and the state -> ``(B, V)`` next scores and the new state.
        logits: ``(B, V)`` the scores after the prompt.
        state: the state after the prompt.
        max_new_tokens: most tokens sampled per row (>= 1).
        temperature: divides the logits.
        top_k: sample only among the k most likely tokens.
        stop_id: a row stops after sampling this id (kept).
        generator: seeds the draws (a CPU generator, as the plain path takes; see :func:`device_generator`).
        capture: replay the step as a CUDA graph (on CUDA only).

    Returns:
        The sampled ids of each row.
    """
    if max_new_tokens < 1:
        return [[] for _ in range(logits.size(0))]
    device_rng, seed = device_generator(logits.device, generator)
    loop = _TokenLoop(step, logits, state, max_new_tokens, temperature, top_k, stop_id, device_rng)
    advance = (_captured(loop) if capture and logits.device.type == "cuda" else None) or loop.advance
    # The warm-up drew from the generator: seed it again, so that the captured and the eager step sample alike (a
    # replay reads the generator's seed and offset as they are then).
    device_rng.manual_seed(seed)
    loop.start(logits)
    produced = 1
    while produced < max_new_tokens:
        if stop_id is not None and produced % STOP_CHECK_EVERY == 0 and bool(loop.done.all()):
            break
        advance()
        produced += 1
    return cut_at_stop(loop.out[:, :produced].tolist(), stop_id)
