#!/usr/bin/env bash
# Headless Chromium for the dashboard's screenshot test (tests/integration/test_dashboard_browser.py), from
# Debian's `chromium` package. Installs it only when it is missing and apt is usable (root).
# Never fails the caller: without a browser that test fails by itself and says what to do.
set -uo pipefail
for browser in chromium chromium-browser google-chrome; do
  command -v "$browser" >/dev/null 2>&1 && exit 0
done
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing chromium (Debian package) for the dashboard screenshot test..."
  export DEBIAN_FRONTEND=noninteractive
  # Try the package lists as they are first; refresh them only if that fails.
  if timeout 900 apt-get install -y -qq chromium >/dev/null 2>&1 \
     || { timeout 300 apt-get update -qq >/dev/null 2>&1 \
          && timeout 900 apt-get install -y -qq chromium >/dev/null 2>&1; }; then
    exit 0
  fi
fi
echo "warning: headless Chromium is missing and could not be installed here (needs root and apt);" \
     "tests/integration/test_dashboard_browser.py will fail until 'apt-get install -y chromium'" >&2
exit 0
