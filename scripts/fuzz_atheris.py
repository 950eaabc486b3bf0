"""Coverage-guided fuzzing of the protocol codec with atheris (a longer run than the suite's).

    .venv/bin/python scripts/fuzz_atheris.py -atheris_runs=2000000     # or -max_total_time=600

Any exception other than ProtocolError is a crash: atheris stops and writes the input.
"""

from __future__ import annotations

import contextlib
import sys

import atheris

with atheris.instrument_imports():
    from appliance.wire import protocol
    from appliance.wire.protocol import ProtocolError

LIMITS = protocol.Limits(max_message_bytes=65536, max_upload_bytes=4096)


def one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    as_text = fdp.ConsumeBool()
    body = fdp.ConsumeUnicode(len(data)) if as_text else fdp.ConsumeBytes(len(data))
    for frame in (body, b'{"code":' + data + b"}", b'{"code":"x","files":[{"path":' + data + b',"data":""}]}'):
        with contextlib.suppress(ProtocolError):
            protocol.parse_client_frame(frame, LIMITS)
        path = data.decode("utf-8", "surrogateescape")
        protocol.upload_path_problem(path)


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
