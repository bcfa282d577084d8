"""Scoring a trained network, outside the training loop: the numbers ``lm-zoo evaluate``, ``parse`` and ``syneval``
report.

- :mod:`~lightning_modules.evaluation.perplexity`: perplexity / bits per character of a split, by a procedure
  (deterministic, softmax temperature, MC dropout, dynamic evaluation; Melis et al. 2020 §3.3);
  :mod:`~lightning_modules.evaluation.temperature`, :mod:`~lightning_modules.evaluation.mc_dropout` and
  :mod:`~lightning_modules.evaluation.dynamic` are those procedures;
- :mod:`~lightning_modules.evaluation.music`: a piano-roll model's NLL per frame;
- :mod:`~lightning_modules.evaluation.parsing`: unsupervised constituency parsing with an ON-LSTM (Shen et al. 2019);
- :mod:`~lightning_modules.evaluation.syneval`: targeted syntactic evaluation (Marvin & Linzen 2018); both read
  single sentences in padded batches (:mod:`~lightning_modules.evaluation.sentences`).

They take a plain network (:class:`zoo.RecurrentLM`) and a data module, never a Trainer: the loops are written out so
that a result carries exact counts and every setting it depends on.
"""
