#!/usr/bin/env bash
# Prepare this machine for tests/browser (run by `make test-browser`): a headless Chromium
# and its matching chromedriver, both from Debian (packages `chromium`, `chromium-driver`;
# Selenium drives them through /usr/bin/chromedriver and never downloads a browser or a
# driver). Installs them with apt-get when either is missing (needs root); otherwise does
# nothing. Idempotent, non-interactive, every step bounded by `timeout`.
#
# Exit status 77: they are missing and this machine cannot install them (not root, or apt
# failed); the browser tests then skip with the message printed last.
#
# Environment: QUEUED_CHROMIUM (default /usr/bin/chromium), QUEUED_CHROMEDRIVER (default
# /usr/bin/chromedriver): use browsers installed elsewhere.
set -euo pipefail

CHROMIUM=${QUEUED_CHROMIUM:-/usr/bin/chromium}
CHROMEDRIVER=${QUEUED_CHROMEDRIVER:-/usr/bin/chromedriver}
STATE=${QUEUED_BROWSER_STATE:-/var/tmp/queued-browser}

export DEBIAN_FRONTEND=noninteractive
log() { printf 'setup.sh: %s\n' "$*" >&2; }
cannot() { log "SKIP: $*"; exit 77; }

if [ -x "$CHROMIUM" ] && [ -x "$CHROMEDRIVER" ]; then
    log "$("$CHROMIUM" --version 2>/dev/null || echo "$CHROMIUM"), $("$CHROMEDRIVER" --version | cut -d' ' -f1-2)"
    exit 0
fi
[ "$(id -u)" -eq 0 ] || cannot "no $CHROMIUM / $CHROMEDRIVER and not root (apt-get install chromium chromium-driver)"
mkdir -p "$STATE"
t0=$SECONDS
log "apt-get install chromium chromium-driver (log: $STATE/apt.log) ..."
timeout 300 apt-get update -qq || log "apt-get update failed; trying the cached lists"
timeout 900 apt-get install -y -q --no-install-recommends chromium chromium-driver \
    fonts-dejavu-core >"$STATE/apt.log" 2>&1 || {
    tail -20 "$STATE/apt.log" >&2
    cannot "apt-get install chromium chromium-driver failed (see $STATE/apt.log)"
}
log "apt-get install: done in $((SECONDS - t0)) s"
[ -x "$CHROMIUM" ] && [ -x "$CHROMEDRIVER" ] || cannot "installed, but no $CHROMIUM / $CHROMEDRIVER"
log "$("$CHROMIUM" --version 2>/dev/null || true)"
