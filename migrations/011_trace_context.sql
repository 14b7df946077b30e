-- Version 11: the trace an event was recorded in. The commit ends the application's request, and
-- the relay claims the row later, in another process: the W3C traceparent written with the row is
-- what lets the relay's start, the usage workflow and the Stripe call join the request's trace.
-- Nullable, no default: adding it rewrites nothing, and rows recorded outside a trace keep null.
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS trace_parent text;
