#!/bin/sh
# The first start makes the cluster with the user, password and database asked for.
set -e
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pw=$(mktemp)
  printf '%s' "$POSTGRES_PASSWORD" > "$pw"
  # UTF8, as the postgres image makes it (a minimal base has no locale: SQL_ASCII otherwise,
  # whose text psycopg hands back as bytes).
  initdb -D "$PGDATA" -U "$POSTGRES_USER" --pwfile="$pw" -A scram-sha-256 -E UTF8 \
    --locale=C.UTF-8 >/dev/null
  rm -f "$pw"
  echo "host all all 0.0.0.0/0 scram-sha-256" >> "$PGDATA/pg_hba.conf"
  pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
  PGPASSWORD="$POSTGRES_PASSWORD" createdb -U "$POSTGRES_USER" "$POSTGRES_DB"
  pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
fi
exec postgres -D "$PGDATA" -c listen_addresses='*'
