"""Free TCP ports on 127.0.0.1 for the processes a test starts.

A port is free when the kernel hands it out for an ephemeral bind; ``free_ports`` keeps every
probe bound until all are picked, so the kernel cannot hand out the same port twice (a
``mooncake_master`` once got one port for two of its servers and failed to start).
"""

from __future__ import annotations

import contextlib
import socket

__all__ = ["free_port", "free_port_pair", "free_ports"]


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports."""
    with contextlib.ExitStack() as probes:
        ports = []
        for _ in range(count):
            probe = probes.enter_context(socket.socket())
            probe.bind(("127.0.0.1", 0))
            ports.append(int(probe.getsockname()[1]))
        return ports


def free_port() -> int:
    return free_ports(1)[0]


def free_port_pair() -> int:
    """A port P with P and P + 1 both free on 127.0.0.1."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return int(port)
    raise AssertionError("no two consecutive free ports")
