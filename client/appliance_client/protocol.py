"""The protocol facts the client needs, carried here so that the client installs without the
server: the server's models (appliance.wire.protocol) publish them as docs/protocol.schema.json,
and tests/test_client_package.py checks that this copy agrees with that schema."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuRequest:
    """The GPU share a run asks for (only with SANDBOX_GPU=1): device memory, in MiB (at least 1)."""

    memory_mb: int

    def to_wire(self) -> dict[str, int]:
        """The `gpu` field of an execute frame."""
        return {"memory_mb": self.memory_mb}
