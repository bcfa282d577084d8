"""``lm-zoo models``: the architectures in the zoo, or the registry of published models."""

from __future__ import annotations

import json
from collections.abc import Sequence

import zoo
from checkpoints import registry
from commands import COMMANDS
from commands.common import CommandParser
from datamodules.kinds import METRICS


def cmd_models(argv: Sequence[str]) -> None:
    """``lm-zoo models``: the architectures in the zoo, or (``--pretrained``) the registry of published models."""
    parser = CommandParser(prog="lm-zoo models", description=COMMANDS["models"].summary)
    parser.add_argument("--pretrained", action="store_true", help="the published models ($LM_ZOO_REGISTRY overrides)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.pretrained:
        _print_registry(args.json)
        return
    rows = [
        {"name": name, "description": text, "reference": ref, "presets": list(zoo.get(name).presets)}
        for name, text, ref in zoo.describe()
    ]
    if args.json:
        print(json.dumps(rows))
        return
    width = max(len(row["name"]) for row in rows)
    for row in rows:
        presets = ", ".join(row["presets"])
        print(f"{row['name']:<{width}}  {row['description']}  [{row['reference']}; presets: {presets}]")


def _print_registry(as_json: bool) -> None:
    entries = registry.load_registry()
    if as_json:
        print(json.dumps([entry.to_json() for entry in entries.values()]))
        return
    if not entries:
        print(f"no pretrained models are registered yet ({registry.registry_path()})")
    for entry in entries.values():
        scores = "; ".join(
            ", ".join(f"{split} {metric} {value:.6g}" for metric, value in result.items() if metric in METRICS)
            + f" (eval batch {result['eval_batch_size']}, bptt {result['bptt']})"
            for split, result in entry.results.items()
        )
        size = f"{entry.num_parameters:,} parameters, " if entry.num_parameters else ""
        size += f"{entry.size_bytes / 1e6:.1f} MB" if entry.size_bytes else "not bundled"
        where = f"{entry.repo_id}@{entry.revision}"
        print(f"{entry.name:<20} {entry.dataset} {entry.architecture} ({size})  {scores}  [{where}]")
