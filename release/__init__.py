"""The maintainers' release tooling: the pretrained models lm-zoo ships under ``pretrained/`` -- built from a finished
run, measured, carded, published -- run from a clone as ``python -m release build|publish|table|card``.

It sits beside ``benchmarks/``, outside the installed packages: a user's ``pip install lm-zoo`` gets what loads,
scores and trains models, not the git calls, README writer and learning-curve drawing of a maintainer's release.
"""
