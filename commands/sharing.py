"""``lm-zoo export``, ``publish`` and ``download``: a model as a shareable directory, on the Hugging Face Hub, and
back."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from checkpoints import hub, registered_directory, registry
from checkpoints.export_read import CONFIG_NAME, STORED_DTYPES
from checkpoints.export_write import export
from commands import COMMANDS
from commands.common import DEVICE_HELP, SOURCE_HELP, CommandParser, device_argument, refuse_quantize
from datamodules.corpora import REPORTED_SPLITS, SPLITS
from evaluation.results import result_from_json
from zoo.errors import ConfigError


def cmd_export(argv: Sequence[str]) -> None:
    """``lm-zoo export SOURCE --out DIR``: the shareable format, with the results measured for its model card."""
    parser = CommandParser(prog="lm-zoo export", description=COMMANDS["export"].summary)
    parser.add_argument("source", help=SOURCE_HELP)
    parser.add_argument("--out", required=True, help="the export directory (created; a previous export is replaced)")
    splits_help = "splits to evaluate for the model card (default: valid test; none: no evaluation)"
    parser.add_argument("--splits", nargs="*", default=list(REPORTED_SPLITS), choices=SPLITS, help=splits_help)
    results_help = "use `lm-zoo evaluate --json` outputs saved in these files instead of evaluating"
    parser.add_argument("--results", nargs="+", metavar="JSON", help=results_help)
    parser.add_argument("--batch-size", type=int, help="eval batch size (default: the training run's)")
    parser.add_argument("--bptt", type=int, help="eval BPTT (default: the training run's)")
    parser.add_argument("--data-root", help="where corpora live (default: $LM_ZOO_DATA)")
    parser.add_argument("--device", type=device_argument, default="auto", help=DEVICE_HELP)
    parser.add_argument(
        "--max-shard-size",
        type=shard_size,
        metavar="SIZE",
        help="write the weights as shards of at most SIZE (e.g. 2GB, 16MiB; MB and GB are powers of 1000) "
        "with Hugging Face's model.safetensors.index.json; a tensor larger than SIZE gets a shard of its own "
        "(default: one model.safetensors)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=sorted(STORED_DTYPES),
        help="how the weights are stored (float16: half the size; the figures measured are of the stored weights)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    refuse_quantize(parser)
    args = parser.parse_args(argv)

    results = [_read_result(path) for path in args.results] if args.results else None
    evaluation = {"batch_size": args.batch_size, "bptt": args.bptt, "data_root": args.data_root, "device": args.device}
    out = export(
        args.source,
        args.out,
        splits=args.splits,
        results=results,
        max_shard_size=args.max_shard_size,
        dtype=args.dtype,
        **evaluation,
    )
    config = json.loads((out / CONFIG_NAME).read_text())
    files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    if args.json:
        print(json.dumps({"out": str(out), "files": files, "results": config["results"]}))
        return
    print(f"{out}: " + ", ".join(f"{name} ({size:,} bytes)" for name, size in files.items()))
    for result in map(result_from_json, config["results"]):
        print(f"  {result.split}: {result.headline()} (eval batch size {result.eval_batch_size}, bptt {result.bptt})")


# The Hub writes sizes in powers of 1000 ("5GB"); its parser is private and knows no MiB, which a transfer limit of
# 16 MiB is written in. So both, here.
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def shard_size(text: str) -> int:
    """``--max-shard-size``: bytes, or a size with a unit (16MB = 16 x 1000^2 bytes, 16MiB = 16 x 1024^2)."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = found[2].upper() if found else ""
    if found is None or unit not in _UNITS:
        raise ConfigError(f"--max-shard-size {text!r}: write a size such as 16MB, 16MiB or 2GB (or bytes)")
    size = int(float(found[1]) * _UNITS[unit])
    if size < 1:
        raise ConfigError(f"--max-shard-size must be at least 1 byte, got {text!r}")
    return size


def _read_result(path: str) -> dict:
    try:
        return json.loads(open(path, encoding="utf-8").read())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"--results {path}: not a saved `lm-zoo evaluate --json` output ({err})") from None


def cmd_publish(argv: Sequence[str]) -> None:
    """``lm-zoo publish DIR --repo-id owner/name``: create the repo if needed, upload, print the URL."""
    parser = CommandParser(prog="lm-zoo publish", description=COMMANDS["publish"].summary)
    parser.add_argument("directory", help="a directory written by lm-zoo export")
    parser.add_argument("--repo-id", required=True, help="owner/name on the Hub (HF_TOKEN: a token with write access)")
    parser.add_argument("--private", action="store_true", help="create the repo private")
    parser.add_argument("--revision", help="the branch to commit to, created if missing (default main)")
    parser.add_argument("--tag", help="also tag the commit (e.g. v1), so downloads can pin it")
    parser.add_argument("--commit-message")
    parser.add_argument("--endpoint", help="the Hub's URL (default: $HF_ENDPOINT or https://huggingface.co)")
    parser.add_argument("--name", help="short name for the registry entry printed with --json (default: repo name)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (with a registry entry)")
    refuse_quantize(parser)
    args = parser.parse_args(argv)

    options = {"revision": args.revision, "tag": args.tag, "commit_message": args.commit_message}
    published = hub.publish(args.directory, args.repo_id, private=args.private, endpoint=args.endpoint, **options)
    if args.json:
        config = json.loads(open(f"{args.directory}/{CONFIG_NAME}", encoding="utf-8").read())
        name = args.name or args.repo_id.split("/")[-1].lower()
        entry = registry.entry_for(config, name, args.repo_id, published.tag or published.commit)
        print(json.dumps({**published.__dict__, "registry_entry": entry.to_json()}))
        return
    print(published.url)
    print(f"commit {published.commit} on {published.revision}" + (f", tagged {published.tag}" if published.tag else ""))


def cmd_download(argv: Sequence[str]) -> None:
    """``lm-zoo download ID``: a repo id or registered short name into the Hugging Face cache; prints the path."""
    parser = CommandParser(prog="lm-zoo download", description=COMMANDS["download"].summary)
    parser.add_argument("model", help="owner/name, or a short name from lm-zoo models --pretrained")
    parser.add_argument("--revision", help="branch, tag or commit (default main, or the registry's pinned revision)")
    parser.add_argument("--endpoint", help="the Hub's URL (default: $HF_ENDPOINT or https://huggingface.co)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    refuse_quantize(parser)
    args = parser.parse_args(argv)

    entry = registry.lookup(args.model) if "/" not in args.model else None
    if entry is not None:
        repo_id, revision = entry.repo_id, args.revision or entry.revision
        path = registered_directory(entry, args.revision, endpoint=args.endpoint)
    elif "/" in args.model:
        repo_id, revision = args.model, args.revision
        path = hub.download(repo_id, revision, endpoint=args.endpoint)
    else:
        raise ConfigError(f"{args.model!r} is no registered model (lm-zoo models --pretrained) and no owner/name")
    print(json.dumps({"repo_id": repo_id, "revision": revision, "path": str(path)}) if args.json else path)
