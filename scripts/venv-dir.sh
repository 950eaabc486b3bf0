#!/usr/bin/env bash
# Print where the virtualenv goes: ./.venv when uid 1001 can reach it (jailed code runs
# its python), else /opt/appliance/venv (a checkout in a private home cannot be reached).
set -euo pipefail
uid="${SANDBOX_UID:-1001}"
dir="$(pwd)"
while [ "$dir" != / ]; do
  owner=$(stat -c %u "$dir"); mode=$(stat -c %A "$dir")
  if [ "$owner" != "$uid" ] && [ "${mode:9:1}" != x ] && [ "${mode:9:1}" != t ]; then
    echo /opt/appliance/venv; exit 0
  fi
  dir=$(dirname "$dir")
done
echo "$(pwd)/.venv"
