"""A loopback-only torch.distributed rendezvous store for SGLang's tensor-parallel scheduler ranks."""
from __future__ import annotations

import contextlib
import os


class LoopbackStore:
    """The rendezvous store of SGLang's scheduler ranks, hosted here on 127.0.0.1.

    Why: torch's TCPStore server (started by rank 0) listens on every interface whatever host it is given,
    an unauthenticated store open to the network. Here it is bound to loopback (master_listen_fd) and every
    rank joins as a client (SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE; TORCHELASTIC_USE_AGENT_STORE for rank
    0), the variables set only while the engine starts and only if the user has not set the override."""

    def __init__(self, world_size: int | None):
        self.server = None
        self.variables: dict[str, str] = {}
        if world_size is None:
            return
        import socket
        from datetime import timedelta

        from torch.distributed import TCPStore
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            sock.listen(128)
            port = sock.getsockname()[1]
            self.server = TCPStore("127.0.0.1", port, world_size, True, timedelta(seconds=600),
                                   wait_for_workers=False, master_listen_fd=sock.fileno())
            sock.detach()  # the store owns the descriptor now and closes it when it stops
        self.variables = {"SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE": f"tcp://127.0.0.1:{port}",
                          "TORCHELASTIC_USE_AGENT_STORE": "True",
                          # older torch reads it in the agent-store branch
                          "TORCHELASTIC_RESTART_COUNT": os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")}

    @classmethod
    def for_engine(cls, tp_size: int) -> LoopbackStore:
        user_set = "SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE" in os.environ
        return cls(None if user_set else tp_size)

    @contextlib.contextmanager
    def environment(self):
        saved = {k: os.environ.get(k) for k in self.variables}
        os.environ.update(self.variables)
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    def close(self) -> None:
        self.server = None  # the last reference: torch stops the server and closes its socket
