"""``hvd-sparse``: the command-line entry point.

    hvd-sparse aggregator --bind 0.0.0.0:9999 --workers 8 [--secret-file F] [--stats 10]
    hvd-sparse testbed {up,run,set,status,down} ...   (emulated hosts; needs root)
    hvd-sparse analyze RUN.json [--png out.png] [--json out.json]
    hvd-sparse dissect FILE.pcap | --iface IF [--count N] [--timeout S] [--port P] [--json]
    hvd-sparse switch {start,jobs,stats,limits} ...   (the emulated switch's control plane)
    hvd-sparse --version
"""
from __future__ import annotations

import sys

USAGE = ("usage: hvd-sparse aggregator|analyze|dissect [options]   (hvd-sparse COMMAND --help)\n"
         "       hvd-sparse testbed {up,run,set,status,down} [options]\n"
         "       hvd-sparse switch {start,jobs,stats,limits} [options]\n"
         "       hvd-sparse --version")


def main(argv: list[str] | None = None) -> None:
    """The ``hvd-sparse`` command: runs the subcommand its first argument names (``aggregator``,
    ``testbed``, ``analyze``, ``dissect``, ``switch``), with the rest of the arguments;
    ``--version`` prints the package's version.

    Args:
        argv: the arguments after the program's name; None: ``sys.argv[1:]``.

    Raises:
        SystemExit: at the end, with the subcommand's exit status (0 after ``-h``/``--help``;
            2 with no arguments or an unknown command; 0 after ``--version``). ``aggregator``
            does not return: the aggregator's binary replaces the process.

    Example:
        >>> main(["analyze", "run.json", "--png", "run.png"])
    """
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        sys.exit(0 if args else 2)
    if args[0] == "--version":
        from .. import __version__
        print(f"hvd-sparse {__version__}")
        sys.exit(0)
    if args[0] == "aggregator":
        from .. import aggregator
        aggregator.main(args[1:])
    if args[0] == "testbed":
        from .testbed import cli
        sys.exit(cli.main(args[1:]))
    if args[0] == "analyze":
        from . import analyze
        sys.exit(analyze.main(args[1:]))
    if args[0] == "switch":
        from hvd_sparse.tools.switch import control
        sys.exit(control.main(args[1:]))
    if args[0] == "dissect":
        from . import dissect
        sys.exit(dissect.main(args[1:]))
    print(f"hvd-sparse: unknown command {args[0]!r}\n{USAGE}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
