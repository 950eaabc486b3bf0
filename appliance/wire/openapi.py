"""The published descriptions of the wire, generated from the protocol's typed models.

- `frames_schema()`: a JSON Schema (2020-12) of every WebSocket frame, client and server.
  A copy is committed as `docs/protocol.schema.json` (a test fails when it is stale);
  regenerate it with `python -m appliance.wire.openapi > docs/protocol.schema.json`.
- `openapi_document()`: the OpenAPI 3.0.3 document of the HTTP side (`GET /openapi.json`),
  whose schemas are the same models. 3.0, not 3.1: the packaged Swagger UI (4.x) that
  `/docs` serves renders 3.0 only, so the JSON Schema is rewritten into OpenAPI's dialect.

Only the routes' prose and status codes are written here; every schema comes from
`appliance.wire.protocol`.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from pydantic import TypeAdapter

from appliance import __version__
from appliance.wire import protocol

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
_CLIENT = {cls.__name__: cls for cls in protocol.CLIENT_MESSAGES.values()}
_SERVER = {td.__name__: td for td in protocol.SERVER_FRAMES.values()}
_REST = {
    "SessionOpened": protocol.SessionOpened,
    "HttpError": protocol.HttpError,
    "Snapshot": protocol.Snapshot,
}


def _definitions(ref_template: str) -> dict[str, Any]:
    """Every model's schema, keyed by model name, with refs written by `ref_template`."""
    inputs: list[tuple[str, Any, TypeAdapter[Any]]] = [
        *((name, "validation", TypeAdapter(cls)) for name, cls in _CLIENT.items()),
        *((name, "serialization", TypeAdapter(td)) for name, td in (_SERVER | _REST).items()),
    ]
    top, defs = TypeAdapter.json_schemas(inputs, ref_template=ref_template)
    definitions: dict[str, Any] = dict(defs.get("$defs", {}))
    for (name, _mode), schema in top.items():
        if "$ref" not in schema:
            definitions[name] = schema
    for name in _CLIENT:
        if name != "ExecuteRequest":
            # `type` has a default in the Python classes (so they can be built without it),
            # but on the wire only `execute` may leave it out.
            required = definitions[name].setdefault("required", [])
            required.insert(0, "type")
    ref = ref_template.format(model="{}").format
    definitions["ClientFrame"] = {
        "description": "What a client sends: one JSON object per text frame. `type` defaults to `execute`.",
        "oneOf": [{"$ref": ref(name)} for name in _CLIENT],
    }
    definitions["ServerFrame"] = {
        "description": "What the server sends; `done` is always last for a request, exactly once.",
        "oneOf": [{"$ref": ref(name)} for name in _SERVER],
    }
    return definitions


@functools.cache
def frames_schema() -> dict[str, Any]:
    """The JSON Schema of the WebSocket frames (protocol v1)."""
    return {
        "$schema": JSON_SCHEMA_DIALECT,
        "title": "Appliance wire protocol v1",
        "description": (
            "The WebSocket frames of GET /exec, each one JSON object in a text frame. Generated "
            "from appliance.wire.protocol; the prose is docs/protocol.md. Fields are "
            "only ever added: a client should ignore fields it does not know."
        ),
        "oneOf": [{"$ref": "#/$defs/ClientFrame"}, {"$ref": "#/$defs/ServerFrame"}],
        "$defs": _definitions("#/$defs/{model}"),
    }


def render_frames_schema() -> str:
    """`frames_schema()` as committed in docs/protocol.schema.json."""
    return json.dumps(frames_schema(), indent=2, ensure_ascii=False) + "\n"


def _oas30(node: Any) -> Any:
    """Rewrite a JSON Schema (2020-12) node into OpenAPI 3.0's schema dialect."""
    if isinstance(node, list):
        return [_oas30(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _oas30(value) for key, value in node.items()}
    any_of = out.get("anyOf")
    if isinstance(any_of, list) and {"type": "null"} in any_of:
        rest = [s for s in any_of if s != {"type": "null"}]
        del out["anyOf"]
        if len(rest) == 1 and "$ref" not in rest[0]:
            out = {**rest[0], **out}
        else:  # 3.0 allows no siblings beside a $ref: wrap it
            out["allOf" if len(rest) == 1 else "anyOf"] = rest
        out["nullable"] = True
    if "const" in out:
        out["enum"] = [out.pop("const")]
    if out.pop("contentEncoding", None) == "base64":
        out["format"] = "byte"
    return out


def _json(schema: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}


_SESSION_ID = {"name": "session_id", "in": "path", "required": True, "schema": {"type": "string"}}
_SNAPSHOT_ID = {"name": "snapshot_id", "in": "path", "required": True, "schema": {"type": "string"}}
# A `busy` refusal (nothing ran) on any route: the queue, a quota or a rate limit is full.
_BUSY: dict[str, Any] = {
    "description": "busy: the run queue, a quota or a rate limit is full; nothing ran. The done "
    "frame's `retry_after_ms` says when to try again, and so does Retry-After (seconds)",
    "headers": {"Retry-After": {"schema": {"type": "integer", "minimum": 1}}},
    "content": _json("DoneFrame"),
}
_UNAUTHORIZED = {"description": "missing or wrong bearer token", "content": _json("HttpError")}
_NOT_JSON = {
    "description": "the body was not sent as Content-Type: application/json; nothing ran",
    "content": _json("DoneFrame"),
}


_MCP_SESSION = {
    "name": "Mcp-Session-Id",
    "in": "header",
    "required": False,
    "description": "the session id the initialize response gave (every request after it)",
    "schema": {"type": "string"},
}
_MCP_POST_EXAMPLE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-06-18",
        "capabilities": {},
        "clientInfo": {"name": "example", "version": "1"},
    },
}
# The Model Context Protocol's Streamable HTTP transport, whose messages are JSON-RPC 2.0
# defined by the MCP specification, not by this document: described here so that the route
# is discoverable, with the headers the transport needs.
_MCP_PATH: dict[str, Any] = {
    "post": {
        "summary": "MCP (Streamable HTTP): send one JSON-RPC message",
        "description": (
            "The tools run_python, close_session and list_models, and the files runs wrote as "
            "resources, over the Model Context Protocol. Send `Accept: application/json, "
            "text/event-stream`; the answer to a request is a JSON-RPC response, possibly as a "
            "server-sent event stream. Start with `initialize` and send the `Mcp-Session-Id` it "
            "returns on every later request."
        ),
        "parameters": [_MCP_SESSION],
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {
                    "schema": {"type": "object", "description": "a JSON-RPC 2.0 message"},
                    "example": _MCP_POST_EXAMPLE,
                }
            },
        },
        "responses": {
            "200": {
                "description": "the JSON-RPC response (as JSON or as an SSE stream)",
                "content": {
                    "application/json": {"schema": {"type": "object"}},
                    "text/event-stream": {"schema": {"type": "string"}},
                },
            },
            "202": {"description": "a notification or response was accepted"},
            "400": {"description": "not a JSON-RPC message, or no session id"},
            "401": _UNAUTHORIZED,
            "404": {"description": "no such MCP session (or another caller's)"},
            "406": {"description": "the Accept header does not name both content types"},
        },
    },
    "get": {
        "summary": "MCP (Streamable HTTP): open the server-to-client event stream of a session",
        "parameters": [_MCP_SESSION],
        "responses": {
            "200": {"description": "server-sent events", "content": {"text/event-stream": {}}},
            "401": _UNAUTHORIZED,
        },
    },
    "delete": {
        "summary": "MCP (Streamable HTTP): end a session (and its appliance session)",
        "parameters": [_MCP_SESSION],
        "responses": {
            "200": {"description": "ended"},
            "401": _UNAUTHORIZED,
            "404": {"description": "no such session"},
        },
    },
}


@functools.cache
def openapi_document() -> dict[str, Any]:
    """The OpenAPI document served at /openapi.json."""
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "Appliance",
            "version": __version__,
            "description": (
                "Jailed Python exec. The WebSocket at GET /exec speaks protocol v1 (ClientFrame in, "
                "ServerFrame out: see the schemas below); /v1 is its REST mirror, which takes the "
                "same execute frame and answers with the same frames."
            ),
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": _oas30(_definitions("#/components/schemas/{model}")),
        },
        "security": [{"bearer": []}],
        "paths": {
            "/exec": {
                "get": {
                    "summary": "Upgrade to a WebSocket speaking protocol v1",
                    "description": (
                        "Send ClientFrame objects, receive ServerFrame objects, one JSON object per text "
                        "frame. Several requests may share a connection, routed by `id`."
                    ),
                    "responses": {
                        "101": {"description": "switching to the WebSocket protocol"},
                        "401": _UNAUTHORIZED,
                    },
                }
            },
            "/v1/exec": {
                "post": {
                    "summary": "Run code; streams the run's frames as NDJSON, ending with done",
                    "requestBody": {"required": True, "content": _json("ExecuteRequest")},
                    "responses": {
                        "200": {
                            "description": "one ServerFrame per line, ending with done",
                            "content": {
                                "application/x-ndjson": {
                                    "schema": {"$ref": "#/components/schemas/ServerFrame"}
                                }
                            },
                        },
                        "400": {
                            "description": "rejected: nothing ran; `message` says why",
                            "content": _json("DoneFrame"),
                        },
                        "401": _UNAUTHORIZED,
                        "415": _NOT_JSON,
                        "429": _BUSY,
                    },
                }
            },
            "/v1/sessions": {
                "post": {
                    "summary": "Open a stateful session (optionally running code in it; `from_snapshot`: "
                    "restored from a snapshot, a fork)",
                    "requestBody": {"required": False, "content": _json("ExecuteRequest")},
                    "responses": {
                        "201": {
                            "description": "the session id and the frames of its first cell",
                            "content": _json("SessionOpened"),
                        },
                        "400": {"description": "rejected", "content": _json("DoneFrame")},
                        "429": _BUSY,
                        "500": {"description": "the appliance failed", "content": _json("DoneFrame")},
                        "401": _UNAUTHORIZED,
                        "415": _NOT_JSON,
                    },
                }
            },
            "/v1/sessions/{session_id}": {
                "delete": {
                    "summary": "End a session and its jail",
                    "parameters": [
                        {"name": "session_id", "in": "path", "required": True, "schema": {"type": "string"}}
                    ],
                    "responses": {
                        "204": {"description": "closed"},
                        "404": {"description": "no such session", "content": _json("HttpError")},
                        "401": _UNAUTHORIZED,
                    },
                }
            },
            "/v1/sessions/{session_id}/snapshot": {
                "post": {
                    "summary": "Keep the session's state (its files and the globals that pickle) as a snapshot",
                    "description": (
                        "What does not pickle (locks, sockets, threads, open files, generators) is named "
                        "in `skipped`. The session goes on. Needs SANDBOX_SNAPSHOT_DIR."
                    ),
                    "parameters": [_SESSION_ID],
                    "responses": {
                        "201": {"description": "kept", "content": _json("Snapshot")},
                        "400": {
                            "description": "rejected (over a quota, snapshots off)",
                            "content": _json("HttpError"),
                        },
                        "404": {"description": "no such session", "content": _json("HttpError")},
                        "422": {
                            "description": "the jail could not write it within the cell's limits",
                            "content": _json("HttpError"),
                        },
                        "429": {
                            "description": "busy; Retry-After (seconds) says when to try again",
                            "headers": _BUSY["headers"],
                            "content": _json("HttpError"),
                        },
                        "401": _UNAUTHORIZED,
                        "415": _NOT_JSON,
                    },
                }
            },
            "/v1/snapshots/{snapshot_id}": {
                "get": {
                    "summary": "A snapshot of this tenant's",
                    "parameters": [_SNAPSHOT_ID],
                    "responses": {
                        "200": {"description": "the snapshot", "content": _json("Snapshot")},
                        "404": {"description": "no such snapshot", "content": _json("HttpError")},
                        "401": _UNAUTHORIZED,
                    },
                },
                "delete": {
                    "summary": "Delete a snapshot of this tenant's",
                    "parameters": [_SNAPSHOT_ID],
                    "responses": {
                        "204": {"description": "deleted"},
                        "404": {"description": "no such snapshot", "content": _json("HttpError")},
                        "401": _UNAUTHORIZED,
                    },
                },
            },
            "/v1/models": {
                "get": {
                    "summary": "The model catalogue: what SANDBOX_MODELS_DIR holds, read from the headers",
                    "responses": {
                        "200": {
                            "description": "`models_dir` (null without one) and `models`: name, kind "
                            "(llm | whisper), file_bytes, architecture, quantisation, "
                            "parameters, gpu_mb_full_offload, error",
                            "content": {"application/json": {"schema": {"type": "object"}}},
                        },
                        "401": _UNAUTHORIZED,
                    },
                }
            },
            "/v1/runs/{run}/frames": {
                "get": {
                    "summary": "Follow a run again: its kept frames after a seq, then the live ones, "
                    "as NDJSON, ending with done",
                    "description": (
                        "A run's frames are kept while it runs and SANDBOX_REATTACH_S after its done, "
                        "each carrying `seq`; a run goes on when the client that started it goes. "
                        "The same as the WebSocket's `attach` frame."
                    ),
                    "parameters": [
                        {
                            "name": "run",
                            "in": "path",
                            "required": True,
                            "description": "a start frame's `run`",
                            "schema": {"type": "string"},
                        },
                        {
                            "name": "after",
                            "in": "query",
                            "required": False,
                            "description": "the last seq the client has; -1 (the default): from the first frame",
                            "schema": {"type": "integer", "minimum": -1, "default": -1},
                        },
                    ],
                    "responses": {
                        "200": {
                            "description": "one ServerFrame per line, ending with done",
                            "content": {
                                "application/x-ndjson": {
                                    "schema": {"$ref": "#/components/schemas/ServerFrame"}
                                }
                            },
                        },
                        "400": {"description": "`after` is not an integer", "content": _json("DoneFrame")},
                        "404": {
                            "description": "no such run: unknown, expired or another tenant's (one answer for all)",
                            "content": _json("DoneFrame"),
                        },
                        "401": _UNAUTHORIZED,
                    },
                }
            },
            "/mcp": _MCP_PATH,
            "/healthz": {
                "get": {
                    "summary": "The process is up",
                    "security": [],
                    "responses": {"200": {"description": "ok"}},
                }
            },
            "/readyz": {
                "get": {
                    "summary": "A canary run proved the jail",
                    "security": [],
                    "responses": {
                        "200": {"description": "ready"},
                        "503": {"description": "not ready; `problems` says why"},
                    },
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "description": (
                        "Needs a bearer token when tokens are configured; only "
                        "SANDBOX_METRICS_TOKEN when that is set."
                    ),
                    "responses": {"200": {"description": "text exposition format"}, "401": _UNAUTHORIZED},
                }
            },
            "/openapi.json": {
                "get": {
                    "summary": "This document",
                    "security": [],
                    "responses": {"200": {"description": "OpenAPI 3.0.3"}},
                }
            },
            "/docs": {
                "get": {
                    "summary": "This document, rendered (Swagger UI, served from the package); "
                    "`/docs/` redirects here",
                    "security": [],
                    "responses": {"200": {"description": "an HTML page"}},
                }
            },
        },
    }


if __name__ == "__main__":
    print(render_frames_schema(), end="")
