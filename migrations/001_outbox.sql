-- billing-outbox schema, version 1.
--
-- Three tables: who is billed (billing_customers), what the application did (usage_logs), and what
-- still has to reach Stripe (outbox). A usage row and its outbox row are always written in the same
-- transaction by recordUsage(), so a committed usage is always a queued event and vice versa.

CREATE TABLE billing_customers (
  tenant_id          text PRIMARY KEY CHECK (length(tenant_id) BETWEEN 1 AND 200),
  stripe_customer_id text NOT NULL CHECK (length(stripe_customer_id) BETWEEN 1 AND 255),
  created_at         timestamptz NOT NULL DEFAULT now(),
  updated_at         timestamptz NOT NULL DEFAULT now()
);

-- The application's own record of the work. `id` is chosen by the application (its request or job
-- id), which is what makes enqueueing the same usage twice a no-op.
CREATE TABLE usage_logs (
  id          text PRIMARY KEY CHECK (length(id) BETWEEN 1 AND 90),
  tenant_id   text NOT NULL REFERENCES billing_customers (tenant_id),
  event_name  text NOT NULL CHECK (length(event_name) BETWEEN 1 AND 100),
  quantity    bigint NOT NULL CHECK (quantity > 0),
  occurred_at timestamptz NOT NULL,
  created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE outbox (
  id                 bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  tenant_id          text NOT NULL REFERENCES billing_customers (tenant_id),
  event_name         text NOT NULL CHECK (length(event_name) BETWEEN 1 AND 100),
  quantity           bigint NOT NULL CHECK (quantity > 0),
  occurred_at        timestamptz NOT NULL,
  -- Stripe's meter event `identifier` and the Temporal workflow id (Stripe allows 100 characters).
  idempotency_key    text NOT NULL UNIQUE CHECK (length(idempotency_key) BETWEEN 1 AND 100),
  status             text NOT NULL DEFAULT 'pending'
                     CHECK (status IN ('pending', 'claimed', 'dispatched', 'sent', 'dead')),
  attempt_count      integer NOT NULL DEFAULT 0,
  last_error_code    text,
  last_error_message text,
  -- The relay lease: who claimed the row, which claim it was, and when the claim lapses.
  claimed_by          text,
  claim_id            uuid,
  processing_deadline timestamptz,
  workflow_id        text,
  -- First call to Stripe: bounds Stripe's 24-hour identifier dedup window.
  first_attempted_at timestamptz,
  created_at         timestamptz NOT NULL DEFAULT now(),
  dispatched_at      timestamptz,
  sent_at            timestamptz,
  dead_at            timestamptz,
  updated_at         timestamptz NOT NULL DEFAULT now(),
  CHECK (status <> 'claimed' OR (claim_id IS NOT NULL AND processing_deadline IS NOT NULL))
);

-- The relay's claim scans only rows that may still need a relay: once dispatched or sent a row
-- leaves this index, so the claim stays an index scan with millions of sent rows in the table.
CREATE INDEX outbox_claimable_idx ON outbox (id) WHERE status IN ('pending', 'claimed');
CREATE INDEX outbox_status_idx ON outbox (status) WHERE status <> 'sent';
CREATE INDEX outbox_tenant_idx ON outbox (tenant_id, id);

-- Wake idle relays as soon as events commit (NOTIFY is delivered at commit, and only then).
-- Statement-level, so a bulk insert sends one notification, not one per row. The channel is the
-- schema's own (src/outbox/sql/schema.ts `outboxChannel`), so that deployments in other schemas of
-- the database are not woken. It names no table, so it needs no search_path of its own.
CREATE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  PERFORM pg_notify(TG_TABLE_SCHEMA || ':outbox', '');
  RETURN NULL;
END;
$$;

CREATE TRIGGER outbox_notify_after_insert
  AFTER INSERT ON outbox
  FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify();
