#!/usr/bin/env bash
# docker-compose v1.29 (Debian package `docker-compose`) for tests/e2e/test_compose.py, which only
# validates docker-compose.yml (`docker-compose config -q`); no Docker engine is needed.
# Installs it only when it is missing and apt is usable (root, or sudo without a password).
# Never fails the caller: without it that test fails by itself and says what to do.
set -uo pipefail
command -v docker-compose >/dev/null 2>&1 && exit 0
SUDO=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
  else
    SUDO="none"
  fi
fi
if [ "$SUDO" != none ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing docker-compose (Debian package) to validate docker-compose.yml..."
  export DEBIAN_FRONTEND=noninteractive
  # Try the package lists as they are first; refresh them only if that fails.
  if timeout 600 $SUDO apt-get install -y -qq docker-compose >/dev/null 2>&1 \
     || { timeout 300 $SUDO apt-get update -qq >/dev/null 2>&1 \
          && timeout 600 $SUDO apt-get install -y -qq docker-compose >/dev/null 2>&1; }; then
    exit 0
  fi
fi
echo "warning: docker-compose is missing and could not be installed here (needs root or sudo, and apt);" \
     "tests/e2e/test_compose.py will fail until 'apt-get install -y docker-compose'" >&2
exit 0
