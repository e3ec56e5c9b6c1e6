"""The client of a switch's control plane: the emulated switch's local control socket
(csrc/switch/control.h: one text command per datagram, one JSON reply). The runtime uses it to
install a job with its workers' addresses (session.join_switch); ``hvd-sparse switch`` and the
testbed use it for everything else. Torch-free.
"""
from __future__ import annotations

import json
import os
import socket
import tempfile
from pathlib import Path


class ControlError(RuntimeError):
    """The switch refused a command, or did not answer."""


class Client:
    """One command per datagram to the switch's control socket, one JSON reply."""

    def __init__(self, path: str | Path, timeout: float = 5.0) -> None:
        self.path, self.timeout = str(path), timeout

    def call(self, command: str) -> dict:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s, \
                tempfile.TemporaryDirectory(prefix="hvd-sparse-ctl-") as d:
            s.bind(os.path.join(d, "client"))  # the switch replies to this address
            s.settimeout(self.timeout)
            try:
                s.sendto(command.encode(), self.path)
                reply = json.loads(s.recv(1 << 20))
            except (OSError, TimeoutError) as e:
                raise ControlError(f"switch control socket {self.path}: {e}") from e
        if "error" in reply:
            raise ControlError(f"switch: {command.split()[0]}: {reply['error']}")
        return reply

    def limits(self) -> dict:
        return self.call("limits")

    def stats(self) -> dict:
        return self.call("stats")

    def jobs(self, token: int | None = None) -> list[dict]:
        """The installed jobs (or the one of ``token``), named by their first slot group: the
        switch never prints a token."""
        return self.call("jobs" if token is None else f"jobs {token}")["jobs"]

    def bind(self, port: str, mac: str, ip: str) -> None:
        """Binds the host at ``ip`` to the switch port named ``port`` and its ``mac``: the
        switch takes aggregation traffic from bound hosts only, and drops frames that claim a
        bound address from another port or MAC."""
        self.call(f"host {port} {mac} {ip}")

    def install(self, token: int, workers: int, groups: int,
                ips: list[str] | None = None, epoch: int = 1) -> int:
        """Installs a job on ``groups`` slot groups; returns the first one.

        Args:
            token: the job's token.
            workers: its workers.
            groups: slot groups it gets.
            ips: one bound host address per worker, in worker order: binds each worker to
                its host.
            epoch: the job's membership (docs/PROTOCOL.md "Memberships"): a job of this token
                installed at an earlier epoch is replaced, its groups freed first.

        Returns:
            The job's first slot group.

        Raises:
            ControlError: the switch refused (already installed at this epoch or a later one,
                a limit, an address that is no bound host).
        """
        return self.call(f"install {token} {workers} {groups}"
                         + (f" {','.join(ips)}" if ips else "") + f" epoch={epoch}")["first"]

    def remove(self, token: int, epoch: int | None = None) -> bool:
        """Removes the job of ``token``; with ``epoch``, only when installed at that epoch or
        an earlier one (so a late close of an old membership leaves a newer one alone).
        Returns whether a job was removed."""
        return self.call(f"remove {token}" + (f" {epoch}" if epoch is not None else ""))[
            "removed"]

    def drop(self, first: int) -> bool:
        """Removes the job whose slot groups start at ``first`` (its token unknown)."""
        return self.call(f"drop {first}")["removed"]
