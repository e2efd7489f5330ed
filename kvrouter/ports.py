"""Where servers that tests, tools and the simulator start on this host may bind.

`fixed_port_window` is the span below the kernel's ephemeral range: outgoing connections take their local ports
from that range, and a burst of them (thousands in TIME_WAIT after a fuzz or soak run) can leave no run of free
ports there, while nothing takes a port below it unasked.
"""

from __future__ import annotations

from pathlib import Path


def fixed_port_window() -> tuple[int, int]:
    """Ports for servers to bind: below the kernel's ephemeral range, whose ports outgoing connections take, so a
    burst of client connections (thousands in TIME_WAIT after a fuzz or soak run) cannot fill the window."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return (12000, low) if low >= 16000 else (20000, 60000)
