/**
 * One event as the database and its usage workflow see it, for `billing-outbox inspect`: the
 * outbox row, the workflow's status (describe) and, while it runs, its own state (the state
 * query), and the operator actions recorded for it.
 */
import { WorkflowNotFoundError, type Client, type WorkflowExecutionStatusName } from '@temporalio/client';
import type { Queryable } from '../db.js';
import { iso } from '../duration.js';
import { scrub } from '../log.js';
import { findInspectedRow, listOperatorActions, type InspectedRow } from '../outbox/sql/operator.js';
import { stateQuery, type UsageState } from '../../workflows/shared.js';
import type { Schema } from '../outbox/sql/schema.js';

/** How long to wait for a query answer: a query needs a worker, and none may be running. */
const QUERY_TIMEOUT_MS = 5_000;
/** Operator actions shown, newest first. */
const ACTIONS_SHOWN = 20;

export interface WorkflowView {
  found: boolean;
  status: WorkflowExecutionStatusName | null;
  runId: string | null;
  startTime: string | null;
  closeTime: string | null;
  /** The workflow's answer to the state query; only asked while it runs. */
  state: UsageState | null;
  stateError: string | null;
  /** Why Temporal could not say anything (unreachable, no answer in time); null when it answered. */
  unavailable: string | null;
}

export interface EventRowView {
  id: number;
  key: string;
  tenantId: string;
  /** The application's id of the usage (the key hashes it when tenant and id are long: `h:…`). */
  usageId: string;
  eventName: string;
  quantity: number;
  occurredAt: string | null;
  status: string;
  attempts: number;
  lastErrorCode: string | null;
  lastErrorMessage: string | null;
  workflowId: string | null;
  createdAt: string | null;
  firstAttemptedAt: string | null;
  dispatchedAt: string | null;
  sentAt: string | null;
  deadAt: string | null;
  /** The identifier Stripe got: the key, unless STRIPE_IDENTIFIER_NAMESPACE or a rebill made it another. */
  identifier: string;
  /** How many times it was rebilled under a new identifier after Stripe rejected it. */
  identifierRevision: number;
}

export interface OperatorActionView {
  at: string | null;
  actor: string;
  action: string;
  forced: boolean;
  outcome: string;
  detail: string | null;
}

export interface EventView {
  key: string;
  /** Null when no outbox row has this key. */
  row: EventRowView | null;
  workflow: WorkflowView;
  /** Newest first. */
  operatorActions: OperatorActionView[];
}

const NOT_SEEN = { found: false, status: null, runId: null, startTime: null, closeTime: null, state: null, stateError: null, unavailable: null } as const;

/**
 * describe() and, for an open run, the state query. A missing workflow is an answer, not an error;
 * Temporal away is said in `unavailable`, so that the row (which holds a failed start's error) is
 * still shown: `status` sends the operator here when workflow starts fail.
 */
export async function viewWorkflow(connect: Client | Promise<Client>, key: string): Promise<WorkflowView> {
  let description;
  let client: Client;
  try {
    client = await connect;
    description = await client.withDeadline(Date.now() + QUERY_TIMEOUT_MS, () => client.workflow.getHandle(key).describe());
  } catch (err) {
    if (err instanceof WorkflowNotFoundError) return { ...NOT_SEEN };
    return { ...NOT_SEEN, unavailable: `Temporal did not answer: ${scrub((err as Error).message)}` };
  }
  const handle = client.workflow.getHandle(key);
  const view: WorkflowView = {
    found: true,
    status: description.status.name,
    runId: description.runId,
    startTime: iso(description.startTime),
    closeTime: iso(description.closeTime),
    state: null,
    stateError: null,
    unavailable: null,
  };
  if (view.status === 'RUNNING') {
    try {
      view.state = await client.withDeadline(Date.now() + QUERY_TIMEOUT_MS, () => handle.query(stateQuery));
    } catch (err) {
      view.stateError = `state query failed (is a worker running?): ${scrub((err as Error).message)}`;
    }
  }
  return view;
}

function rowView(row: InspectedRow): EventRowView {
  return {
    id: row.id,
    key: row.idempotency_key,
    tenantId: row.tenant_id,
    usageId: row.usage_id,
    eventName: row.event_name,
    quantity: row.quantity,
    occurredAt: iso(row.occurred_at),
    status: row.status,
    attempts: row.attempt_count,
    lastErrorCode: row.last_error_code,
    lastErrorMessage: row.last_error_message,
    workflowId: row.workflow_id,
    createdAt: iso(row.created_at),
    firstAttemptedAt: iso(row.first_attempted_at),
    dispatchedAt: iso(row.dispatched_at),
    sentAt: iso(row.sent_at),
    deadAt: iso(row.dead_at),
    identifier: row.identifier,
    identifierRevision: row.identifier_revision,
  };
}

/** The event with `key`: its row (if any), its workflow (found or not), and what operators did to it. */
export async function inspectEvent(deps: { db: Queryable; schema: Schema; client: Client | Promise<Client> }, key: string): Promise<EventView> {
  const [row, workflow, actions] = await Promise.all([
    findInspectedRow(deps.db, deps.schema, key),
    viewWorkflow(deps.client, key),
    listOperatorActions(deps.db, deps.schema, key, ACTIONS_SHOWN),
  ]);
  return {
    key,
    row: row ? rowView(row) : null,
    workflow,
    operatorActions: actions.map((a) => ({ at: iso(a.at), actor: a.actor, action: a.action, forced: a.forced, outcome: a.outcome, detail: a.detail })),
  };
}
