"""A real 2-process DDP run (CPU, gloo) on the GBW sample trains like the single-process run with the same global batch.

``lm-zoo fit`` runs as a subprocess, so that Lightning's DDP can re-launch the command for rank 1. Both runs see the
same global batch of 8 columns (DDP: 2 ranks x 4, each rank its own disjoint sentences; single: 8), the same sentence
orders and the same initial weights; the gradients differ only because DDP averages the two ranks' per-token means
where the single process takes one mean over all tokens (the ranks predict slightly different numbers of tokens), and
in float summation order. Skipped only when LM_ZOO_DATA is unset and the sample is absent.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import needs_data
from tests.gbw_runs import TOLERANCE, fit, validation_ppl

pytestmark = needs_data("gbw-sample")


@pytest.mark.slow  # ~50 s + ~80 s on the loaded 2-core machine (three Python processes start); CI runs slow tests
def test_two_process_ddp_matches_the_single_process_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "cache"))
    single = validation_ppl(fit(tmp_path, "single", devices=1, seed=1))
    ddp = validation_ppl(fit(tmp_path, "ddp", devices=2, seed=1))
    assert single < 0.5 * 9607, "40 steps already beat the uniform distribution over the vocabulary by far"
    assert abs(ddp - single) / single < TOLERANCE, (ddp, single)
