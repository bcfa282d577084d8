"""The reverse-copy task of Melis, Kočiský & Blunsom 2020 ("Mogrifier LSTM", §4.3 and Figure 4).

An example is a sequence of tokens drawn i.i.d. and uniformly from a vocabulary, a marker, then the same tokens in
reverse order. The network reads the whole example left to right and is scored only on the reversed part: the
cross-entropy of each reversed token given everything before it::

    example (length 4)   7  2  9  4  <mark>  4  9  2  7
    inputs               7  2  9  4  <mark>  4  9  2  7
    targets              -  -  -  -    4     9  2  7  -        (- = not scored)

The paper uses a separate encoder and decoder, the decoder starting from the encoder's last state; here one
recurrent language model reads both halves (lm-zoo's stacks, heads and training loop as for any corpus), its state
reset at every example's start, so the marker step starts the decoding from the state that read the source, as the
paper's decoder starts from the encoder's. Examples are independent sentences in multi-sequence batches
(:class:`~datamodules.multisequence.MultiSequenceWindows`) with the source steps left unscored.

The paper: 500,000 training and 10,000 validation and test examples over 1,000 symbols, lengths 50 to 200. The
splits are generated in memory from ``seed`` (numpy, a few seconds for the paper's sizes), never cached on disk.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from datamodules.corpora import SPLITS
from datamodules.data_modules import StreamDataModule
from datamodules.multisequence import MultiSequenceWindows
from datamodules.stream_data import check_sizes
from datamodules.tokenizers import EOS, UNK, TextUnits, Tokenizer, WordTokenizer
from zoo.errors import DataError

MARKER = "<mark>"
SPLIT_SEEDS = {"train": 0, "valid": 1, "test": 2}  # each split from its own stream of the task's seed


@dataclass(frozen=True)
class ReverseCopySplit:
    """One split's examples, end to end.

    Attributes:
        ids: ``(T_total,)`` int32 ids of every example (padding, source, marker, reversed source).
        offsets: ``(N + 1,)`` int64; example ``i`` is ``ids[offsets[i]:offsets[i+1]]``.
        unscored: ``(N,)`` ids before each example's marker (its padding and source), whose steps predict nothing.
        units: scored tokens (every reversed token) as tokens and words; no characters.
    """

    ids: np.ndarray
    offsets: np.ndarray
    unscored: np.ndarray
    units: TextUnits


def reverse_copy_tokenizer(num_symbols: int) -> WordTokenizer:
    """Symbols ``"0"`` .. ``str(num_symbols - 1)``, the marker, and the specials every word vocabulary has (``<eos>``
    pads a column after its last example; ``<unk>`` never occurs)."""
    symbols = [EOS, UNK, MARKER] + [str(i) for i in range(num_symbols)]
    return WordTokenizer(symbols, [0] * len(symbols))


def reverse_copy_examples(
    rng: np.random.Generator,
    num_examples: int,
    num_symbols: int,
    min_length: int,
    max_length: int,
    first_id: int,
    reverse: bool = True,
) -> ReverseCopySplit:
    """Draw ``num_examples`` examples: a length ``n`` uniform in ``[min_length, max_length]``, ``n`` symbols uniform
    over ``num_symbols`` (ids from ``first_id``), the marker (id ``first_id - 1``), the symbols reversed (or, with
    ``reverse=False``, repeated in their order: the memorisation task of Jozefowicz et al. 2015 §3.1).

    Every example is ``2 * max_length + 1`` ids long: a shorter one starts with ``2 * (max_length - n)`` padding ids
    (``<eos>``, id 0, unscored like the source). Windows of that length then hold exactly one example per column, so
    truncated backpropagation reaches from every reversed token back to its source token, whatever the lengths.
    """
    width = 2 * max_length + 1
    lengths = rng.integers(min_length, max_length + 1, size=num_examples)  # (N,) source lengths
    sources = rng.integers(first_id, first_id + num_symbols, size=int(lengths.sum()), dtype=np.int32)
    ids = np.zeros(num_examples * width, dtype=np.int32)  # <eos> padding where nothing else goes
    # Where source token k of example i lands, and its copy after the marker, without a loop over examples: with s_i
    # the first source position (after the padding), s_i + k and s_i + 2 n_i - k (reversed) or s_i + n_i + 1 + k.
    padding = 2 * (max_length - lengths)  # (N,)
    first_source = np.arange(num_examples) * width + padding  # (N,)
    within = np.arange(len(sources)) - np.repeat(np.cumsum(lengths) - lengths, lengths)  # (sum n,) k
    starts = np.repeat(first_source, lengths)
    ids[starts + within] = sources
    answer = 2 * np.repeat(lengths, lengths) - within if reverse else np.repeat(lengths, lengths) + 1 + within
    ids[starts + answer] = sources
    ids[first_source + lengths] = first_id - 1
    scored = int(lengths.sum())
    return ReverseCopySplit(
        ids,
        np.arange(num_examples + 1, dtype=np.int64) * width,
        unscored=padding + lengths,  # the padding and the source: everything before the marker
        units=TextUnits(tokens=scored, chars=0, words=scored),
    )


class ReverseCopyDataModule(StreamDataModule):
    """The reverse-copy task as a corpus: generated examples in multi-sequence batches, only reversed tokens scored.

    Args:
        num_symbols: the vocabulary examples draw from (the paper: 1,000); the model's vocabulary adds the marker,
            ``<eos>`` and ``<unk>``.
        min_length: shortest source (tokens before the marker).
        max_length: longest source; each example's length is uniform in ``[min_length, max_length]`` (one value for
            the paper's Figure 4, one model per length). Shorter examples are padded in front to this length.
        train_examples: training examples (the paper: 500,000). A new order every epoch.
        eval_examples: validation and test examples each (the paper: 10,000).
        batch_size: training columns.
        bptt: training window length; ``None``: one example's, ``2 * max_length + 1``, so that every window holds
            one whole example per column and the gradient reaches back from each answer token to the source. A
            shorter window cuts it (the state is still carried).
        eval_batch_size: validation/test columns.
        eval_bptt: validation/test window length; ``None`` uses ``bptt``.
        seed: generates the three splits (each from its own stream) and orders the training epochs.
        reverse: ``False`` asks for the source in its own order instead: Jozefowicz et al. 2015's memorisation task
            (§3.1: 5 symbols of 26, read, then reproduced), the first filter of their architecture search.
        windows_per_step: consecutive training windows a step trains on, one update each (as
            :class:`~datamodules.text_data.TextData`'s).
    """

    level = "word"

    def __init__(
        self,
        num_symbols: int = 1000,
        min_length: int = 50,
        max_length: int = 50,
        train_examples: int = 500_000,
        eval_examples: int = 10_000,
        batch_size: int = 64,
        bptt: int | None = None,
        eval_batch_size: int = 64,
        eval_bptt: int | None = None,
        seed: int = 0,
        reverse: bool = True,
        windows_per_step: int = 1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        check_sizes(batch_size=batch_size, bptt=bptt, eval_batch_size=eval_batch_size, eval_bptt=eval_bptt)
        if num_symbols < 2:
            raise DataError(f"num_symbols must be at least 2, got {num_symbols}")
        if not 1 <= min_length <= max_length:
            raise DataError(f"the lengths need 1 <= min_length <= max_length, got {min_length} and {max_length}")
        if train_examples < 1 or eval_examples < 1:
            raise DataError(f"every split needs an example, got {train_examples} and {eval_examples}")
        self.num_symbols = num_symbols
        self.min_length, self.max_length = min_length, max_length
        self.examples = {"train": train_examples, "valid": eval_examples, "test": eval_examples}
        self.batch_size, self.bptt = batch_size, bptt or 2 * max_length + 1
        self.eval_batch_size, self.eval_bptt = eval_batch_size, eval_bptt or self.bptt
        self.seed = seed
        self.reverse = reverse
        self.windows_per_step = windows_per_step
        self.corpus_name = "synthetic-reverse-copy" if reverse else "synthetic-copy"
        self.tokenizer: Tokenizer = reverse_copy_tokenizer(num_symbols)
        self._splits: dict[str, ReverseCopySplit] = {}

    @property
    def vocab_size(self) -> int:
        """Number of ids (linked to the model's ``vocab_size`` by the CLI)."""
        return self.tokenizer.vocab_size

    def encoded(self, split: str) -> ReverseCopySplit:
        """``split``'s examples (generated on first use)."""
        if split not in SPLITS:
            raise DataError(f"unknown split {split!r}: use train, valid or test")
        if split not in self._splits:
            rng = np.random.default_rng([self.seed, SPLIT_SEEDS[split]])
            first_symbol = self.tokenizer.index["0"]  # type: ignore[attr-defined]
            self._splits[split] = reverse_copy_examples(
                rng,
                self.examples[split],
                self.num_symbols,
                self.min_length,
                self.max_length,
                first_symbol,
                self.reverse,
            )
        return self._splits[split]

    def units(self, split: str) -> TextUnits:
        """Scored tokens of ``split`` (the reversed halves)."""
        return self.encoded(split).units

    def use_tokenizer(self, tokenizer: Tokenizer) -> None:
        """The task's symbols are its settings' (``num_symbols``): a checkpoint's or a model's tokenizer must be the
        same, and is refused otherwise."""
        if tokenizer.state_dict() != self.tokenizer.state_dict():
            raise DataError(
                f"the checkpoint's vocabulary has {tokenizer.vocab_size} ids, this task's {self.vocab_size}: "
                "set data.num_symbols to the checkpoint's"
            )

    def stream(self, split: str, batch_size: int | None = None, bptt: int | None = None) -> MultiSequenceWindows:
        """The windows of ``split`` for this rank: a new example order every training epoch, fixed otherwise."""
        examples = self.encoded(split)
        return MultiSequenceWindows(
            examples.ids,
            examples.offsets,
            pad_id=self.tokenizer.eos_id,
            unscored_prefix=examples.unscored,
            **self._window_settings(split, batch_size, bptt),
        )
