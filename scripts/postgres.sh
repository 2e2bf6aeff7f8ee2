#!/usr/bin/env bash
# A throw-away PostgreSQL cluster in a folder, for trying the Prefect server on PostgreSQL:
#   scripts/postgres.sh start     initdb (first time) + pg_ctl start + createdb; prints the URL
#   scripts/postgres.sh url       postgresql+asyncpg://prefect@127.0.0.1:PORT/prefect
#   scripts/postgres.sh stop      pg_ctl stop (the data folder stays; delete it to start over)
#   scripts/postgres.sh status | bin
#   scripts/postgres.sh install   apt-get install postgresql when no server binaries are found (root, Debian);
#                                 ./scripts/test.sh runs it, as the default suite has tests on PostgreSQL
#   eagle3 server start --database "$(scripts/postgres.sh url)"
# Binaries: Debian's `postgresql` package (apt-get install -y postgresql), found under /usr/lib/postgresql/N/bin,
# or on PATH, or in $EAGLE3_PG_BIN. Folder: $EAGLE3_PG_DIR (default runs/.postgres), port: $EAGLE3_PG_PORT
# (default 55432). It listens on 127.0.0.1 only, with trust authentication: for trying things on one machine,
# not for a shared server. PostgreSQL refuses to run as root, so as root every server-side command runs as the
# `postgres` user (created by the Debian package) and the folder is handed to it.
set -euo pipefail

PGDIR=${EAGLE3_PG_DIR:-runs/.postgres}
PORT=${EAGLE3_PG_PORT:-55432}
DB_USER=prefect
DB_NAME=prefect

die() { echo "postgres.sh: $1" >&2; exit "${2:-1}"; }

find_bin() {
  if [[ -n ${EAGLE3_PG_BIN:-} ]]; then
    [[ -x $EAGLE3_PG_BIN/initdb && -x $EAGLE3_PG_BIN/pg_ctl ]] || die "EAGLE3_PG_BIN=$EAGLE3_PG_BIN has no initdb/pg_ctl" 3
    echo "$EAGLE3_PG_BIN"; return
  fi
  local newest
  newest=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
  if [[ -n $newest && -x $newest/initdb ]]; then echo "$newest"; return; fi
  if command -v initdb >/dev/null && command -v pg_ctl >/dev/null; then dirname "$(command -v initdb)"; return; fi
  die "no PostgreSQL server binaries (initdb, pg_ctl): apt-get install -y postgresql, or set EAGLE3_PG_BIN" 3
}

# as_server CMD...: run a server-side command (initdb, pg_ctl) as an unprivileged user
as_server() {
  if [[ $(id -u) -eq 0 ]]; then
    id postgres >/dev/null 2>&1 || die "running as root needs the 'postgres' user (Debian's postgresql package makes it)"
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

# install: nothing when binaries are found; as root with apt-get, Debian's package (it also makes the `postgres`
# user that as_server needs); otherwise a warning, and the tests on PostgreSQL fail saying the same.
install() {
  if [[ -n ${EAGLE3_PG_BIN:-} ]] || find_bin >/dev/null 2>&1; then find_bin >/dev/null; return; fi
  if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
    echo "postgres.sh: no PostgreSQL server binaries and no way to install them here (needs root and apt-get):" \
      "install PostgreSQL or set EAGLE3_PG_BIN; the tests marked postgres will fail" >&2
    return 0
  fi
  echo "postgres.sh: installing Debian's postgresql package (one time)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null || die "apt-get update failed"
  apt-get install -y -qq --no-install-recommends postgresql >/dev/null || die "apt-get install postgresql failed"
  find_bin >/dev/null
}

url() { echo "postgresql+asyncpg://${DB_USER}@127.0.0.1:${PORT}/${DB_NAME}"; }

start() {
  local bin; bin=$(find_bin)
  mkdir -p "$PGDIR"
  PGDIR=$(cd "$PGDIR" && pwd)
  if [[ $(id -u) -eq 0 ]]; then
    chown postgres: "$PGDIR"
    runuser -u postgres -- test -x "$PGDIR" ||
      die "user postgres cannot enter $PGDIR (a parent folder is private); pick another EAGLE3_PG_DIR"
  fi
  if [[ ! -f $PGDIR/data/PG_VERSION ]]; then
    as_server "$bin/initdb" -D "$PGDIR/data" -U "$DB_USER" --auth=trust -E UTF8 --locale=C.UTF-8 >"$PGDIR/initdb.log" ||
      die "initdb failed; see $PGDIR/initdb.log"
  fi
  if ! as_server "$bin/pg_ctl" -D "$PGDIR/data" status >/dev/null 2>&1; then
    # -k: the socket in the folder (not /var/run/postgresql); TCP on 127.0.0.1 only
    as_server "$bin/pg_ctl" -D "$PGDIR/data" -l "$PGDIR/postgres.log" -w \
      -o "-p $PORT -c listen_addresses=127.0.0.1 -k $PGDIR" start >/dev/null ||
      die "pg_ctl start failed (port $PORT taken? see $PGDIR/postgres.log)"
  fi
  if ! "$bin/psql" -h 127.0.0.1 -p "$PORT" -U "$DB_USER" -d postgres -Atc \
      "select 1 from pg_database where datname='$DB_NAME'" | grep -q 1; then
    "$bin/createdb" -h 127.0.0.1 -p "$PORT" -U "$DB_USER" "$DB_NAME"
  fi
  url
}

stop() {
  local bin; bin=$(find_bin)
  [[ -f $PGDIR/data/PG_VERSION ]] || { echo "no cluster in $PGDIR"; return 0; }
  if as_server "$bin/pg_ctl" -D "$PGDIR/data" status >/dev/null 2>&1; then
    as_server "$bin/pg_ctl" -D "$PGDIR/data" -m fast -w stop >/dev/null && echo "stopped"
  else
    echo "not running"
  fi
}

status() {
  local bin; bin=$(find_bin)
  [[ -f $PGDIR/data/PG_VERSION ]] || { echo "no cluster in $PGDIR"; return 3; }
  as_server "$bin/pg_ctl" -D "$PGDIR/data" status
}

case ${1:-} in
  start) start ;;
  stop) stop ;;
  url) url ;;
  status) status ;;
  bin) find_bin ;;
  install) install ;;
  *) die "usage: $0 start|stop|url|status|bin|install" 2 ;;
esac
