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
