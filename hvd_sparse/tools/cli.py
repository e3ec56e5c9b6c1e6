"""``hvd-sparse``: the command-line entry point.

    hvd-sparse aggregator --bind 0.0.0.0:9999 --workers 8 [--secret-file F] [--stats 10]
    hvd-sparse testbed {up,run,set,status,down} ...   (emulated hosts; needs root)
    hvd-sparse analyze RUN.json [--png out.png] [--json out.json]
    hvd-sparse dissect FILE.pcap | --iface IF [--count N] [--timeout S] [--port P] [--json]
    hvd-sparse switch {start,jobs,stats,limits} ...   (the emulated switch's control plane)
"""
from __future__ import annotations

import sys

USAGE = ("usage: hvd-sparse aggregator|analyze|dissect [options]   (hvd-sparse COMMAND --help)\n"
         "       hvd-sparse testbed {up,run,set,status,down} [options]\n"
         "       hvd-sparse switch {start,jobs,stats,limits} [options]")


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        sys.exit(0 if args else 2)
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
