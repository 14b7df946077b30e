-- Version 9: the identifier Stripe gets, when it is not the key itself.
--
-- identifier_revision: 0 until an operator rebills an event Stripe rejected after accepting it
-- (`billing-outbox rebill`); each rebill gives the event a new identifier (src/outbox/keys.ts
-- `stripeIdentifierFor`), since Stripe keeps the rejected one taken.
-- stripe_identifier: the identifier this row's attempts send, fixed at its first attempt (or by a
-- rebill); NULL means the idempotency key itself (every row of a deployment without
-- STRIPE_IDENTIFIER_NAMESPACE that was never rebilled, and every row attempted before version 9).
-- Error reports are matched to rows by it. Both columns are added without rewriting the table (a
-- constant default, a nullable column); their index is built concurrently by 010.
ALTER TABLE outbox ADD COLUMN identifier_revision int NOT NULL DEFAULT 0;
ALTER TABLE outbox ADD COLUMN stripe_identifier text;
