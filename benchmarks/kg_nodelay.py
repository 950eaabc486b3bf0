"""Start Jupyter Kernel Gateway with TCP_NODELAY on every TCP stream it serves.

Tornado (which Kernel Gateway and jupyter_server run on) leaves Nagle's algorithm on
for WebSocket connections unless a handler calls `set_nodelay(True)`, and neither
jupyter_server's channels handler nor Kernel Gateway does. A Jupyter reply is several
small frames (status busy, stream, execute_reply, status idle); with Nagle on, the
later ones wait for the client's delayed ACK, and the baseline would measure
Nagle's ~40 ms instead of the kernel. Tornado's HTTP/1 connection also switches it
back off after each response (the upgrade included), so it is forced on for good:
on at creation, and every later `set_nodelay(False)` is ignored. `benchmarks.jupyter`
reads the option back from the live socket.

    python -m benchmarks.kg_nodelay --KernelGatewayApp.port=8888 ...
"""

from __future__ import annotations

from typing import Any

import tornado.iostream


def enable_nodelay() -> None:
    """Make every tornado IOStream on a TCP socket keep TCP_NODELAY on, from its creation."""
    original_init = tornado.iostream.IOStream.__init__
    original_set = tornado.iostream.IOStream.set_nodelay

    def init(self: tornado.iostream.IOStream, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        original_set(self, True)

    def set_nodelay(self: tornado.iostream.IOStream, value: bool) -> None:
        original_set(self, True)

    tornado.iostream.IOStream.__init__ = init  # type: ignore[method-assign]
    tornado.iostream.IOStream.set_nodelay = set_nodelay  # type: ignore[method-assign]


if __name__ == "__main__":
    enable_nodelay()
    from kernel_gateway import launch_instance

    launch_instance()
