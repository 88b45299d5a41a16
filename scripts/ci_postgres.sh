#!/usr/bin/env bash
# A throwaway PostgreSQL server for the multi-host search test (tests/dtune/cli/test_postgres.py).
#   bash scripts/ci_postgres.sh start   # prints the URL to export as DTUNE_TEST_PG_URL
#   bash scripts/ci_postgres.sh stop
# Uses the binaries of Debian's `postgresql` package (installed by .ci/run when missing), runs the server as the
# `postgres` user on port $PGPORT (default 55432) with its data in $PGDIR (default /tmp/dtune-ci-pg), trust
# authentication on localhost only, and one database, dtune_test.
set -euo pipefail
PGDIR=${PGDIR:-/tmp/dtune-ci-pg}
PGPORT=${PGPORT:-55432}
initdb_path=$(ls /usr/lib/postgresql/*/bin/initdb 2>/dev/null | sort -V | tail -1 || true)
[ -n "$initdb_path" ] || initdb_path=$(command -v initdb || true)
if [ -z "$initdb_path" ]; then
  echo "no PostgreSQL binaries: apt-get install postgresql" >&2
  exit 1
fi
BIN=$(dirname "$initdb_path")
as_postgres() {
  if [ "$(id -un)" = postgres ]; then sh -c "$1"
  elif [ "$(id -u)" -eq 0 ]; then su postgres -s /bin/sh -c "$1"
  else sudo -u postgres sh -c "$1"; fi
}
case "${1:-start}" in
  start)
    if [ ! -d "$PGDIR/data" ]; then
      mkdir -p "$PGDIR"
      chown postgres "$PGDIR" 2>/dev/null || true
      as_postgres "'$BIN/initdb' -D '$PGDIR/data' -A trust -U postgres" >/dev/null
    fi
    if ! as_postgres "'$BIN/pg_ctl' -D '$PGDIR/data' status" >/dev/null 2>&1; then
      as_postgres "'$BIN/pg_ctl' -D '$PGDIR/data' -o \"-p $PGPORT -k '$PGDIR' -c listen_addresses=localhost\" -l '$PGDIR/log' -w start" >/dev/null
    fi
    as_postgres "'$BIN/psql' -h localhost -p $PGPORT -U postgres -tAc \"SELECT 1 FROM pg_database WHERE datname = 'dtune_test'\"" | grep -q 1 \
      || as_postgres "'$BIN/createdb' -h localhost -p $PGPORT -U postgres dtune_test"
    echo "postgresql+psycopg2://postgres@localhost:$PGPORT/dtune_test"
    ;;
  stop)
    as_postgres "'$BIN/pg_ctl' -D '$PGDIR/data' -m fast stop" >/dev/null 2>&1 || true
    ;;
  *)
    echo "usage: $0 start|stop" >&2
    exit 2
    ;;
esac
