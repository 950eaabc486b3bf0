"""Hidden from the tests' servers (tests/support.py, `HIDDEN`): jsonschema, which the MCP SDK
imports, then leaves the `iri` formats unchecked, as it does on an installed appliance."""

raise ImportError("rfc3987_syntax is hidden from the tests' servers (tests/support.py)")
