-- billing-outbox schema, version 5: usage ids are unique per tenant, not across tenants.
--
-- Until now `usage_logs.id` was the primary key and the idempotency key was `usage_log:<usage id>`:
-- one tenant could learn which ids another had used (a conflict instead of a new event) and, by
-- taking an id first, make the other tenant's own usage fail to record. From here on a usage is
-- identified by (tenant, usage id), and new outbox rows get a key derived from both
-- (src/outbox/keys.ts). Rows already written keep their key: their workflow and Stripe know it.

ALTER TABLE usage_logs DROP CONSTRAINT usage_logs_pkey;
ALTER TABLE usage_logs ADD PRIMARY KEY (tenant_id, id);

-- The outbox row names its usage (for people: `inspect`, the Web UI). Old rows: the usage id is
-- what follows the old prefix. No index: (tenant, usage id) is unique in usage_logs, and a repeated
-- recordUsage finds its row by key (the key is derived from the pair; old rows by their old key).
ALTER TABLE outbox ADD COLUMN usage_id text;
UPDATE outbox SET usage_id = substr(idempotency_key, length('usage_log:') + 1)
 WHERE idempotency_key LIKE 'usage\_log:%';
