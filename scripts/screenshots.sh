#!/usr/bin/env bash
# `npm run screenshots`: the Temporal Web UI as an operator sees it, by headless Chromium, from a
# real `npm start` on embedded defaults (its own data folder, removed afterwards):
#   docs/img/web-ui-list.png          the workflow list: a delivered event and a dead letter, with
#                                     their summaries ("acme: 3 × api_requests at …")
#   docs/img/web-ui-dead-letters.png  the ready-made "dead letters" view the banner prints
#   docs/img/web-ui-dead-letter.png   a dead letter's page: its summary, and as current details
#                                     Stripe's code and message and the exact retry command
# Installs Chromium from Debian when it is missing and this runs as root. Not part of npm test.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

browser="$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)"
if [ -z "$browser" ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
    browser="$(command -v chromium)"
  else
    echo "screenshots: Chromium is needed (Debian: apt-get install chromium)" >&2
    exit 2
  fi
fi

data="$(mktemp -d "${TMPDIR:-/tmp}/billing-outbox-screens-XXXXXX")"
# Readable by the user embedded PostgreSQL runs as when this runs as root.
chmod 755 "$data"
log="$data/npm-start.log"
stop() {
  if [ -n "${pid:-}" ] && kill -0 "$pid" 2>/dev/null; then
    kill -INT -- "-$pid" 2>/dev/null || true
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  fi
  rm -rf "$data"
}
trap stop EXIT

export DATA_DIR="$data" API_PORT=0 LOG_LEVEL=warn
unset DATABASE_URL TEMPORAL_ADDRESS STRIPE_API_KEY STRIPE_API_BASE API_TOKENS NODE_ENV
setsid npm start >"$log" 2>&1 &
pid=$!
echo "screenshots: starting npm start (log: $log)"
for _ in $(seq 1 240); do
  grep -q 'billing-outbox is running' "$log" 2>/dev/null && [ -f "$data/endpoints.json" ] && break
  kill -0 "$pid" 2>/dev/null || { cat "$log" >&2; exit 1; }
  sleep 0.5
done
field() { node -e "process.stdout.write(String(require('$data/endpoints.json')['$1'] ?? ''))"; }
api="$(field api)"
ui="$(field temporalUi)"
token="$(cat "$data/api-token")"
[ -n "$ui" ] || { echo "screenshots: no Web UI (TEMPORAL_ADDRESS set?)" >&2; exit 1; }

post() {
  curl -sf "$api/v1/usage" -H "Authorization: Bearer $token" -H 'content-type: application/json' -d "$1" >/dev/null
}
post '{"tenant_id":"acme","usage_id":"first-1","quantity":3}'
# The README walkthrough's dead letter: the local Stripe refuses the next call with a 400, once the
# first event has had its call (the refusal goes to whichever call comes next).
for _ in $(seq 1 120); do
  npm run -s stripe -- events 2>/dev/null | grep -q 'u:acme:first-1' && break
  sleep 1
done
npm run -s stripe -- fail 1 400 >/dev/null
post '{"tenant_id":"acme","usage_id":"oops-1","quantity":5}'
dead=""
for _ in $(seq 1 120); do
  npm run -s cli -- dead 2>/dev/null | grep -q 'u:acme:oops-1' && { dead=1; break; }
  sleep 1
done
[ -n "$dead" ] || { echo "screenshots: u:acme:oops-1 never became a dead letter" >&2; exit 1; }

mkdir -p docs/img
npx tsx scripts/screenshots.ts "$browser" "$ui" default u:acme:oops-1 docs/img
