-- billing-outbox: no transaction
-- Version 13: the dead letters, paged oldest first by `dead` and `retry --all-dead` (keyset, by id).
-- Without it each page read every dead row through the index of unsettled rows and sorted them: a
-- bulk retry of a million dead letters read them all again for every page of 500. Built without
-- blocking the application's writes; dropped first in case an earlier run was cut short.
DROP INDEX CONCURRENTLY IF EXISTS outbox_dead_idx;
CREATE INDEX CONCURRENTLY outbox_dead_idx ON outbox (id) WHERE status = 'dead';
