"""The OpenAPI description of the HTTP side (the WebSocket protocol is in the README)."""

from __future__ import annotations

from typing import Any

from appliance import __version__

_FRAME = {"type": "object", "description": "A server frame (start, stream, display, result, error, file, done)",
          "required": ["type", "id"], "properties": {"type": {"type": "string"}, "id": {"type": "string"}}}

SPEC: dict[str, Any] = {
    "openapi": "3.0.3",
    "info": {
        "title": "Appliance",
        "version": __version__,
        "description": "Jailed Python exec. WebSocket: GET /exec (protocol v1). This is the REST mirror.",
    },
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        "schemas": {
            "Execute": {
                "type": "object",
                "required": ["code"],
                "properties": {
                    "type": {"type": "string", "enum": ["execute"]},
                    "id": {"type": "string", "maxLength": 128},
                    "code": {"type": "string"},
                    "session": {"type": "string", "nullable": True},
                    "timeout_ms": {"type": "integer", "minimum": 1},
                    "files": {"type": "array", "items": {
                        "type": "object", "required": ["path", "data"],
                        "properties": {"path": {"type": "string"}, "data": {"type": "string", "format": "byte"}}}},
                    "gpu": {"type": "object", "properties": {"memory_mb": {"type": "integer", "minimum": 1}}},
                    "stdin_eof": {"type": "boolean"},
                },
            },
            "Frame": _FRAME,
            "Done": {"type": "object", "required": ["type", "id", "status"], "properties": {
                "type": {"type": "string", "enum": ["done"]}, "id": {"type": "string"},
                "status": {"type": "string", "enum": [
                    "ok", "error", "timeout", "memory_limit", "output_limit", "cancelled",
                    "gpu_memory_limit", "rejected", "busy", "internal"]},
                "exit_code": {"type": "integer", "nullable": True}, "message": {"type": "string", "nullable": True},
                "duration_ms": {"type": "integer"}, "session": {"type": "string"}}},
        },
    },
    "security": [{"bearer": []}],
    "paths": {
        "/v1/exec": {"post": {
            "summary": "Run code; streams the run's frames as NDJSON, ending with done",
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/Execute"}}}},
            "responses": {
                "200": {"description": "NDJSON frames", "content": {"application/x-ndjson": {
                    "schema": {"$ref": "#/components/schemas/Frame"}}}},
                "400": {"description": "rejected", "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/Done"}}}},
                "401": {"description": "missing or wrong bearer token"},
            }}},
        "/v1/sessions": {"post": {
            "summary": "Open a stateful session (optionally running code in it)",
            "requestBody": {"required": False, "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/Execute"}}}},
            "responses": {
                "201": {"description": "the session id and the frames of its first cell"},
                "400": {"description": "rejected"}, "429": {"description": "busy"},
                "401": {"description": "missing or wrong bearer token"},
            }}},
        "/v1/sessions/{session_id}": {"delete": {
            "summary": "End a session and its jail",
            "parameters": [{"name": "session_id", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"204": {"description": "closed"}, "404": {"description": "no such session"},
                          "401": {"description": "missing or wrong bearer token"}}}},
        "/healthz": {"get": {"summary": "The process is up", "security": [],
                             "responses": {"200": {"description": "ok"}}}},
        "/readyz": {"get": {"summary": "A canary run proved the jail", "security": [],
                            "responses": {"200": {"description": "ready"}, "503": {"description": "not ready"}}}},
        "/metrics": {"get": {"summary": "Prometheus metrics", "security": [],
                             "responses": {"200": {"description": "text exposition format"}}}},
    },
}
