-- The account-wide pace of Stripe work, shared by every worker: per bucket, the time of the next
-- free slot (a virtual-scheduling / GCRA limiter). See src/stripe/rate-limit.ts (its statement: src/outbox/sql/pace.ts).
CREATE TABLE rate_limits (
  bucket    text PRIMARY KEY,
  next_slot timestamptz NOT NULL DEFAULT now()
);
-- `stripe_calls`: every meter-event call. `dispatch`: how fast relays hand events to Temporal, so
-- a backlog waits in the outbox (cheap) rather than as thousands of waiting workflows.
INSERT INTO rate_limits (bucket) VALUES ('stripe_calls'), ('dispatch');
