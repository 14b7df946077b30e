-- Version 12: the Stripe customer a row's attempt named (the tenant's mapping in billing_customers
-- when the attempt began; NULL until the first attempt). A tenant remapped to another customer
-- keeps its earlier usage billed to the earlier one, and reconciliation compares each row with the
-- customer Stripe counted it under, not the mapping of today. Nullable, no default: adding it
-- rewrites nothing.
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS billed_customer_id text;
