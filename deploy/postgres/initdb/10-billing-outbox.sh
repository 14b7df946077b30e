#!/bin/sh
# Creates billing-outbox's own login role and database next to Temporal's.
#
# The postgres image runs the files in /docker-entrypoint-initdb.d once, when it initialises an
# empty data directory, and never again: changing BILLING_DB_PASSWORD afterwards needs
# `ALTER ROLE billing_outbox PASSWORD '…'` (docs/operations.md, "Credentials").
#
# The role owns only its database and is not a superuser; Temporal's databases (temporal,
# temporal_visibility) are created later by temporal-sql-tool as the server's superuser.
# The image may source this file instead of executing it, so it changes no shell option and never
# calls `exit`: a missing variable or a failing psql still stops the initialisation.

psql -v ON_ERROR_STOP=1 --no-psqlrc --username "$POSTGRES_USER" --dbname postgres \
  --set=role="${BILLING_DB_USER:?BILLING_DB_USER must be set}" \
  --set=password="${BILLING_DB_PASSWORD:?BILLING_DB_PASSWORD must be set}" \
  --set=database="${BILLING_DB_NAME:?BILLING_DB_NAME must be set}" <<'SQL'
CREATE ROLE :"role" LOGIN PASSWORD :'password';
CREATE DATABASE :"database" OWNER :"role";
-- Only the owner (and superusers) may connect.
REVOKE ALL ON DATABASE :"database" FROM PUBLIC;
SQL
