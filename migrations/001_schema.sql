-- billing-outbox schema.
--
-- Who is billed (billing_customers), what the application did (usage_logs), and what still has to
-- reach Stripe (outbox); beside them what the pipeline shares between workers (Stripe's rules: the
-- meter leases and their queues, the rate limits) and what operators and Stripe told it
-- (operator_actions, stripe_error_reports). A usage row and its outbox row are always written in
-- the same transaction by recordUsage(), so a committed usage is always a queued event and vice
-- versa.

CREATE TABLE billing_customers (
  tenant_id          text PRIMARY KEY CHECK (length(tenant_id) BETWEEN 1 AND 200),
  stripe_customer_id text NOT NULL CHECK (length(stripe_customer_id) BETWEEN 1 AND 255),
  created_at         timestamptz NOT NULL DEFAULT now(),
  updated_at         timestamptz NOT NULL DEFAULT now()
);

-- The application's own record of the work. `id` is chosen by the application (its request or job
-- id), which is what makes enqueueing the same usage twice a no-op. A usage is identified by
-- (tenant, usage id): one tenant's ids never meet another's, so no tenant can learn which ids
-- another has used, nor make another's usage fail to record by taking its id first.
CREATE TABLE usage_logs (
  id          text NOT NULL CHECK (length(id) BETWEEN 1 AND 90),
  tenant_id   text NOT NULL REFERENCES billing_customers (tenant_id),
  event_name  text NOT NULL CHECK (length(event_name) BETWEEN 1 AND 100),
  quantity    bigint NOT NULL CHECK (quantity > 0),
  occurred_at timestamptz NOT NULL,
  created_at  timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (tenant_id, id)
);

CREATE TABLE outbox (
  id                 bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  tenant_id          text NOT NULL REFERENCES billing_customers (tenant_id),
  -- The usage the row delivers, for people (`inspect`: a key of a long tenant and id is a hash). No
  -- index: (tenant, usage id) is unique in usage_logs, and a repeated recordUsage finds its row by
  -- key (derived from the pair).
  usage_id           text NOT NULL,
  event_name         text NOT NULL CHECK (length(event_name) BETWEEN 1 AND 100),
  quantity           bigint NOT NULL CHECK (quantity > 0),
  occurred_at        timestamptz NOT NULL,
  -- The Temporal workflow id, and what Stripe's meter event `identifier` is made of (Stripe allows
  -- 100 characters); derived from (tenant, usage id) by src/outbox/keys.ts.
  idempotency_key    text NOT NULL UNIQUE CHECK (length(idempotency_key) BETWEEN 1 AND 100),
  -- The W3C traceparent of the trace the event was recorded in. The commit ends the application's
  -- request, and the relay claims the row later, in another process: this is what lets the relay's
  -- start, the usage workflow and the Stripe call join the request's trace. NULL for rows recorded
  -- outside a trace.
  trace_parent       text,
  -- An event Stripe's v1 endpoint took is `sent`; one the v2 meter event stream
  -- (STRIPE_METER_API=v2) took is `accepted`: the stream validates asynchronously, so a 200 there
  -- says less. `rejected_async`: Stripe answered 200 and rejected it later
  -- (v1.billing.meter.error_report_triggered); `cancelled`: cancelled with a meter event adjustment.
  status             text NOT NULL DEFAULT 'pending'
                     CONSTRAINT outbox_status_check
                     CHECK (status IN ('pending', 'claimed', 'dispatched', 'sent', 'accepted', 'dead', 'rejected_async', 'cancelled')),
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
  -- The Stripe customer the row's attempt named (the tenant's mapping in billing_customers when the
  -- attempt began; NULL until the first attempt). A tenant remapped to another customer keeps its
  -- earlier usage billed to the earlier one, and reconciliation compares each row with the customer
  -- Stripe counted it under, not the mapping of today.
  billed_customer_id text,
  -- 0 until an operator rebills an event Stripe rejected after accepting it (`billing-outbox
  -- rebill`); each rebill gives the event a new identifier (src/outbox/keys.ts
  -- `stripeIdentifierFor`), since Stripe keeps the rejected one taken.
  identifier_revision integer NOT NULL DEFAULT 0,
  -- The identifier this row's attempts send, fixed at its first attempt (or by a rebill); NULL means
  -- the idempotency key itself (every row of a deployment without STRIPE_IDENTIFIER_NAMESPACE that
  -- was never rebilled). Error reports are matched to rows by it.
  stripe_identifier  text,
  created_at         timestamptz NOT NULL DEFAULT now(),
  dispatched_at      timestamptz,
  sent_at            timestamptz,
  dead_at            timestamptz,
  rejected_at        timestamptz,
  cancelled_at       timestamptz,
  -- When the latest rebill gave the row its identifier revision (NULL: never rebilled). A run
  -- closed well before it sent only earlier identifiers (src/ops/retry.ts).
  rebilled_at        timestamptz,
  updated_at         timestamptz NOT NULL DEFAULT now(),
  CHECK (status <> 'claimed' OR (claim_id IS NOT NULL AND processing_deadline IS NOT NULL))
);

-- A lane is one tenant's events for one meter (tenant_id, event_name). The relay keeps at most
-- LANE_MAX_IN_FLIGHT events of a lane claimed or dispatched at once: a hot lane's backlog waits
-- here, pending, while other lanes flow, instead of as thousands of workflows polling a lease.
--
-- The claim walks the lanes that have claimable rows (a skip scan over this index, one probe per
-- lane) and takes each lane's oldest rows from the lane's own range. Partial: sized by the backlog,
-- not by the sent rows. No id-ordered index beside it: the planner would prefer walking the whole
-- backlog in id order and filtering by lane, and every index costs the request path an insert.
CREATE INDEX outbox_lane_idx ON outbox (tenant_id, event_name, id) WHERE status IN ('pending', 'claimed');
-- Counts what each lane has in flight, without reading its pending backlog.
CREATE INDEX outbox_in_flight_idx ON outbox (tenant_id, event_name) WHERE status IN ('claimed', 'dispatched');
-- The rows still moving. `sent` and `accepted` are end states (until Stripe's error report or an
-- operator's cancel moves them), so the index stays small with millions of delivered rows.
CREATE INDEX outbox_unsettled_idx ON outbox (status) WHERE status NOT IN ('sent', 'accepted');
-- Delivered rows by time: status counts, reconcile, and retention (prune).
CREATE INDEX outbox_sent_at_idx ON outbox (sent_at) WHERE sent_at IS NOT NULL;
-- Reconcile reads the events of an hour's window (listWindowEvents). By time first: an index led by
-- (tenant_id, event_name) over every row would draw the claim's skip scan away from the small
-- partial lane index (outbox_lane_idx) onto the whole delivered history.
CREATE INDEX outbox_occurred_at_idx ON outbox (occurred_at);
-- Error reports find a row by the identifier Stripe names, when it is not the key. Unique: two rows
-- never share an identifier at Stripe.
CREATE UNIQUE INDEX outbox_stripe_identifier_idx ON outbox (stripe_identifier) WHERE stripe_identifier IS NOT NULL;
-- The dead letters, paged oldest first by `dead` and `retry --all-dead` (keyset, by id): each page
-- reads its own rows, not every dead row through the index of unsettled rows and a sort.
CREATE INDEX outbox_dead_idx ON outbox (id) WHERE status = 'dead';

-- Wake idle relays as soon as events commit (NOTIFY is delivered at commit, and only then).
-- Statement-level, so a bulk insert sends one notification, not one per row. The channel is the
-- schema's own (src/outbox/sql/schema.ts `outboxChannel`), so that deployments in other schemas of
-- the database are not woken. It names no table, so it needs no search_path of its own.
-- A transaction that notified commits under a lock every such commit of the database server takes
-- in turn: at many concurrent commits, the setting `billing_outbox.notify = off` in the
-- application's transactions (SET LOCAL) leaves their commits out of it, and the relays find their events by
-- polling (RELAY_POLL_INTERVAL_MS). See the README, "How it works", and docs/performance.md row 1b.
CREATE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF lower(coalesce(current_setting('billing_outbox.notify', true), '')) NOT IN ('off', 'false', '0', 'no') THEN
    PERFORM pg_notify(TG_TABLE_SCHEMA || ':outbox', '');
  END IF;
  RETURN NULL;
END;
$$;

CREATE TRIGGER outbox_notify_after_insert
  AFTER INSERT ON outbox
  FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify();

-- The operator audit log. Every action taken through `billing-outbox` (the operator CLI) that
-- changes something or was refused: who asked, when, on which event or tenant, whether the 24-hour
-- identifier guard was overridden (`forced`), and how it ended. Append-only; nothing in the
-- pipeline reads it.
CREATE TABLE operator_actions (
  id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  at              timestamptz NOT NULL DEFAULT now(),
  -- The OS user running the CLI, or its --by option.
  actor           text NOT NULL CHECK (length(actor) BETWEEN 1 AND 200),
  -- 'retry', 'cancel', 'rebill', 'customers.set', 'import', 'prune', 'restored', 'relays.pause' or
  -- 'relays.resume' (src/outbox/sql/operator.ts, src/outbox/sql/relay.ts).
  action          text NOT NULL,
  idempotency_key text,
  tenant_id       text,
  forced          boolean NOT NULL DEFAULT false,
  -- `started` while a long action runs; for a retry: signalled, reopened, skipped, refused or
  -- failed; for customers.set: created or updated.
  outcome         text NOT NULL,
  detail          text
);

CREATE INDEX operator_actions_key_idx ON operator_actions (idempotency_key, at) WHERE idempotency_key IS NOT NULL;

-- Stripe's rule of one in-flight meter-event call per (customer, meter) across every worker: a
-- short lease per (Stripe customer, meter event name), taken around each Stripe call. A lease
-- outlives neither the call (its length is the Stripe timeout plus a margin) nor a crashed worker.
CREATE TABLE meter_leases (
  stripe_customer_id text NOT NULL,
  event_name         text NOT NULL,
  holder             text NOT NULL,
  expires_at         timestamptz NOT NULL,
  PRIMARY KEY (stripe_customer_id, event_name)
);
-- The leases are found by holder at every begin, renewal, hold and hand-off.
CREATE INDEX meter_leases_holder_idx ON meter_leases (holder);

-- Deliveries waiting for a (customer, meter) lease, so that the oldest one gets it next: a delivery
-- may take a free lease only when no older delivery of the same pair is waiting. A row lives while
-- its delivery waits (refreshed as it waits, gone when it takes the lease or gives up) and
-- expires by itself if the waiting worker dies.
CREATE TABLE meter_lease_waiters (
  stripe_customer_id text NOT NULL,
  event_name         text NOT NULL,
  outbox_id          bigint NOT NULL,
  holder             text NOT NULL,
  expires_at         timestamptz NOT NULL,
  PRIMARY KEY (stripe_customer_id, event_name, outbox_id)
);
CREATE INDEX meter_lease_waiters_holder_idx ON meter_lease_waiters (holder);

-- Hands the (customer, meter) leases `p_holder` holds, and its places in their queues, to the
-- oldest delivery still waiting for each pair: that delivery holds the lease at once (for
-- `p_handoff_ms`, which it extends when it makes its call) and is woken by a notification naming
-- it, so it starts without asking again. Returns each pair given up (as a lane id, see
-- src/stripe/meter-lease.ts) and who holds it now (null: nobody was waiting). Its search_path is
-- pinned to the schema it is created in (the migration runner's): it is called from the
-- application's and the workers' connections, whose search_path may find other tables first.
CREATE FUNCTION meter_lease_hand_off(p_holder text, p_handoff_ms int, p_channel text)
RETURNS TABLE (lane text, next_holder text) LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
  pair record;
  nxt record;
BEGIN
  FOR pair IN
    WITH freed AS (
      DELETE FROM meter_leases l WHERE l.holder = p_holder RETURNING l.stripe_customer_id, l.event_name, true AS was_holder
    ), left_queue AS (
      DELETE FROM meter_lease_waiters w WHERE w.holder = p_holder RETURNING w.stripe_customer_id, w.event_name, false AS was_holder
    )
    SELECT x.stripe_customer_id, x.event_name, bool_or(x.was_holder) AS was_holder
      FROM (SELECT * FROM freed UNION ALL SELECT * FROM left_queue) AS x
     GROUP BY x.stripe_customer_id, x.event_name
  LOOP
    lane := pair.stripe_customer_id || chr(31) || pair.event_name;
    next_holder := NULL;
    IF pair.was_holder THEN
      DELETE FROM meter_lease_waiters w
       WHERE (w.stripe_customer_id, w.event_name, w.outbox_id) = (
               SELECT v.stripe_customer_id, v.event_name, v.outbox_id FROM meter_lease_waiters v
                WHERE v.stripe_customer_id = pair.stripe_customer_id AND v.event_name = pair.event_name
                  AND v.expires_at > clock_timestamp()
                ORDER BY v.outbox_id LIMIT 1 FOR UPDATE SKIP LOCKED)
      RETURNING w.holder INTO nxt;
      IF FOUND THEN
        INSERT INTO meter_leases (stripe_customer_id, event_name, holder, expires_at)
        VALUES (pair.stripe_customer_id, pair.event_name, nxt.holder, clock_timestamp() + p_handoff_ms * interval '1 millisecond')
        ON CONFLICT (stripe_customer_id, event_name) DO NOTHING;
        IF FOUND THEN next_holder := nxt.holder; END IF;
      END IF;
    END IF;
    PERFORM pg_notify(p_channel, lane || chr(30) || coalesce(next_holder, ''));
    RETURN NEXT;
  END LOOP;
END;
$$;

-- Events Stripe answered 200 for and rejected later: each error-report webhook once, whatever
-- Stripe's redeliveries (its event id is unique).
CREATE TABLE stripe_error_reports (
  event_id       text PRIMARY KEY,
  received_at    timestamptz NOT NULL DEFAULT now(),
  meter_id       text,
  matched        integer NOT NULL DEFAULT 0,
  unmatched      integer NOT NULL DEFAULT 0,
  error_count    integer NOT NULL DEFAULT 0,
  report         jsonb NOT NULL
);

-- The account-wide pace of Stripe work, shared by every worker: per bucket, the time of the next
-- free slot (a virtual-scheduling / GCRA limiter). See src/stripe/rate-limit.ts (its statement: src/outbox/sql/pace.ts).
-- `written_at`: the clock when next_slot was last moved. PostgreSQL's clock stepped back since (a
-- host corrected by NTP, a failover to a host that was ahead) leaves next_slot that far in the
-- future; the queue it held is counted from written_at instead, not waited out for the whole step.
CREATE TABLE rate_limits (
  bucket     text PRIMARY KEY,
  next_slot  timestamptz NOT NULL DEFAULT now(),
  written_at timestamptz NOT NULL DEFAULT now()
);
-- `stripe_calls`: every meter-event call. `dispatch`: how fast relays hand events to Temporal, so
-- a backlog waits in the outbox (cheap) rather than as thousands of waiting workflows.
INSERT INTO rate_limits (bucket) VALUES ('stripe_calls'), ('dispatch');

-- Which deployment of billing-outbox this schema is: one row, named at random when migrated. Workers
-- put it on the relay workflows they start (a memo), and refuse a task queue whose relays another
-- deployment started: two deployments on one Temporal namespace and task queue would each run the
-- other's events against their own database (src/temporal/worker.ts, ensureRelays).
-- Its relays can be paused by an operator (`billing-outbox relays pause`): while relays_paused_at is
-- set, every claim takes nothing (src/outbox/sql/relay.ts), new events wait as pending and those in
-- flight go on to Stripe.
-- identifier_namespace: the STRIPE_IDENTIFIER_NAMESPACE its workers last started with ('' for none;
-- NULL before any has), which operator commands stamp and rebill identifiers with, whatever their
-- own environment says (src/outbox/sql/operator.ts, identifierNamespaceOf).
CREATE TABLE deployment (
  only_row             boolean PRIMARY KEY DEFAULT true CHECK (only_row),
  id                   text NOT NULL,
  created_at           timestamptz NOT NULL DEFAULT now(),
  relays_paused_at     timestamptz,
  relays_paused_by     text,
  relays_paused_reason text,
  identifier_namespace text
);
INSERT INTO deployment (id) VALUES (gen_random_uuid()::text);
