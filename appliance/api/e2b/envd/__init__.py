"""envd's services, as the E2B SDK calls them on a sandbox's port 49983.

envd speaks Connect (connectrpc.com): unary calls as `application/proto` or
`application/json` bodies, server streams in 5-byte envelopes ending with an end-of-stream
message, errors as `{"code", "message"}` JSON. None of that framing is written here:

- the message types and the services' endpoint tables are the ones the SDK itself ships,
  generated from envd's .proto files (`e2b.envd.filesystem`, `e2b.envd.process`, of the
  pinned `e2b` package, a server dependency for this reason); `messages` is the one module
  that imports them, so the wire cannot drift from the SDK the tests run;
- the protocol is `connectrpc`'s server (Connect's maintained Python implementation, the
  one the SDK's client uses): its ASGI application decodes, encodes, frames, compresses and
  bounds messages; `connect` hands it aiohttp's requests and checks, before any body is
  read, that the request names a live sandbox with its own access token.

- `messages`: the generated message types and service applications, re-exported.
- `connect`: the aiohttp-to-Connect bridge, sandbox routing and auth.
- `paths`: E2B's /home/user and relative paths onto the jail's working directory; pure.
- `filesystem`: the Filesystem service (stat, list, make_dir, move, remove, watchers).
- `files`: the HTTP `/files` download and upload.
- `routes`: mounts each service under the E2B prefix.
"""
