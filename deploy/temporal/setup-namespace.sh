#!/bin/sh
# One-shot setup of what billing-outbox needs inside Temporal, run by the `temporal-setup` service
# (temporalio/admin-tools image, busybox sh) after the server is up:
#   1. the namespace TEMPORAL_NAMESPACE, created with TEMPORAL_NAMESPACE_RETENTION if missing;
#   2. the custom search attributes OutboxStatus, TenantId and OutboxError (Keyword), registered if missing.
#      The worker sets both on every usage workflow (workflows/shared.ts); a start with an
#      unregistered attribute is refused, so workers must not start before this has finished.
#
# Idempotent: an existing namespace is left as it is (retention included), an existing attribute of
# the right type is skipped, and losing a race with a concurrent run counts as success. An
# attribute that exists with another type is an error: the worker could not use it.
#
# TEMPORAL_SETUP=skip ends it at once, for a namespace made elsewhere (Temporal Cloud).
#
# Usable outside compose too, against any Temporal with the `temporal` CLI on PATH:
#   TEMPORAL_ADDRESS=host:7233 TEMPORAL_NAMESPACE=billing sh deploy/temporal/setup-namespace.sh
set -eu

if [ "${TEMPORAL_SETUP:-}" = "skip" ]; then
  echo "temporal-setup: TEMPORAL_SETUP=skip: the namespace and its search attributes are managed elsewhere"
  exit 0
fi

address="${TEMPORAL_ADDRESS:-temporal:7233}"
namespace="${TEMPORAL_NAMESPACE:-default}"
retention="${TEMPORAL_NAMESPACE_RETENTION:-7d}"
wait_seconds="${SETUP_WAIT_SECONDS:-120}"
attributes="OutboxStatus TenantId OutboxError"

log() { echo "temporal-setup: $*"; }

# Like samples-server's setup: dial the IPv4 address of the server's name rather than the name.
host="${address%:*}"
port="${address##*:}"
ip="$(getent ahosts "$host" 2>/dev/null | awk '$2 == "STREAM" && $1 ~ /^[0-9.]+$/ { print $1; exit }')" || ip=""
[ -n "$ip" ] && address="$ip:$port"

t() { temporal "$@" --address "$address"; }

# Retries a command (quietly) until it succeeds or wait_seconds have passed.
retry() {
  deadline=$(( $(date +%s) + wait_seconds ))
  until "$@" >/dev/null 2>&1; do
    if [ "$(date +%s)" -ge "$deadline" ]; then
      log "gave up after ${wait_seconds}s: $*"
      "$@" # once more, loudly, so the error is in the log
      return 1
    fi
    sleep 2
  done
}

log "waiting for Temporal at $address ($host)"
retry t operator cluster health

created=""
if t operator namespace describe --namespace "$namespace" >/dev/null 2>&1; then
  log "namespace '$namespace' exists"
else
  log "creating namespace '$namespace' (retention $retention)"
  if ! t operator namespace create --namespace "$namespace" --retention "$retention"; then
    # Another run may have created it between our describe and create.
    retry t operator namespace describe --namespace "$namespace"
  fi
  created=yes
fi

# Prints the type of a custom search attribute of the namespace, nothing if it is not registered.
# The CLI prints "Keyword" (older versions: "INDEXED_VALUE_TYPE_KEYWORD").
attribute_type() {
  t operator search-attribute list --namespace "$namespace" | awk -v name="$1" '$1 == name { print $2 }'
}
is_keyword() {
  case "$1" in Keyword | KEYWORD | INDEXED_VALUE_TYPE_KEYWORD) return 0 ;; *) return 1 ;; esac
}
all_registered() {
  for name in $attributes; do
    is_keyword "$(attribute_type "$name")" || return 1
  done
}

# A namespace that was just created may not be listable for a few seconds.
retry t operator search-attribute list --namespace "$namespace"

for name in $attributes; do
  current="$(attribute_type "$name")"
  if [ -z "$current" ]; then
    log "registering search attribute $name (Keyword) in '$namespace'"
    if ! t operator search-attribute create --namespace "$namespace" --name "$name" --type Keyword; then
      current="$(attribute_type "$name")"
      is_keyword "$current" || { log "could not register $name"; exit 1; }
    fi
    created=yes
  elif is_keyword "$current"; then
    log "search attribute $name exists (Keyword)"
  else
    log "search attribute $name exists in '$namespace' with type $current; billing-outbox needs Keyword"
    exit 1
  fi
done

retry all_registered

if [ -n "$created" ]; then
  # Each Temporal service reads namespaces (and, on SQL visibility, their search-attribute aliases)
  # through a cache refreshed about every 10 s; give it one full refresh before workers start.
  sleep "${NAMESPACE_CACHE_WAIT_SECONDS:-15}"
fi
log "namespace '$namespace' ready with search attributes: $attributes"
