-- billing-outbox schema, version 2: the operator audit log.
--
-- Every action taken through `billing-outbox` (the operator CLI) that changes something or was
-- refused: who asked, when, on which event or tenant, whether the 24-hour identifier guard was
-- overridden (`forced`), and how it ended. Append-only; nothing in the pipeline reads it.

CREATE TABLE operator_actions (
  id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  at              timestamptz NOT NULL DEFAULT now(),
  -- The OS user running the CLI, or its --by option.
  actor           text NOT NULL CHECK (length(actor) BETWEEN 1 AND 200),
  -- 'retry', 'customers.set' or (since migration 003) 'cancel'.
  action          text NOT NULL,
  idempotency_key text,
  tenant_id       text,
  forced          boolean NOT NULL DEFAULT false,
  -- For a retry: signalled, reopened, skipped, refused or failed; for customers.set: created or updated.
  outcome         text NOT NULL,
  detail          text
);

CREATE INDEX operator_actions_key_idx ON operator_actions (idempotency_key, at) WHERE idempotency_key IS NOT NULL;
