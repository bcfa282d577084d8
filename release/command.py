"""``python -m release build|publish|table|card|check|continues``: maintainers' commands for the models shipped under
``pretrained/``, with ``lm-zoo``'s one-line errors (:func:`cli.run_command`)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from checkpoints import registry
from cli import run_command
from commands.common import CommandParser
from commands.sharing import shard_size
from release.bundle import (
    REPO_OWNER,
    build,
    measure_checks,
    publish_all,
    record_continued,
    render_again,
    write_table,
)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m release ARGV``; returns the exit status."""
    return run_command(release, list(sys.argv[1:] if argv is None else argv))


def release(argv: Sequence[str]) -> None:
    """Parse ``argv`` and run its action."""
    parser = CommandParser(prog="python -m release", description="maintainers: the bundled pretrained models")
    commands = parser.add_subparsers(dest="action", required=True)
    build_parser = commands.add_parser("build", help="export a finished run to pretrained/NAME and register it")
    build_parser.add_argument("name")
    build_parser.add_argument(
        "--ckpt", type=Path, required=True, help="the run's best checkpoint, or its export (then give --logs)"
    )
    build_parser.add_argument("--config", type=Path, required=True, help="the recipe it was trained from")
    build_parser.add_argument("--command", help="how it was trained (default: lm-zoo fit --config CONFIG)")
    build_parser.add_argument("--logs", type=Path, nargs="+", default=(), help="TensorBoard dirs (resumed runs: all)")
    build_parser.add_argument("--commit", help="the lm-zoo commit it was trained at (default: this checkout's)")
    build_parser.add_argument(
        "--hardware", help="the machine it was trained on, in words (default: this one's GPU or CPU count)"
    )
    build_parser.add_argument("--dtype", default="float32", choices=("float32", "float16"))
    build_parser.add_argument(
        "--max-shard-size", type=shard_size, metavar="SIZE", help="weights in shards of at most SIZE (16MiB, 2GB)"
    )
    build_parser.add_argument("--repo-id", help=f"its Hub repo (default {REPO_OWNER}/NAME)")
    build_parser.add_argument("--revision", default="v1", help="the tag it is published under (default v1)")
    build_parser.add_argument("--description", default="", help="one line for the registry")
    build_parser.add_argument("--max-sample-tokens", type=int, default=60)
    build_parser.add_argument("--notes", default="", help="a paragraph for the card")
    build_parser.add_argument("--data-root", help="where corpora live (default: $LM_ZOO_DATA)")
    build_parser.add_argument(
        "--continues",
        metavar="COMMIT",
        help="the run started from the export of NAME's revision bundled at this lm-zoo commit: record its runs",
    )
    publish_parser = commands.add_parser("publish", help="publish the bundled models (needs HF_TOKEN)")
    publish_parser.add_argument("names", nargs="*", help="default: every registered model")
    publish_parser.add_argument("--endpoint", help="the Hub's URL (default: $HF_ENDPOINT or https://huggingface.co)")
    table_parser = commands.add_parser("table", help="rewrite the README's pretrained-models table")
    table_parser.add_argument("--readme", type=Path, default=Path("README.md"))
    card_parser = commands.add_parser(
        "card", help="render bundled cards again from config.json (registry hashes updated); no run needed"
    )
    card_parser.add_argument("names", nargs="*", help="default: every registered model")
    check_parser = commands.add_parser(
        "check", help="measure the bundled models' check figures again and record them in the registry"
    )
    check_parser.add_argument("names", nargs="*", help="default: every registered model")
    check_parser.add_argument("--data-root", help="where corpora live (default: $LM_ZOO_DATA)")
    continues_parser = commands.add_parser(
        "continues",
        help="record that a bundled model's run started from the export of its revision bundled at COMMIT (that "
        "revision's runs, read with git, go into config.json, the card and the registry); no run needed",
    )
    continues_parser.add_argument("name")
    continues_parser.add_argument("commit", help="an lm-zoo commit whose pretrained/NAME is the earlier revision")
    args = parser.parse_args(argv)
    if args.action == "build":
        entry = build(
            args.name,
            args.ckpt,
            args.config,
            command=args.command,
            logs=args.logs,
            commit=args.commit,
            hardware_name=args.hardware,
            dtype=args.dtype,
            repo_id=args.repo_id,
            revision=args.revision,
            description=args.description,
            max_sample_tokens=args.max_sample_tokens,
            data_root=args.data_root,
            notes=args.notes,
            max_shard_size=args.max_shard_size,
            continues=args.continues,
        )
        print(json.dumps(entry.to_json(), indent=2))
    elif args.action == "publish":
        for name, url in publish_all(args.names, endpoint=args.endpoint):
            print(f"{name}: {url}")
    elif args.action == "card":
        for name in args.names or list(registry.load_registry()):
            changed = render_again(name)
            print(f"{name}: {', '.join(sorted(changed)) or 'unchanged'}")
    elif args.action == "continues":
        for run in record_continued(args.name, args.commit):
            print(f"{args.name}: carries on from {run['revision']} ({run['config_file']}, {run['source']['commit']})")
    elif args.action == "check":
        for name, check in measure_checks(args.names, args.data_root).items():
            print(f"{name}: {json.dumps(check['test'])}")
    else:
        write_table(args.readme)
