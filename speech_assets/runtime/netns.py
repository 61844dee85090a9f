"""A private network namespace: a loopback of its own for a group of processes, which no process
outside it can reach (another user's of the same machine included).

Linux only. :class:`PrivateNetwork` keeps a holder process (``python -m
speech_assets.runtime.netns``, in ``unshare --net``, plus a user namespace for non-root) alive
until :meth:`PrivateNetwork.stop`; :meth:`PrivateNetwork.enter` prefixes a command with
``nsenter``. Entering needs ``CAP_SYS_ADMIN`` over the namespace, which only its owner holds.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Sequence

READY = b"ready\n"
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


class NoPrivateNetwork(RuntimeError):
    """This machine would not give us a network namespace of our own."""


class PrivateNetwork:
    """A network namespace of this process's own, for ``with`` or :meth:`start`/:meth:`stop`."""

    def __init__(self) -> None:
        self.holder: subprocess.Popen | None = None
        self.user_namespace = False

    @property
    def pid(self) -> int:
        assert self.holder is not None, "the private network is not started"
        return self.holder.pid

    def start(self) -> PrivateNetwork:
        # imported here: the holder (this module's main) runs on the standard library alone
        from speech_assets.runtime.processes import die_with_parent, on_linux

        unshare, nsenter = shutil.which("unshare"), shutil.which("nsenter")
        if not on_linux() or unshare is None or nsenter is None:
            raise NoPrivateNetwork("a private network namespace needs Linux and util-linux's unshare and nsenter")
        errors = []
        # root needs no user namespace (and keeps its access to other users' files)
        user = ["--user", "--map-root-user", "--net"]
        for options in [["--net"], user] if os.geteuid() == 0 else [user]:
            holder = subprocess.Popen(  # noqa: S603
                [unshare, *options, "--", sys.executable, "-m", __name__],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=die_with_parent,  # noqa: PLW1509
            )
            assert holder.stdout is not None and holder.stderr is not None
            if holder.stdout.readline() == READY:
                self.holder, self.user_namespace = holder, "--user" in options
                return self
            _end(holder)
            stderr = " ".join(holder.stderr.read().decode(errors="replace").split())
            errors.append(f"unshare {' '.join(options)}: {stderr}")
        raise NoPrivateNetwork(
            "could not make a private network namespace (" + "; ".join(errors) + "): unprivileged user namespaces "
            "may be disabled (sysctl kernel.unprivileged_userns_clone, or on Ubuntu "
            "kernel.apparmor_restrict_unprivileged_userns)"
        )

    def enter(self, command: Sequence[str]) -> list[str]:
        """``command`` as it runs inside the namespace (``nsenter`` execs it: same pid)."""
        user = ["--user", "--preserve-credentials"] if self.user_namespace else []
        return [shutil.which("nsenter") or "nsenter", f"--target={self.pid}", *user, "--net", "--", *command]

    def listening(self, port: int) -> bool:
        """Whether a TCP socket listens on ``port`` inside the namespace (read from ``/proc``)."""
        for table in ("tcp", "tcp6"):
            with contextlib.suppress(OSError), open(f"/proc/{self.pid}/net/{table}", encoding="ascii") as rows:
                for row in list(rows)[1:]:
                    local, state = row.split()[1], row.split()[3]
                    if state == _LISTEN and int(local.rsplit(":", 1)[1], 16) == port:
                        return True
        return False

    def stop(self) -> None:
        if self.holder is not None:
            _end(self.holder)
            self.holder = None

    def __enter__(self) -> PrivateNetwork:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _end(holder: subprocess.Popen) -> None:
    with contextlib.suppress(OSError):
        assert holder.stdin is not None
        holder.stdin.close()
    try:
        holder.wait(timeout=5)
    except subprocess.TimeoutExpired:
        holder.kill()
        holder.wait()


def loopback_up() -> None:
    """Bring this namespace's ``lo`` up (a new namespace's is down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        flags = struct.unpack("16sh", fcntl.ioctl(sock, _SIOCGIFFLAGS, struct.pack("16sh", b"lo", 0)))[1]
        fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | _IFF_UP))


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the owner ends it by closing its stdin
    loopback_up()
    os.write(sys.stdout.fileno(), READY)
    while os.read(sys.stdin.fileno(), 4096):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
