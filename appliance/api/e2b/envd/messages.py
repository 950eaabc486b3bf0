"""envd's protobuf messages and Connect endpoint tables, as the pinned E2B SDK ships them.

They are generated from envd's own .proto files (filesystem/filesystem.proto and
process/process.proto) by protoc-gen-py and protoc-gen-connectrpc-py; depending on the
`e2b` package for them (rather than copying or regenerating them here) keeps the server's
wire the SDK's by construction. Everything of envd's schema the server uses is imported
from this module only.
"""

from __future__ import annotations

from e2b.envd.filesystem import filesystem_connect, filesystem_pb
from e2b.envd.process import process_connect, process_pb

__all__ = ["filesystem_connect", "filesystem_pb", "process_connect", "process_pb"]
