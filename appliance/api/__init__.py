"""The transports: WebSocket, REST and MCP over HTTP on one aiohttp app, with the auth and origin
middleware; each maps the wire to the core and back."""
