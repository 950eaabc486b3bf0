# Helpers shared by CI's image scripts (sourced by scripts/ci-images.sh and scripts/ci-kube-play.sh).
# shellcheck shell=bash

# http_status PATH: the HTTP status of GET http://127.0.0.1:$PORT$PATH (000 when unreachable).
# Needs PY (a python) and PORT set by the caller.
http_status() {
    "$PY" - "$PORT" "$1" <<'PYEOF'
import sys, urllib.error, urllib.request
try:
    print(urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}{sys.argv[2]}", timeout=5).status)
except urllib.error.HTTPError as exc:
    print(exc.code)
except OSError:
    print("000")
PYEOF
}
