#!/usr/bin/env bash
# The services the tests run for real: a PostgreSQL server (Debian's postgresql package),
# which the tests start themselves in a temporary folder. Installed with apt-get where it
# is missing and this runs as root; otherwise says what to install.
set -euo pipefail
if ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "setup: installing Debian's postgresql for the PostgreSQL tests" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
else
  echo "setup: PostgreSQL's server is not installed; the PostgreSQL tests will be skipped" \
       "(install Debian's postgresql, or your system's PostgreSQL server, to run them)" >&2
fi
