"""The `rftpipe` console script: one command for the three things users do on a login node.

    rftpipe submit [--nodes N ...] [--config PATH] [key=value ...]   # python -m jobs.submit
    rftpipe status RUN_DIR [--json]                                   # python -m jobs.status
    rftpipe inspect RUN_DIR summary|samples|export|plot|compare|verify  # python -m rftpipe.inspect

Each subcommand is exactly its `python -m` form (same flags, output and exit codes); this
only dispatches, so `rftpipe --help` stays instant (nothing heavy is imported before the
subcommand is known).
"""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "submit": ("jobs.submit", "launch or resume a run (locally or on Slurm)"),
    "status": ("jobs.status", "where a run stands: committed steps, jobs, recent events"),
    "inspect": ("rftpipe.inspect.cli", "read a run's committed trajectories and verify it"),
}


def usage() -> str:
    rows = "\n".join(f"  {name:<8} {help_}" for name, (_, help_) in COMMANDS.items())
    return f"usage: rftpipe {{{','.join(COMMANDS)}}} ...\n\ncommands:\n{rows}\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(usage(), end="")
        return 0 if args else 2
    if args[0] not in COMMANDS:
        print(f"rftpipe: error: unknown command {args[0]!r}\n{usage()}", end="", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[args[0]][0])
    sys.argv[0] = f"rftpipe {args[0]}"
    return int(module.main(args[1:]))


if __name__ == "__main__":
    sys.exit(main())
