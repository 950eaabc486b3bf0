"""The wire: the client protocol's codec and typed frames, its schema and OpenAPI document, and
the parser child. Only `appliance.api` uses it."""
