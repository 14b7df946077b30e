-- billing-outbox schema, version 7: Stripe's v2 meter event stream (STRIPE_METER_API=v2).
--
-- An event the stream took is `accepted`, not `sent`: the stream validates asynchronously, so a 200
-- there says less than a 200 from the v1 endpoint. Like `sent`, it is an end state (until Stripe's
-- error report or an operator's cancel moves it), so it stays out of the index of rows still moving.
ALTER TABLE outbox DROP CONSTRAINT outbox_status_check;
ALTER TABLE outbox ADD CONSTRAINT outbox_status_check
  CHECK (status IN ('pending', 'claimed', 'dispatched', 'sent', 'accepted', 'dead', 'rejected_async', 'cancelled'));

DROP INDEX outbox_status_idx;
CREATE INDEX outbox_unsettled_idx ON outbox (status) WHERE status NOT IN ('sent', 'accepted');
