#!/usr/bin/env bash
# Prepare this machine for tests/docker/test_docker.py (run by `make test-docker`):
#
#   1. a docker CLI and a reachable dockerd: if none answers, install `docker.io` from Debian
#      (when missing) and start dockerd in the background with
#        --storage-driver=vfs --iptables=false --bridge=none
#      logging to $STATE/dockerd.log (the previous one: .log.1), pidfile $STATE/dockerd.pid.
#      It is left running for the next run; stop it with `kill $(cat $STATE/dockerd.pid)`.
#   2. the base image for the Dockerfile's BASE_IMAGE. Public registries are not reachable
#      here, so unless QUEUED_DOCKER_BASE_IMAGE names another image, queued-base:bookworm
#      is made from Debian packages: debootstrap (minbase, bookworm, python3, python3-venv,
#      python3-pip, ca-certificates), this machine's CA bundle copied in as PIP_CERT (pip in
#      the build trusts only that bundle here), `docker import`. An existing image is reused;
#      QUEUED_DOCKER_REBUILD_BASE=1 makes it again.
#
# Idempotent and non-interactive; every step is bounded by `timeout`. Exit status 77 means
# this machine cannot run dockerd at all: not root (and no dockerd answering), no
# CAP_SYS_ADMIN, or dockerd refused by the kernel (operation not permitted, cgroups, ...).
# The test then skips with the message printed last; any other failure is an error.
#
# Environment: QUEUED_DOCKER_STATE (default /var/tmp/queued-docker), QUEUED_DOCKERD_FLAGS
# (default above), QUEUED_DOCKER_BASE_IMAGE (default queued-base:bookworm: built here),
# QUEUED_DEBIAN_MIRROR (default http://deb.debian.org/debian), QUEUED_DOCKER_REBUILD_BASE.
set -euo pipefail

STATE=${QUEUED_DOCKER_STATE:-/var/tmp/queued-docker}
DOCKERD_FLAGS=${QUEUED_DOCKERD_FLAGS:---storage-driver=vfs --iptables=false --bridge=none}
LOCAL_BASE=queued-base:bookworm
BASE_IMAGE=${QUEUED_DOCKER_BASE_IMAGE:-$LOCAL_BASE}
MIRROR=${QUEUED_DEBIAN_MIRROR:-http://deb.debian.org/debian}
HOST_CA=/etc/ssl/certs/ca-certificates.crt
BASE_CA=/etc/ssl/certs/build-ca-bundle.crt  # where the local base image keeps HOST_CA

export DEBIAN_FRONTEND=noninteractive

log() { printf 'setup.sh: %s\n' "$*" >&2; }
cannot() { log "SKIP: $*"; exit 77; }   # this machine cannot run dockerd
die() { log "ERROR: $*"; exit 1; }
step_start() { STEP_T0=$SECONDS; log "$1 ..."; }
step_done() { log "$1: done in $((SECONDS - STEP_T0)) s"; }

mkdir -p "$STATE"
is_root() { [ "$(id -u)" -eq 0 ]; }
docker_ok() { timeout 20 docker info >/dev/null 2>&1; }

apt_install() {  # apt_install PACKAGE...: from Debian, no prompts, bounded
    is_root || return 1
    step_start "apt-get install $*"
    timeout 300 apt-get update -qq || log "apt-get update failed; trying the cached lists"
    timeout 600 apt-get install -y -q --no-install-recommends "$@" >"$STATE/apt.log" 2>&1 || {
        tail -20 "$STATE/apt.log" >&2
        return 1
    }
    step_done "apt-get install $*"
}

# -- 1. dockerd -------------------------------------------------------------------------------

if ! command -v docker >/dev/null || ! docker_ok; then
    if ! command -v dockerd >/dev/null || ! command -v docker >/dev/null; then
        is_root || cannot "no dockerd installed and not root (cannot install docker.io)"
        apt_install docker.io || die "could not install docker.io (see $STATE/apt.log)"
    fi
fi

has_cap_sys_admin() {  # bit 21 of the effective capabilities: mounts, namespaces
    local eff
    eff=$(awk '/^CapEff:/ {print $2}' /proc/self/status)
    (( (16#${eff:-0} >> 21) & 1 ))
}

if ! docker_ok; then
    is_root || cannot "no dockerd answers 'docker info' and not root (cannot start one)"
    has_cap_sys_admin || cannot "root without CAP_SYS_ADMIN (an unprivileged container?)"
    pidfile=$STATE/dockerd.pid
    if [ -s "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
        log "dockerd $(cat "$pidfile") from an earlier run is alive; waiting for it"
    else
        rm -f "$pidfile"
        [ ! -f "$STATE/dockerd.log" ] || mv "$STATE/dockerd.log" "$STATE/dockerd.log.1"
        step_start "starting dockerd $DOCKERD_FLAGS (log: $STATE/dockerd.log)"
        # setsid + nohup: it outlives this script and make; no stdin.
        # shellcheck disable=SC2086  # DOCKERD_FLAGS is a list of flags
        setsid nohup dockerd $DOCKERD_FLAGS --pidfile "$pidfile" \
            </dev/null >"$STATE/dockerd.log" 2>&1 &
        echo $! >"$STATE/dockerd.launch.pid"
    fi
    launched=$(cat "$STATE/dockerd.launch.pid" 2>/dev/null || echo)
    for _ in $(seq 1 60); do
        docker_ok && break
        if [ -n "$launched" ] && ! kill -0 "$launched" 2>/dev/null; then
            tail -15 "$STATE/dockerd.log" >&2
            why=$( { grep -E 'level=(fatal|error)|failed to start' "$STATE/dockerd.log" ||
                     grep -v '^\s*$' "$STATE/dockerd.log" || true; } | tail -1)
            # Refused by the kernel or the sandbox: this machine cannot run it. Anything
            # else (flags, a second dockerd on the same data root, ...) is an error.
            if grep -qiE 'operation not permitted|permission denied|not supported|no such device|cgroup' <<<"$why"; then
                cannot "dockerd exited at startup, refused by this machine: $why"
            fi
            die "dockerd exited at startup: $why"
        fi
        sleep 1
    done
    docker_ok || { tail -30 "$STATE/dockerd.log" >&2; die "dockerd did not answer within 60 s"; }
    step_done "starting dockerd"
fi
log "dockerd: $(docker version --format '{{.Server.Version}}, API {{.Server.APIVersion}}') "\
"(storage driver $(docker info --format '{{.Driver}}'))"

# -- 2. base image ----------------------------------------------------------------------------

if [ "$BASE_IMAGE" != "$LOCAL_BASE" ]; then
    log "base image $BASE_IMAGE (QUEUED_DOCKER_BASE_IMAGE): left to docker build"
    exit 0
fi
if [ "${QUEUED_DOCKER_REBUILD_BASE:-0}" != 1 ] && docker image inspect "$LOCAL_BASE" >/dev/null 2>&1; then
    log "base image $LOCAL_BASE exists; reusing it (QUEUED_DOCKER_REBUILD_BASE=1 remakes it)"
    exit 0
fi

is_root || die "debootstrap of $LOCAL_BASE needs root"
command -v debootstrap >/dev/null || apt_install debootstrap || die "could not install debootstrap"
[ -r "$HOST_CA" ] || die "no CA bundle at $HOST_CA"

rootfs=$(mktemp -d "$STATE/rootfs.XXXXXX")
chmod 0755 "$rootfs"  # it becomes the image's /: mktemp's 0700 would lock out non-root users
trap 'rm -rf --one-file-system "$rootfs"' EXIT

step_start "debootstrap bookworm from $MIRROR (log: $STATE/debootstrap.log)"
timeout 900 debootstrap --variant=minbase \
    --include=python3,python3-venv,python3-pip,ca-certificates \
    bookworm "$rootfs" "$MIRROR" >"$STATE/debootstrap.log" 2>&1 || {
    tail -20 "$STATE/debootstrap.log" >&2
    die "debootstrap failed"
}
step_done "debootstrap"

step_start "trimming and importing $LOCAL_BASE"
# What an image does not need: downloaded .debs, package lists, docs, man pages, locales.
rm -rf "${rootfs:?}"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
    "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
    "$rootfs"/usr/share/locale/*
cp "$HOST_CA" "$rootfs$BASE_CA"
tar --numeric-owner -C "$rootfs" -c . | timeout 300 docker import \
    --change "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
    --change "ENV LANG=C.UTF-8" \
    --change "ENV PIP_CERT=$BASE_CA" \
    --change "ENV PIP_DISABLE_PIP_VERSION_CHECK=1" \
    --change 'CMD ["python3"]' \
    --message "debootstrap bookworm minbase + python3, python3-venv, python3-pip, ca-certificates" \
    - "$LOCAL_BASE" >/dev/null
step_done "trimming and importing"
log "base image $LOCAL_BASE: $(docker image inspect --format '{{.Size}}' "$LOCAL_BASE" |
    awk '{printf "%.0f MB", $1 / 1e6}')"
