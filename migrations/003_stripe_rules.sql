-- Stripe's own rules (issue #4): one in-flight meter-event call per (customer, meter) across every
-- worker, asynchronous validation errors, and cancellations.

-- A short lease per (Stripe customer, meter event name), taken around each Stripe call. A lease
-- outlives neither the call (its length is the Stripe timeout plus a margin) nor a crashed worker.
CREATE TABLE meter_leases (
  stripe_customer_id text NOT NULL,
  event_name         text NOT NULL,
  holder             text NOT NULL,
  expires_at         timestamptz NOT NULL,
  PRIMARY KEY (stripe_customer_id, event_name)
);

-- Events Stripe answered 200 for and rejected later (v1.billing.meter.error_report_triggered), and
-- events cancelled with a meter event adjustment.
ALTER TABLE outbox DROP CONSTRAINT outbox_status_check;
ALTER TABLE outbox ADD CONSTRAINT outbox_status_check
  CHECK (status IN ('pending', 'claimed', 'dispatched', 'sent', 'dead', 'rejected_async', 'cancelled'));
ALTER TABLE outbox ADD COLUMN rejected_at timestamptz;
ALTER TABLE outbox ADD COLUMN cancelled_at timestamptz;
CREATE INDEX outbox_sent_at_idx ON outbox (sent_at) WHERE sent_at IS NOT NULL;

-- Each error-report webhook once, whatever Stripe's redeliveries (its event id is unique).
CREATE TABLE stripe_error_reports (
  event_id       text PRIMARY KEY,
  received_at    timestamptz NOT NULL DEFAULT now(),
  meter_id       text,
  matched        integer NOT NULL DEFAULT 0,
  unmatched      integer NOT NULL DEFAULT 0,
  error_count    integer NOT NULL DEFAULT 0,
  report         jsonb NOT NULL
);
