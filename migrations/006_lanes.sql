-- billing-outbox schema, version 6: lanes.
--
-- A lane is one tenant's events for one meter (tenant_id, event_name). The relay keeps at most
-- LANE_MAX_IN_FLIGHT events of a lane claimed or dispatched at once: a hot lane's backlog waits
-- here, pending, while other lanes flow, instead of as thousands of workflows polling a lease.

-- The claim walks the lanes that have claimable rows (a skip scan over this index, one probe per
-- lane) and takes each lane's oldest rows. Partial: sized by the backlog, not by the sent rows.
CREATE INDEX outbox_lane_idx ON outbox (tenant_id, event_name, id) WHERE status IN ('pending', 'claimed');
-- Counts what each lane has in flight, without reading its pending backlog.
CREATE INDEX outbox_in_flight_idx ON outbox (tenant_id, event_name) WHERE status IN ('claimed', 'dispatched');
-- Replaced by outbox_lane_idx: the claim reads each lane's oldest rows from the lane's own range
-- (with an id-ordered index beside it, the planner preferred walking the whole backlog in id order
-- and filtering by lane). Every index also costs the request path an insert.
DROP INDEX outbox_claimable_idx;
-- Nothing reads it any more (per-tenant listings filter on a status first).
DROP INDEX outbox_tenant_idx;

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
