/**
 * The one list of outbox statuses (pg-boss keeps its JOB_STATES the same way): the SQL passes these
 * arrays as parameters (`status = ANY($n::text[])`), and the metrics, the CLI, reconciliation and
 * the workflow's search attribute all read them from here. The schema's CHECK constraint (outbox_status_check) spells
 * the same list; test/statuses.test.ts fails if the two ever differ.
 *
 *   pending ──claim──▶ claimed ──start workflow──▶ dispatched ──Stripe 200──▶ sent | accepted ──▶ rejected_async
 *      ▲                  │ (claim times out)            │                                   └──▶ cancelled
 *      └──────────────────┘                             └──last attempt──▶ dead ──retry──▶ dispatched
 *
 * `sent`: Stripe's v1 meter-events endpoint answered 200: received (some checks, the customer's
 * among them, run later and come back by error report). `accepted`: the v2 meter event stream took it for asynchronous processing,
 * validation included; a rejection can only come later, by Stripe's error report.
 *
 * Pure data: importable from workflow code.
 */
export const OUTBOX_STATUSES = ['pending', 'claimed', 'dispatched', 'sent', 'accepted', 'dead', 'rejected_async', 'cancelled'] as const;
export type OutboxStatus = (typeof OUTBOX_STATUSES)[number];

/** Waiting for a relay: a pending row, or a claimed one whose lease may lapse. */
export const AWAITING_RELAY = ['pending', 'claimed'] as const satisfies readonly OutboxStatus[];

/** Counted against a lane's LANE_MAX_IN_FLIGHT: handed (or about to be handed) to a workflow, not finished. */
export const IN_FLIGHT = ['claimed', 'dispatched'] as const satisfies readonly OutboxStatus[];

/** Stripe acknowledged the event (v1: sent; v2: accepted): billed unless it rejects it later. */
export const DELIVERED = ['sent', 'accepted'] as const satisfies readonly OutboxStatus[];

/** Stripe has (or had) the event: never sent again, never made dead. */
export const AT_STRIPE = ['sent', 'accepted', 'rejected_async', 'cancelled'] as const satisfies readonly OutboxStatus[];

export function isAtStripe(status: OutboxStatus): status is (typeof AT_STRIPE)[number] {
  return (AT_STRIPE as readonly string[]).includes(status);
}

/** Not settled: Stripe may or may not hold the event yet (reconciliation lists these, does not count them). */
export const UNSETTLED = ['pending', 'claimed', 'dispatched', 'dead'] as const satisfies readonly OutboxStatus[];

/** Settled without being billed: rejected by Stripe's later validation, or cancelled by an operator. */
export const UNBILLED = ['rejected_async', 'cancelled'] as const satisfies readonly OutboxStatus[];

export function isUnbilled(status: OutboxStatus): status is (typeof UNBILLED)[number] {
  return (UNBILLED as readonly string[]).includes(status);
}

export function isOutboxStatus(value: string): value is OutboxStatus {
  return (OUTBOX_STATUSES as readonly string[]).includes(value);
}
