#!/usr/bin/env python3
"""Copy a wheel without the shared libraries its build left at its top level (lib*.so*).

pywhispercpp's source build puts libwhisper.so.1 and its own libggml*.so.0 beside the
extension, at the top of site-packages. `auditwheel repair` keeps libraries that are already
in the wheel as they are, so those ggml libraries keep their SONAMEs, and once llama-cpp-python
(another ggml version, the same SONAMEs) is loaded, pywhispercpp is linked against llama's
ggml. Taken out of the wheel (and found through LD_LIBRARY_PATH instead), auditwheel grafts
them into pywhispercpp.libs/ under hashed names and rewrites the NEEDED entries, so each tool
runs on its own ggml. Used by images/cuda12/Dockerfile and scripts/ci-cuda-packaging.sh.

Usage: wheel_unbundle.py SRC.whl DST_DIR   (writes DST_DIR/<the same file name>)
"""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path

TOP_LEVEL_LIBRARY = re.compile(r"lib[^/]*\.so(\.[0-9]+)*")


def unbundle(src: Path, dst_dir: Path) -> list[str]:
    """Write dst_dir/src.name without top-level shared libraries; return the names removed."""
    dst_dir.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst_dir / src.name, "w", zipfile.ZIP_DEFLATED) as zout:
        removed = [name for name in zin.namelist() if TOP_LEVEL_LIBRARY.fullmatch(name)]
        for item in zin.infolist():
            if item.filename in removed:
                continue
            data = zin.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                # The RECORD must not list what is gone (auditwheel rewrites it afterwards).
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if line.split(",", 1)[0] not in removed).encode()
            zout.writestr(item, data)
    return removed


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    removed = unbundle(Path(sys.argv[1]), Path(sys.argv[2]))
    if not removed:
        print(f"{sys.argv[1]}: no top-level shared library to take out", file=sys.stderr)
        return 1
    print("taken out of the wheel:", " ".join(removed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
