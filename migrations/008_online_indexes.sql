-- billing-outbox: no transaction
-- Version 8: two indexes, built without blocking the application's writes (CREATE INDEX
-- CONCURRENTLY: recordUsage goes on inserting while the outbox is scanned). Each is dropped first in
-- case an earlier run was cut short and left it invalid; the file is recorded only once both stand.

-- The (customer, meter) leases are found by holder at every begin, renewal, hold and hand-off.
DROP INDEX CONCURRENTLY IF EXISTS meter_leases_holder_idx;
CREATE INDEX CONCURRENTLY meter_leases_holder_idx ON meter_leases (holder);

-- Reconcile reads the events of an hour's window (listWindowEvents); the lanes migration (006)
-- dropped the index it used. By time first: an index led by (tenant_id, event_name) over every row
-- would draw the claim's skip scan away from the small partial lane index (outbox_lane_idx) onto
-- the whole delivered history.
DROP INDEX CONCURRENTLY IF EXISTS outbox_occurred_at_idx;
CREATE INDEX CONCURRENTLY outbox_occurred_at_idx ON outbox (occurred_at);
