#!/bin/sh
# Debian's chromium for the page tests (`make install-test` runs this): installed where this user can
# (root with apt-get), else one line saying why not; the page tests then skip with the same reason.
# A browser is never downloaded any other way. ATTNSCOPE_CHROMIUM names another executable instead.
chromium=${ATTNSCOPE_CHROMIUM:-/usr/bin/chromium}
if [ -x "$chromium" ]; then
    exit 0
elif [ -n "$ATTNSCOPE_CHROMIUM" ]; then
    echo "chromium: ATTNSCOPE_CHROMIUM=$chromium is not an executable; the page tests will skip"
elif [ "$(id -u)" != 0 ]; then
    echo "chromium: not installed and not root, so not installed here (as root: apt-get install -y chromium); the page tests will skip"
elif ! command -v apt-get >/dev/null 2>&1; then
    echo "chromium: not installed and no apt-get here (install Debian's chromium or set ATTNSCOPE_CHROMIUM); the page tests will skip"
elif ! { apt-get update -qq && apt-get install -y -qq chromium; } >/tmp/attnscope-chromium-install.log 2>&1; then
    echo "chromium: apt-get install chromium failed (log: /tmp/attnscope-chromium-install.log); the page tests will skip"
fi
exit 0  # a missing browser never fails the install: the page tests skip and say why
