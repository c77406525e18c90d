"""Whether TCP ports are free to listen on, as torchrun's store and train.py's process group
need them: `python -m scripts.ports 29631 29632` prints the first one taken and exits 1, so
a script says so before its run fails with a traceback in its log (two pairs or ablations
on one machine with the same ports); and free ones for runs started from Python (the
tests, peer_loss) so that they never collide on a fixed default."""
from __future__ import annotations

import random
import socket
import sys


def taken(port: int) -> bool:
    """Something listens on `port` (SO_REUSEADDR as the store sets it: a port only in
    TIME_WAIT after an earlier run is free)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return True
    return False


def free_ports(count: int = 1) -> int:
    """The first of `count` consecutive TCP ports free on this machine now: a run given
    one of its own does not collide with another run (or another test suite) on the
    fixed default its script or torchrun would take."""
    for _ in range(200):
        base = random.randint(20000, 60000 - count)
        if not any(taken(port) for port in range(base, base + count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports found")


def main(argv: list[str]) -> int:
    for port in argv:
        if taken(int(port)):
            print(port)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
