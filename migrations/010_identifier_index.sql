-- billing-outbox: no transaction
-- Version 10: error reports find a row by the identifier Stripe names (stripe_identifier, when it is
-- not the key). Unique: two rows never share an identifier at Stripe. Built without blocking the
-- application's writes; dropped first in case an earlier run was cut short and left it invalid.
DROP INDEX CONCURRENTLY IF EXISTS outbox_stripe_identifier_idx;
CREATE UNIQUE INDEX CONCURRENTLY outbox_stripe_identifier_idx ON outbox (stripe_identifier) WHERE stripe_identifier IS NOT NULL;
