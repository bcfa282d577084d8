"""Jozefowicz et al. 2015's architecture search: the tasks a candidate cell is trained and scored on
(:mod:`~lightning_modules.search.tasks`, a plain training loop) and the evolutionary procedure over a shared Optuna
store (:mod:`~lightning_modules.search.evolution`). ``lm-zoo search`` (:mod:`commands.search`) runs it."""
