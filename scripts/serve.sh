#!/usr/bin/env bash
# `make run`: start the appliance as root with every SANDBOX_* setting of the caller.
#
#   scripts/serve.sh VENV [appliance serve options...]
#
# sudo's env_reset drops the caller's environment, SANDBOX_GPU and every other setting
# with it, so the settings travel as arguments of `env NAME=value` (the command sudo
# runs). Each is one argv entry built from a bash array: any value (spaces, quotes, `$`)
# arrives as it was, and nothing is parsed by a shell again. Only names of the form
# SANDBOX_[A-Z0-9_]+ are passed. SUDO overrides the sudo command (tests pass a fake one);
# as root, with SUDO unset or empty, no sudo is used.
set -euo pipefail
venv=${1:?usage: scripts/serve.sh VENV [serve options]}
shift
args=("SANDBOX_PYTHON=${SANDBOX_PYTHON:-$venv/bin/python}")
while IFS= read -r name; do
  [[ $name =~ ^SANDBOX_[A-Z0-9_]+$ ]] || continue
  [ "$name" = SANDBOX_PYTHON ] && continue
  args+=("$name=${!name}")
done < <(compgen -e)
sudo_cmd=${SUDO-sudo}
if [ -z "$sudo_cmd" ] || { [ "$(id -u)" = 0 ] && [ -z "${SUDO+set}" ]; }; then
  exec env "${args[@]}" "$venv/bin/appliance" serve "$@"
fi
exec $sudo_cmd env "${args[@]}" "$venv/bin/appliance" serve "$@"
