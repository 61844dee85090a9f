#!/usr/bin/env bash
# System tools some tests drive for real: Debian's chromium for the report's browser test.
# Installed with apt-get when missing and we may (root); otherwise the test skips, loudly.
set -uo pipefail
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing Debian's chromium for the report's browser test (apt-get)..."
  export DEBIAN_FRONTEND=noninteractive
  { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; } \
    || echo "WARNING: could not install chromium; the browser test will be skipped"
else
  echo "WARNING: chromium is missing and this is not root: the report's browser test will be skipped" \
       "(apt-get install chromium to run it)"
fi
exit 0
