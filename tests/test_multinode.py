"""Two nodes on loopback: two ``torchrun`` launchers, as two machines would run them, train ``lm-zoo fit`` together
through a c10d rendezvous on 127.0.0.1, and end bit for bit where two processes on one node end.

What makes the two runs comparable: every rank reads the columns of its *global* rank (datamodules/windows.py), draws
dropout masks seeded by its global rank and keeps its training state under it in the checkpoint, so where a rank
runs (which node, which local rank) must not change anything. The two-node run is the one that would catch a rank vs
local-rank mix-up: there both processes are local rank 0. The tiny recipe is tests/test_ddp.py's (dropout, NCE
noise, variable BPTT, carried state, Adam), re-pointed at one device per node.

Each launcher gets its own tokenised-corpus cache, as separate machines would; the checkpoint directory is shared
(only global rank 0 writes it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment, TorchElasticEnvironment

import cli
from commands.common import user_error
from lightning_modules.resume import RESUME_KEY
from tests.conftest import ROOT, free_port
from tests.ddp_runs import MAX_STEPS, ddp_recipe, read_checkpoint
from zoo.errors import ConfigError

TIMEOUT = 120  # seconds per run: a launcher left waiting at the rendezvous fails the test instead of blocking it
FIT_ON_ONE_DEVICE_PER_NODE = ["--trainer.devices", "1", "--trainer.strategy", "ddp", "--trainer.accelerator", "cpu"]


class RecordPlacement(L.Callback):
    """Test helper: write where this rank runs (cluster environment, node, local and global rank) and the inputs of
    its first training window to ``<directory>/rank_<global rank>.json``."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step != 0:
            return
        placement = {
            "environment": type(trainer.strategy.cluster_environment).__name__,
            "node_rank": trainer.node_rank,
            "local_rank": trainer.local_rank,
            "global_rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "first_inputs": batch.inputs.tolist(),  # (B, T): the columns this rank reads
        }
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / f"rank_{trainer.global_rank}.json").write_text(json.dumps(placement))


def _record_placement(directory: Path) -> str:
    return f"    - class_path: tests.test_multinode.RecordPlacement\n      init_args: {{directory: {directory}}}\n"


def _wait(processes: list[subprocess.Popen[bytes]], logs: list[Path]) -> None:
    """Wait for every launcher; past :data:`TIMEOUT`, stop them (SIGTERM: torchrun stops its workers, which run in
    sessions of their own) and fail with the end of each log."""
    try:
        for process in processes:
            process.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        for process in processes:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=40)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        pytest.fail(f"a launcher still ran after {TIMEOUT} s:\n" + "\n".join(log.read_text()[-2000:] for log in logs))
    for process, log in zip(processes, logs):
        assert process.returncode == 0, log.read_text()[-3000:]


def _placements(run: Path) -> list[dict[str, Any]]:
    return [json.loads((run / "placement" / f"rank_{rank}.json").read_text()) for rank in (0, 1)]


@pytest.fixture(scope="module")
def one_node(ddp_workspace: tuple[Path, Path, dict[str, str]]) -> Path:
    """Two processes on one node, started by Lightning's own DDP launcher; the run's directory."""
    tmp_path, corpus, env = ddp_workspace
    run = tmp_path / "one_node"
    recipe = ddp_recipe(run, corpus, _record_placement(run / "placement"))
    log = run / "fit.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "cli", "fit", "--config", str(recipe), "--trainer.num_nodes", "1"]
            + ["--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.accelerator", "cpu"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # rank 1 joins this session, so a SIGKILL of the group reaches it
        )
        _wait([process], [log])
    return run


@pytest.fixture(scope="module")
def two_nodes(ddp_workspace: tuple[Path, Path, dict[str, str]]) -> Path:
    """Two ``torchrun`` launchers of one process each, meeting at a c10d rendezvous on 127.0.0.1; the run's
    directory (``node_<n>.log`` is launcher n's output, whichever global rank it got)."""
    tmp_path, corpus, env = ddp_workspace
    run = tmp_path / "two_nodes"
    recipe = ddp_recipe(run, corpus, _record_placement(run / "placement"))
    torchrun = [sys.executable, "-m", "torch.distributed.run"]  # what the torchrun console script runs
    launcher = [
        *torchrun,
        *("--nnodes", "2", "--nproc-per-node", "1"),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "lm-zoo-test"),
        *("-m", "cli", "fit", "--config", str(recipe), "--trainer.num_nodes", "2", *FIT_ON_ONE_DEVICE_PER_NODE),
    ]
    processes, logs = [], []
    for node in (0, 1):
        log = run / f"node_{node}.log"
        with log.open("w") as out:
            node_env = {**env, "LM_ZOO_CACHE": str(run / f"cache_{node}")}  # nothing shared but the checkpoints
            processes.append(
                subprocess.Popen(
                    launcher, cwd=ROOT, env=node_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
        logs.append(log)
    _wait(processes, logs)
    return run


@pytest.mark.slow
def test_two_nodes_run_as_torchrun_and_read_the_columns_of_their_global_rank(one_node: Path, two_nodes: Path) -> None:
    local, remote = _placements(one_node), _placements(two_nodes)
    assert [(p["environment"], p["node_rank"], p["local_rank"]) for p in local] == [
        ("LightningEnvironment", 0, 0),
        ("LightningEnvironment", 0, 1),
    ]
    # Lightning read torchrun's variables: one process per node, so both are local rank 0 on nodes 0 and 1.
    assert [(p["environment"], p["node_rank"], p["local_rank"]) for p in remote] == [
        ("TorchElasticEnvironment", 0, 0),
        ("TorchElasticEnvironment", 1, 0),
    ]
    assert all(p["world_size"] == 2 for p in local + remote)
    for rank in (0, 1):  # the same columns for the same global rank, wherever it runs
        assert remote[rank]["first_inputs"] == local[rank]["first_inputs"], rank
    assert local[0]["first_inputs"] != local[1]["first_inputs"]  # ...and each rank its own
    # Rank 0's first line counts the nodes in the global batch: 4 columns x 1 device x 2 nodes.
    logs = "".join((two_nodes / f"node_{node}.log").read_text() for node in (0, 1))
    assert "lm-zoo: training on 2 nodes x 1 cpu device (ddp), 4 columns per rank, 8 in all" in logs, logs[-3000:]


@pytest.mark.slow
def test_two_nodes_end_bit_for_bit_where_two_processes_on_one_node_end(one_node: Path, two_nodes: Path) -> None:
    expected, final = (
        read_checkpoint(one_node / "checkpoints" / "last.ckpt"),
        read_checkpoint(two_nodes / "checkpoints" / "last.ckpt"),
    )
    assert final["global_step"] == expected["global_step"] == MAX_STEPS
    assert len(final["state_dict"]) == len(expected["state_dict"]) > 5
    for name, tensor in expected["state_dict"].items():
        assert torch.equal(final["state_dict"][name], tensor), name
    assert final[RESUME_KEY]["world_size"] == 2
    for rank in ("rank_0", "rank_1"):  # each global rank carried the same state and generators on either layout
        for ours, theirs in zip(final[RESUME_KEY][rank]["train_state"], expected[RESUME_KEY][rank]["train_state"]):
            assert torch.equal(ours, theirs), rank
        assert torch.equal(final[RESUME_KEY][rank]["rng"]["torch"], expected[RESUME_KEY][rank]["rng"]["torch"])


@pytest.mark.slow
def test_two_nodes_validate_as_two_processes_on_one_node(
    one_node: Path,
    two_nodes: Path,
    ddp_workspace: tuple[Path, Path, dict[str, str]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("LM_ZOO_CACHE", str(ddp_workspace[0] / "cache"))
    figures = {}
    for run in (one_node, two_nodes):
        assert cli.main(["evaluate", str(run / "checkpoints" / "last.ckpt"), "--split", "valid", "--json"]) == 0
        figures[run.name] = json.loads(capsys.readouterr().out)
    with capsys.disabled():
        print(
            f"\nvalid ppl: one node x 2 processes {figures['one_node']['ppl']:.6f}, "
            f"2 nodes x 1 process {figures['two_nodes']['ppl']:.6f}"
        )
    assert figures["one_node"]["tokens"] == figures["two_nodes"]["tokens"] > 0
    assert figures["two_nodes"]["ppl"] == figures["one_node"]["ppl"] < 60  # the same weights, and they learned


@pytest.mark.parametrize(
    ("environment", "launched", "said"),
    [
        (TorchElasticEnvironment, {"WORLD_SIZE": "1", "LOCAL_RANK": "0"}, "does not match the world size (1)"),
        (SLURMEnvironment, {"SLURM_NTASKS_PER_NODE": "4", "SLURM_JOB_NAME": "fit"}, "--ntasks-per-node=4"),
    ],
)
def test_devices_and_nodes_that_differ_from_the_launchers_are_one_line(
    environment: type[ClusterEnvironment], launched: dict[str, str], said: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in launched.items():  # what torchrun / srun would have set for one process per node
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as raised:  # Lightning's own check, run before any process group exists
        environment().validate_settings(num_devices=2, num_nodes=2)
    error = user_error(raised.value)
    assert isinstance(error, ConfigError) and said in str(error) and "\n" not in str(error)
    assert str(error).endswith("Set trainer.devices and trainer.num_nodes to what the launcher started.")
    assert user_error(ValueError("a bug elsewhere")) is None  # other ValueErrors keep their traceback
