"""``lm-zoo``: train, evaluate and sample recurrent language models.

``fit``, ``validate``, ``test`` and ``predict`` go to LightningCLI (YAML configs, ``--print_config``, any option
overridable on the command line). The other subcommands take a SOURCE (a ``.ckpt``, an exported directory, a Hub
repo id or a registered model's short name) and are plain argparse: they need no Trainer, and LightningCLI cannot mix
its subcommands with others (``run=False`` disables them all).

This module is the command table and the dispatch, as litgpt's ``__main__`` is: each subcommand lives in
``commands/<name>.py`` and is imported only when it runs, so ``lm-zoo --help`` and a quick command pay for no more
than they use. Where an exception becomes the one-line message is :func:`commands.common.user_error`.
"""

from __future__ import annotations

import importlib
import os
import shlex
import sys
from collections.abc import Callable, Sequence

from commands import COMMANDS
from commands.common import SOURCE_HELP, user_error
from zoo.allocator import keep_freed_memory
from zoo.errors import ConfigError, Interrupted


def _usage() -> str:
    lines = ["usage: lm-zoo COMMAND [options]   (lm-zoo COMMAND --help for its options; --debug shows tracebacks)", ""]
    lines += [f"  {name:<10} {command.summary}" for name, command in COMMANDS.items()]
    lines += ["", f"A SOURCE is {SOURCE_HELP} (lm-zoo models --pretrained)."]
    return "\n".join(lines)


def handler(command: str) -> Callable[..., None]:
    """The function that runs ``command`` (one of :data:`commands.COMMANDS`), imported now."""
    module, _, function = COMMANDS[command].runs.partition(":")
    return getattr(importlib.import_module(module), function)


def resume_hint(argv: Sequence[str], checkpoint: str | None) -> str:
    """``"; resume: lm-zoo ARGV --ckpt_path CHECKPOINT"``, the interrupted command continued (``""`` if nothing was
    written)."""
    if checkpoint is None:
        return ""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--ckpt_path":
            skip = True
        elif not arg.startswith("--ckpt_path="):
            kept.append(arg)
    return f"; resume: lm-zoo {shlex.join([*kept, '--ckpt_path', checkpoint])}"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lm-zoo`` console script; returns the exit status."""
    own_command = argv is None  # lm-zoo's own command line, which Lightning's DDP launcher re-runs per rank
    from_sys_argv = own_command and "--debug" not in sys.argv
    argv = list(sys.argv[1:] if argv is None else argv)
    plain = [a for a in argv if a != "--debug"]
    if not plain or plain[0] in ("-h", "--help"):
        print(_usage())
        return 0
    command = plain[0]

    def run(args: list[str]) -> None:
        if command not in COMMANDS:
            raise ConfigError(f"unknown command {command!r}: use one of {', '.join(COMMANDS)}")
        if COMMANDS[command].lightning:
            # Given an argv, the fit runs inside this process's other work (a test, a script) and keeps to one device;
            # --debug only removes itself from the process's own command line.
            handler(command)(None if from_sys_argv else args, own_command=own_command)
        else:
            handler(command)(args[1:])

    return run_command(run, argv)


def run_command(run: Callable[[list[str]], None], argv: Sequence[str]) -> int:
    """``run(argv)`` with lm-zoo's exits: a user's error as one line and status 2 (``--debug``: the traceback), an
    interruption as one line with how to resume, a closed pipe quietly; returns the exit status. ``lm-zoo`` and the
    maintainers' ``python -m release`` both run through it."""
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    keep_freed_memory()  # before the first step's allocations: see zoo.allocator
    try:
        run(argv)
        sys.stdout.flush()  # here, where a closed pipe is caught below, rather than at interpreter exit
    except BrokenPipeError:
        # The reader went away (`lm-zoo models | head -3`): stop quietly, as Unix tools do. Python would otherwise
        # print a traceback now and another one when it flushes stdout at exit, so point stdout at /dev/null.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by the signal
    except Exception as err:
        ours = user_error(err)
        if ours is None or debug:
            raise
        if isinstance(ours, Interrupted):
            line = f"lm-zoo: interrupted: {ours}{resume_hint(argv, ours.checkpoint)}"
        else:
            line = f"lm-zoo: error: {ours}"
        # One write with its newline: the ranks of a multi-process run share stderr, and print's two writes (the
        # text, then the newline) let another rank's line land between them.
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        return ours.exit_code
    except KeyboardInterrupt:
        print("lm-zoo: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
