"""The appliance's client distribution (`appliance-client`): the Python client
(appliance_client.client), the tool adapters for model APIs (appliance_client.agents) and the
stdio MCP bridge (appliance_client.mcp_bridge, the `appliance-mcp` command).

It speaks the wire protocol (docs/protocol.md) and imports nothing of the server package
`appliance`; what it needs of the protocol it carries (appliance_client.protocol), checked
against the server's published schema by the tests.
"""

__version__ = "0.1.0"
