#!/bin/sh
# Creates Temporal's two PostgreSQL databases if missing and migrates both to the schema version
# that ships with this admin-tools image. Run by the `temporal-schema` service before the server
# starts, with the same image version as the server.
#
# Safe to run on every `docker compose up`: `create` ignores an existing database, `setup-schema
# -v 0.0` does nothing once a database is past version 0.0, and `update-schema` applies only the
# versions not yet applied. Upgrading Temporal = raising both image tags together, one minor
# version at a time; this step then migrates the schema before the new server starts.
set -eu

: "${POSTGRES_SEEDS:?POSTGRES_SEEDS must name the PostgreSQL host}"
: "${POSTGRES_USER:?POSTGRES_USER must be set}"
: "${SQL_PASSWORD:?SQL_PASSWORD must be set}" # read by temporal-sql-tool itself, never on a command line
port="${DB_PORT:-5432}"
schema_root="${TEMPORAL_SCHEMA_DIR:-/etc/temporal/schema/postgresql/v12}" # where admin-tools keeps them

sql_tool() {
  temporal-sql-tool --plugin postgres12 --endpoint "$POSTGRES_SEEDS" --port "$port" --user "$POSTGRES_USER" "$@"
}

for pair in "${DBNAME:-temporal}:temporal" "${VISIBILITY_DBNAME:-temporal_visibility}:visibility"; do
  db="${pair%%:*}"
  dir="$schema_root/${pair#*:}/versioned"
  echo "temporal-schema: $db <- $dir"
  sql_tool --database "$db" create
  sql_tool --database "$db" setup-schema -v 0.0
  sql_tool --database "$db" update-schema -d "$dir"
done
echo "temporal-schema: done"
