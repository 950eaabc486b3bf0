#!/opt/appliance/venv/bin/python
"""The images' health check: GET http://127.0.0.1:9100<path> (default /readyz), exit 0 on 200.

One argument-free-of-shell-syntax command for every runner: the Dockerfiles' HEALTHCHECK,
compose, and probes that `podman kube play` 4.3 rewrites (it word-splits an exec probe's
command and runs it through /bin/sh, which breaks an inline `python -c "..."`; it turns an
httpGet probe into curl, which the images lack).
"""

import sys
import urllib.request

PATH = sys.argv[1] if len(sys.argv) > 1 else "/readyz"

try:
    with urllib.request.urlopen(f"http://127.0.0.1:9100{PATH}", timeout=4) as response:
        sys.exit(0 if response.status == 200 else 1)
except OSError as exc:  # URLError, HTTPError (503 while not ready), timeouts
    print(f"{PATH}: {exc}", file=sys.stderr)
    sys.exit(1)
