"""``python -m speech_assets.train.local_torchrun [torchrun options] -m MODULE ...``: torchrun for
one node whose rendezvous listens on 127.0.0.1 only.

``torchrun --standalone`` hosts its rendezvous store (whose agents unpickle what they read from it)
on every interface. Here the ``loopback`` backend hands the store a socket already bound to
127.0.0.1 and gloo and NCCL talk over loopback; each rendezvous round gets a fresh store, so a
restarted group never reads the last one's keys.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys

import psutil
from torch.distributed import PrefixStore, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)

BACKEND = "loopback"
LOOPBACK = "127.0.0.1"
TIMEOUT = datetime.timedelta(seconds=600)


class LoopbackRendezvous(RendezvousHandler):
    """A rendezvous of one node with itself, on a store bound to 127.0.0.1."""

    def __init__(self, params: RendezvousParameters) -> None:
        if params.max_nodes != 1:
            raise ValueError(f"the {BACKEND} rendezvous is for one node (--nnodes 1), got {params.max_nodes}")
        self.run_id = params.run_id
        self.store: TCPStore | None = None

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True  # workers connect to this store; none of them serves one

    def next_rendezvous(self) -> RendezvousInfo:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((LOOPBACK, 0))
        listener.listen(128)
        port = listener.getsockname()[1]
        # the store owns the socket from here on (and closes it with the store it replaces)
        self.store = TCPStore(LOOPBACK, port, 1, True, TIMEOUT, multi_tenant=True, master_listen_fd=listener.detach())
        return RendezvousInfo(PrefixStore(self.run_id, self.store), 0, 1, RendezvousStoreInfo(LOOPBACK, port))

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        return True


def main(argv: list[str]) -> None:
    interface = next(  # the one holding 127.0.0.1: lo on Linux, lo0 on macOS
        (
            name
            for name, addresses in psutil.net_if_addrs().items()
            if any(address.family == socket.AF_INET and address.address == LOOPBACK for address in addresses)
        ),
        None,
    )
    if interface:  # unless the user chose otherwise: collectives between this node's processes stay on it
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
    rendezvous_handler_registry.register(BACKEND, LoopbackRendezvous)
    from torch.distributed.run import main as torchrun

    torchrun(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
