#!/bin/bash
# Entrypoint of the appliance images. Before `appliance serve` starts, check every privilege the
# jails need inside a container and, when one is missing, say exactly which flag adds it, then
# exit 78 (EX_CONFIG). The checks only explain; they do not replace the appliance's own fail-
# closed checks (host facts at startup, a self-check of every jail, the /readyz canary).
#
# Sourcing this file with APPLIANCE_ENTRYPOINT_LIB=1 defines the functions and runs nothing
# (tests/test_deploy.py drives them with crafted inputs).
set -euo pipefail

FIREJAIL=/usr/bin/firejail
SANDBOX_UID="${SANDBOX_UID:-1001}"
# Capabilities firejail (setuid root, started by the server as uid 1001) and the server itself
# (root: switches to uid 1001, owns run directories of uid 1001, kills jails) need, by bit.
#   SYS_ADMIN: mount, pivot/chroot the jail's filesystem, new mount/PID/user namespaces
#   NET_ADMIN: bring up the loopback of the jail's own network namespace (--net=none)
#   MKNOD: --private-dev creates the jail's /dev/null, /dev/zero, ... nodes (Docker's default
#   set has it; podman's and CRI-O's do not)
#   SETPCAP: firejail drops the jail's bounding set (prctl PR_CAPBSET_DROP, --caps.drop=all)
#   SYS_CHROOT, SETUID, SETGID, CHOWN, DAC_OVERRIDE, FOWNER, KILL: in Docker's default set; a
#   `--cap-drop ALL` (or a Kubernetes policy dropping ALL) takes them away, so they are checked.
REQUIRED_CAPS="21:SYS_ADMIN 12:NET_ADMIN 27:MKNOD 8:SETPCAP 18:SYS_CHROOT 7:SETUID 6:SETGID 0:CHOWN 1:DAC_OVERRIDE 3:FOWNER 5:KILL"
# The rlimits every jail sets (firejail --rlimit-nofile/--rlimit-nproc); without
# CAP_SYS_RESOURCE it can only lower them, so the container's hard limits must be at least these.
JAIL_NOFILE="${SANDBOX_MAX_OPEN_FILES:-1024}"
JAIL_NPROC="${SANDBOX_MAX_PROCS:-64}"

EX_CONFIG=78

# fail WHAT FIX: print why the container cannot serve and the exact flag that fixes it; exit.
fail() {
    printf 'appliance: cannot start: %s\n  fix: %s\n  (docs/deploy.md lists every privilege and why)\n' "$1" "$2" >&2
    exit "$EX_CONFIG"
}

# status_field NAME [FILE]: the value of NAME in /proc/self/status (or FILE).
status_field() {
    local name=$1 file=${2:-/proc/self/status} key value
    while IFS=$':\t ' read -r key value; do
        if [ "$key" = "$name" ]; then printf '%s\n' "$value"; return 0; fi
    done <"$file"
    return 1
}

# missing_caps HEXMASK: the required capabilities absent from a capability mask, one per line.
missing_caps() {
    local mask=$((16#$1)) entry bit
    for entry in $REQUIRED_CAPS; do
        bit=${entry%%:*}
        if (( (mask >> bit & 1) == 0 )); then printf 'CAP_%s\n' "${entry#*:}"; fi
    done
}

# check_uid UID
check_uid() {
    [ "$1" = 0 ] || fail "the server runs as uid $1; it must be root inside the container (it starts every jail as uid $SANDBOX_UID through the setuid firejail)" \
        "remove --user (compose: user:, Kubernetes: runAsUser/runAsNonRoot) so the image's root user is used"
}

# check_container_env VALUE: firejail inside a PID namespace runs the program with NO sandbox
# unless `container` names a container manager; the image sets container=docker.
check_container_env() {
    [ "$1" = docker ] || fail "the environment variable container is '${1}', not 'docker': firejail would treat the container's PID namespace as \"already sandboxed\"" \
        "do not override it (remove -e container=...; the image sets ENV container=docker)"
}

# check_no_new_privs VALUE: with no_new_privs the setuid firejail cannot gain root.
check_no_new_privs() {
    [ "$1" = 0 ] || fail "no_new_privs is set, so the setuid firejail cannot become root to build jails" \
        "remove --security-opt no-new-privileges (compose: security_opt no-new-privileges; Kubernetes: set allowPrivilegeEscalation: true)"
}

# check_caps HEXMASK: the bounding set is what the setuid firejail will hold.
check_caps() {
    local missing
    missing=$(missing_caps "$1")
    [ -z "$missing" ] && return 0
    local first=${missing%%$'\n'*}
    local flags="" name
    for name in $missing; do flags+=" --cap-add ${name#CAP_}"; done
    fail "missing capabilit$( [ "$first" = "$missing" ] && echo y || echo ies ): ${missing//$'\n'/ }" \
        "add${flags} (compose: cap_add; Kubernetes: securityContext.capabilities.add)"
}

# check_firejail PATH: present, owned by root, setuid, on a mount that honours setuid.
check_firejail() {
    local path=$1
    [ -x "$path" ] || fail "$path is missing" "use the published image unchanged (firejail is installed at build time)"
    [ "$(stat -c %u "$path")" = 0 ] && [ -u "$path" ] \
        || fail "$path is not setuid root" "rebuild the image or do not mount over /usr/bin"
    if findmnt -no OPTIONS -T "$path" 2>/dev/null | tr ',' '\n' | grep -qx nosuid; then
        fail "$path lies on a nosuid mount, so it cannot become root" "do not mount /usr (or /) with nosuid"
    fi
}

# check_namespaces SECCOMP_MODE: make each kind of namespace a jail uses, the way firejail does.
check_namespaces() {
    local mode=$1 flag err
    for flag in --mount --pid --net --uts --ipc --user; do
        if ! err=$(unshare "$flag" --fork true 2>&1); then
            if [ "$mode" = 2 ]; then
                fail "the seccomp profile forbids creating namespaces (unshare $flag: ${err##*: })" \
                    "--security-opt seccomp=/path/to/images/seccomp.json (Docker's default plus what firejail needs; or seccomp=unconfined)"
            fi
            fail "the host refuses new namespaces (unshare $flag: ${err##*: }); check user.max_user_namespaces and the LSM" \
                "sysctl user.max_user_namespaces=15000 on the host; on AppArmor hosts --security-opt apparmor=unconfined"
        fi
    done
}

# lsm_label: the AppArmor (or SELinux) label of this process, if any.
lsm_label() {
    local f
    for f in /proc/self/attr/apparmor/current /proc/self/attr/current; do
        if [ -r "$f" ]; then tr -d '\0' <"$f" 2>/dev/null && return 0; fi
    done
    return 0
}

# check_mount LABEL: firejail builds each jail's filesystem with mount(2); Docker's AppArmor
# profile (docker-default) denies every mount even with CAP_SYS_ADMIN.
check_mount() {
    local label=$1 err
    if ! err=$(unshare --mount --fork sh -c 'mount -t tmpfs appliance-probe /mnt && umount /mnt' 2>&1); then
        case "$label" in
            *docker-default*|*cri-containerd*|*"(enforce)"*)
                fail "the AppArmor profile '$label' forbids mount(2) (${err##*: })" \
                    "--security-opt apparmor=unconfined (Kubernetes: securityContext.appArmorProfile.type: Unconfined)" ;;
            *)
                fail "mount(2) is refused (${err##*: })" \
                    "--security-opt seccomp=/path/to/images/seccomp.json, and on SELinux hosts --security-opt label=disable" ;;
        esac
    fi
}

# check_mknod: do what --private-dev does: make a device node on a fresh tmpfs.
check_mknod() {
    local err
    if ! err=$(unshare --mount --fork sh -c 'mount -t tmpfs appliance-probe /mnt && mknod /mnt/zero c 1 5' 2>&1); then
        fail "creating a device node is refused (mknod: ${err##*: }); firejail --private-dev would fail with \"cannot create /dev/zero device\"" \
            "--cap-add MKNOD (podman and CRI-O leave it out by default), and a device cgroup that allows mknod (Docker's and podman's default do)"
    fi
}

# check_capbset_drop: do what --caps.drop=all does: drop from the bounding set (PR_CAPBSET_DROP).
check_capbset_drop() {
    local err
    # (Not setpriv --bounding-set: its libcap-ng skips the drop silently without CAP_SETPCAP.)
    if ! err=$(python3 -c '
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(24, 36, 0, 0, 0) != 0:  # PR_CAPBSET_DROP, CAP_BLOCK_SUSPEND (never needed)
    sys.exit("prctl(PR_CAPBSET_DROP): " + os.strerror(ctypes.get_errno()))' 2>&1); then
        fail "dropping capabilities from the bounding set is refused (${err##*: }); firejail --caps.drop=all would fail with PR_CAPBSET_DROP" \
            "--cap-add SETPCAP (it is in Docker's and podman's default set; add it back after --cap-drop ALL)"
    fi
}

# check_ulimits NOFILE_HARD NPROC_HARD: firejail sets each jail's rlimits and cannot raise a hard
# limit without CAP_SYS_RESOURCE.
check_ulimits() {
    local nofile=$1 nproc=$2
    if [ "$nofile" != unlimited ] && [ "$nofile" -lt "$JAIL_NOFILE" ]; then
        fail "the hard limit of open files is $nofile, below the $JAIL_NOFILE each jail is given (SANDBOX_MAX_OPEN_FILES)" \
            "--ulimit nofile=$JAIL_NOFILE:$JAIL_NOFILE or more (compose: ulimits; or lower SANDBOX_MAX_OPEN_FILES)"
    fi
    if [ "$nproc" != unlimited ] && [ "$nproc" -lt "$JAIL_NPROC" ]; then
        fail "the hard limit of processes is $nproc, below the $JAIL_NPROC each jail is given (SANDBOX_MAX_PROCS)" \
            "--ulimit nproc=$JAIL_NPROC:$JAIL_NPROC or more (compose: ulimits; or lower SANDBOX_MAX_PROCS)"
    fi
}

# check_all: every check, cheapest and most specific first, against this process's real state.
check_all() {
    check_uid "$(id -u)"
    check_container_env "${container:-}"
    check_no_new_privs "$(status_field NoNewPrivs)"
    check_caps "$(status_field CapBnd)"
    check_firejail "$FIREJAIL"
    check_namespaces "$(status_field Seccomp)"
    check_mount "$(lsm_label)"
    check_mknod
    check_capbset_drop
    check_ulimits "$(ulimit -Hn)" "$(ulimit -Hu)"
}

# Per-run cgroups (SANDBOX_CGROUPS, default auto): runtimes mount the container's own cgroup
# subtree read-only; with CAP_SYS_ADMIN (firejail's already) it is remounted read-write so the
# appliance can make a group per run inside it. Nothing above the container's group is visible.
cgroups_rw() {
    [ "${SANDBOX_CGROUPS:-auto}" = off ] && return 0
    awk '$5 ~ "^/sys/fs/cgroup" && $0 ~ / - cgroup2? / {print $5}' /proc/self/mountinfo |
        while read -r m; do mount -o remount,rw,bind "$m" 2>/dev/null || true; done
}

main() {
    if [ "${1:-}" = serve ]; then
        check_all
        cgroups_rw
    fi
    exec /opt/appliance/venv/bin/appliance "$@"
}

if [ "${APPLIANCE_ENTRYPOINT_LIB:-0}" != 1 ]; then
    main "$@"
fi
