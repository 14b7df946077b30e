-- billing-outbox: no transaction
-- Version 8: two indexes, built without blocking the application's writes (CREATE INDEX
-- CONCURRENTLY: recordUsage goes on inserting while the outbox is scanned). Each is dropped first in
-- case an earlier run was cut short and left it invalid; the file is recorded only once both stand.

-- The (customer, meter) leases are found by holder at every begin, renewal, hold and hand-off.
DROP INDEX CONCURRENTLY IF EXISTS meter_leases_holder_idx;
CREATE INDEX CONCURRENTLY meter_leases_holder_idx ON meter_leases (holder);

-- Reconcile reads one tenant's events of one meter in an hour's window (listWindowEvents); the
-- lanes migration (006) dropped the index it used.
DROP INDEX CONCURRENTLY IF EXISTS outbox_window_idx;
CREATE INDEX CONCURRENTLY outbox_window_idx ON outbox (tenant_id, event_name, occurred_at);
