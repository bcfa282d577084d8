"""One rank of tests/test_ddp_heads.py's broadcast count, run as ``python -m tests.ddp_broadcasts RANK RENDEZVOUS``.

It wraps the NCE LanguageModel, then a control module that has a buffer (BatchNorm's running statistics), in
``DistributedDataParallel`` with the arguments Lightning's ``ddp`` strategy gives it (none: ``broadcast_buffers=True``)
and prints, as one JSON line, the bytes DDP broadcasts at wrapping and in each forward, and a digest of the noise
tables it computed.

A process of its own, not a ``multiprocessing`` child of the pytest worker, so that the test reads what a rank printed:
twice, under two pytest workers, neither spawned rank ever reported and the test waited out its timeout with nothing
to say why (a deadlock at the group's teardown, below). Here a rank that waits on the other fails after
:data:`COLLECTIVE_TIMEOUT` with gloo's error, and one stuck anywhere else prints every thread's stack after
:data:`STUCK_AFTER` and exits.
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

VOCAB = 1000
COLLECTIVE_TIMEOUT = timedelta(seconds=60)
STUCK_AFTER = 150  # seconds; the test waits longer, so it reads the stacks


def count_broadcasts(rank: int, rendezvous: str) -> dict[str, Any]:
    from lightning_modules import LanguageModel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2, timeout=COLLECTIVE_TIMEOUT)
    sent: list[int] = []
    original = dist._broadcast_coalesced

    def counting(group: Any, tensors: list[torch.Tensor], bucket_size: int, src: int) -> None:
        sent.append(sum(t.numel() * t.element_size() for t in tensors))
        original(group, tensors, bucket_size, src)

    dist._broadcast_coalesced = counting  # what DDP calls, for its parameters at wrapping and its buffers per forward
    torch.manual_seed(0)
    model = LanguageModel(vocab_size=VOCAB, embedding_size=8, hidden_size=8, num_layers=1, head="nce", noise_samples=4)
    model.set_noise_distribution(torch.arange(1, VOCAB + 1))
    control = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    figures: dict[str, Any] = {}
    for name, module, inputs in [
        ("nce", model, torch.randint(0, VOCAB, (2, 5))),
        ("batchnorm", control, torch.randn(3, 4)),
    ]:
        sent.clear()
        wrapped = DistributedDataParallel(module)  # Lightning's DDPStrategy passes no kwargs by default
        at_wrapping = sum(sent)
        sent.clear()
        for _ in range(2):
            output = wrapped(inputs)
            (output[0] if isinstance(output, tuple) else output).float().mean().backward()
        figures[name] = (at_wrapping, list(sent))
    # The test compares the ranks' tables by digest, not by a collective here: a collective whose tensors Python made
    # was the last work of the gloo group, and its worker thread, releasing those tensors, waited for the GIL while
    # the main thread, holding it, destroyed the group and waited for that thread (torch 2.13: 3 runs of the two
    # ranks in 10 hung; with this, 0 in 20).
    tables = torch.cat([model.model.decoder.noise.probs, model.model.decoder.noise.accept])
    figures["tables"] = hashlib.sha256(tables.numpy().tobytes()).hexdigest()
    del wrapped  # DDP's reducer holds the group: let it go first, as a program ends a DDP run
    dist.destroy_process_group()
    return figures


if __name__ == "__main__":
    faulthandler.dump_traceback_later(STUCK_AFTER, exit=True)
    print(json.dumps(count_broadcasts(int(sys.argv[1]), sys.argv[2])), flush=True)
