"""Jozefowicz et al. 2015's architecture search: the tasks a candidate cell is trained and scored on
(:mod:`~search.tasks`, a plain training loop) and the evolutionary procedure over a shared Optuna
store (:mod:`~search.evolution`). ``lm-zoo search`` (:mod:`commands.search`) runs it."""
