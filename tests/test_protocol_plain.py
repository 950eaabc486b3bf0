"""The plain execute path (`protocol._plain_execute`) gives exactly what full validation gives:
the same message for every frame it takes, and it takes no frame validation refuses."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest
from pydantic import ValidationError

from appliance.wire import protocol
from appliance.wire.protocol import ExecuteRequest, Limits

pytestmark = pytest.mark.fast

LIMITS = Limits(max_message_bytes=1 << 20, max_upload_bytes=1 << 20)
MISSING = object()
VALUES: dict[str, list[Any]] = {
    "id": [MISSING, None, "p1", "", "x" * 128, "x" * 129, "a\nb", "\ud800", 7, True, ["p"]],
    "code": [MISSING, "print(2+2)", "", "\ud800", "é", None, 3, b"x".decode(), ["c"]],
    "session": [MISSING, None, "new", "", "s-1", "é", "\ud800", 1, False],
    "timeout_ms": [MISSING, None, 1, 0, -5, 10**12, 1.0, "5", True],
    "stdin_eof": [MISSING, False, True, 0, 1, None, "true"],
    "memory_mb": [MISSING, None, 1, 0, 64, 2.5, False, "64"],
}


def full(obj: dict[str, Any]) -> ExecuteRequest | None:
    """What validation itself makes of obj, or None when it refuses it."""
    adapter = protocol._ADAPTERS["execute"]
    try:
        message: ExecuteRequest = adapter.validate_python(obj, context=LIMITS)
    except ValidationError:
        return None
    return message


def frames() -> list[dict[str, Any]]:
    """Every field alone at each of its values, and pairs of fields at a few values each."""
    out: list[dict[str, Any]] = []
    for name, values in VALUES.items():
        for value in values:
            obj: dict[str, Any] = {"type": "execute", "id": "p", "code": "print(1)"}
            if value is MISSING:
                obj.pop(name, None)
            else:
                obj[name] = value
            out.append(obj)
    for (a, va), (b, vb) in itertools.combinations(VALUES.items(), 2):
        for x, y in itertools.product(va[:4], vb[:4]):
            obj = {"code": "c"}
            for name, value in ((a, x), (b, y)):
                if value is not MISSING:
                    obj[name] = value
            out.append(obj)
    return out


def same(a: ExecuteRequest, b: ExecuteRequest, made_id: bool) -> bool:
    left, right = dataclasses.asdict(a), dataclasses.asdict(b)
    if made_id:  # a server-made id is random: both must be made ones
        assert left.pop("id").startswith("r-") and right.pop("id").startswith("r-")
    return left == right and list(vars(a)) == list(vars(b))


@pytest.mark.parametrize("obj", frames(), ids=repr)
def test_the_plain_path_agrees_with_validation(obj: dict[str, Any]) -> None:
    plain = protocol._plain_execute(obj)
    validated = full(obj)
    if plain is None:
        return  # left to validation, whatever it says
    assert validated is not None, "the plain path took a frame validation refuses"
    assert type(plain) is ExecuteRequest
    assert same(plain, validated, made_id=obj.get("id") is None)


def test_a_warm_runs_frame_takes_the_plain_path_and_the_rest_do_not() -> None:
    # What nearly every run sends is taken by the plain path (else the test above proves nothing).
    assert protocol._plain_execute({"type": "execute", "id": "p", "code": "x", "session": "new"})
    taken = sum(protocol._plain_execute(obj) is not None for obj in frames())
    assert taken > 50
    extras: list[dict[str, Any]] = [
        {"files": []},
        {"gpu": None},
        {"egress": None},
        {"from_snapshot": "s"},
        {"other": 1},
    ]
    for extra in extras:
        assert protocol._plain_execute({"code": "x", **extra}) is None
    # And the codec's own entry point hands out the same.
    message = protocol.parse_client_frame('{"type": "execute", "id": "p", "code": "x"}', LIMITS)
    assert isinstance(message, ExecuteRequest) and (message.id, message.code) == ("p", "x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        message.code = "y"
