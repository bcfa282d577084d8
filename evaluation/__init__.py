"""Scoring a trained network, outside the training loop: the numbers ``lm-zoo evaluate``, ``parse`` and ``syneval``
report.

- :mod:`~evaluation.perplexity`: perplexity / bits per character of a split, by a procedure
  (deterministic, softmax temperature, MC dropout, dynamic evaluation; Melis et al. 2020 §3.3);
  :mod:`~evaluation.deterministic`, :mod:`~evaluation.temperature`, :mod:`~evaluation.mc_dropout` and
  :mod:`~evaluation.dynamic` are those procedures;
- :mod:`~evaluation.music`: a piano-roll model's NLL per frame;
- :mod:`~evaluation.parsing`: unsupervised constituency parsing with an ON-LSTM (Shen et al. 2019);
- :mod:`~evaluation.syneval`: targeted syntactic evaluation (Marvin & Linzen 2018); both read
  single sentences in padded batches (:mod:`~evaluation.sentences`).

They take a plain network (:class:`zoo.RecurrentLM`) and a data module, never a Trainer: the loops are written out so
that a result carries exact counts and every setting it depends on.
"""
