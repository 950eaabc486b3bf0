#!/usr/bin/env python3
"""A stand-in for nvidia-smi on machines without a GPU, for the acceptance kit's simulation only.

It describes the simulated devices of `SANDBOX_GPU_SIMULATE` as nvidia-smi would describe
real ones: `--query-gpu=FIELDS --format=csv,noheader,nounits` prints one line per device
(UUID GPU-SIM-<i>, as the simulated backend names them), and `-i N -c MODE` sets a device's
compute mode, kept in the JSON file $STUB_SMI_STATE so that the kit's restore can be checked.
The same file may say {"driver": "535.54.03"} or {"mig": {"0": "Enabled"}} for the kit's
preflight checks to refuse.
"""

import json
import os
import sys

MODES = {
    "0": "Default",
    "DEFAULT": "Default",
    "3": "Exclusive_Process",
    "EXCLUSIVE_PROCESS": "Exclusive_Process",
    "2": "Prohibited",
    "PROHIBITED": "Prohibited",
}


def main(argv: list[str]) -> int:
    totals = [int(t) for t in os.environ.get("STUB_SMI_TOTALS", "16384").split(",")]
    path = os.environ.get("STUB_SMI_STATE")
    state = {}
    if path and os.path.exists(path):
        with open(path) as fh:
            state = json.load(fh)
    modes = state.setdefault("compute_mode", {})
    if "-c" in argv:
        index, mode = argv[argv.index("-i") + 1], argv[argv.index("-c") + 1].upper()
        if mode not in MODES or not index.isdigit() or int(index) >= len(totals):
            print(f"Invalid combination of input arguments: -i {index} -c {mode}", file=sys.stderr)
            return 2
        modes[index] = MODES[mode]
        if path:
            with open(path, "w") as fh:
                json.dump(state, fh)
        print(f"Set compute mode to {MODES[mode].upper()} for GPU {index}.")
        return 0
    query = next((a.split("=", 1)[1] for a in argv if a.startswith("--query-gpu=")), None)
    if query is None:
        print("stub nvidia-smi: only --query-gpu and -i N -c MODE", file=sys.stderr)
        return 2
    for i, total in enumerate(totals):
        values = {
            "index": str(i),
            "uuid": f"GPU-SIM-{i}",
            "name": "Simulated GPU",
            "memory.total": str(total),
            "driver_version": state.get("driver", "580.95.05"),
            "mig.mode.current": state.get("mig", {}).get(str(i), "Disabled"),
            "compute_mode": modes.get(str(i), "Default"),
        }
        print(", ".join(values[f] for f in query.split(",")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
