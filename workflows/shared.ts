/**
 * Names shared by workflows, activities and clients: signals, queries, search attributes, and the
 * shapes that cross the workflow boundary. Importable from both sides (no Node APIs here).
 */
import { defineSearchAttributeKey, SearchAttributeType } from '@temporalio/common';
import { defineQuery, defineSignal } from '@temporalio/workflow';

export type OutboxStatus = 'pending' | 'claimed' | 'dispatched' | 'sent' | 'dead';

/** Current status of the event, kept in step with the outbox row; the Web UI and CLI filter on it. */
export const OutboxStatusKey = defineSearchAttributeKey('OutboxStatus', SearchAttributeType.KEYWORD);
export const TenantIdKey = defineSearchAttributeKey('TenantId', SearchAttributeType.KEYWORD);
export const SEARCH_ATTRIBUTES = [OutboxStatusKey, TenantIdKey];

export interface RetryPolicyInput {
  initialIntervalMs: number;
  backoffCoefficient: number;
  maximumIntervalMs: number;
  maximumAttempts: number;
  /**
   * How long one attempt may take before Temporal gives up on it and retries (the Stripe call's
   * own timeout plus the database work around it). Also bounds how long a crashed worker's
   * in-flight attempt holds the event.
   */
  attemptTimeoutMs?: number;
  /** How long Stripe may keep answering 429 before the event is dead-lettered (default 1 h). */
  maxRateLimitedMs?: number;
}

/**
 * Stripe rejects a second event with the same identifier "within a rolling period of at least 24
 * hours". Past that, a resend may be counted twice. We stop resending an hour early.
 */
export const IDENTIFIER_WINDOW_MS = 24 * 3_600_000;
export const SAFE_RESEND_WINDOW_MS = IDENTIFIER_WINDOW_MS - 3_600_000;
/** Stripe accepts meter events stamped within the past 35 days and up to 5 minutes ahead. */
export const MAX_EVENT_AGE_MS = 35 * 86_400_000;
export const MAX_EVENT_FUTURE_MS = 5 * 60_000;

export interface UsageWorkflowInput {
  /** The outbox row's idempotency key: also this workflow's id and Stripe's `identifier`. */
  key: string;
  tenantId: string;
  retry: RetryPolicyInput;
  /** An operator's forced reopen: the first attempt of this run may resend past the 24 h window. */
  force?: boolean;
}

export interface DeliverInput {
  key: string;
  /** Operator override of the identifier-window guard (see RetryRequest.force). */
  force?: boolean;
  /** The workflow run holding this event's (customer, meter) lease (see src/stripe/meter-lease.ts). */
  leaseHolder?: string;
}

/** Stripe's Retry-After is honoured, plus up to this much jitter so waiters do not stampede. */
export const RATE_LIMIT_JITTER_MS = 500;
/** An event deferred by 429s for longer than this becomes a dead letter (`rate_limited`), by default. */
export const MAX_DEFERRAL_MS = 3_600_000;


export interface UsageState {
  status: OutboxStatus;
  /** Calls made to Stripe for this event, as counted on the outbox row. */
  attempts: number;
  lastError: { code: string; message: string } | null;
}

export interface RetryRequest {
  /**
   * Resend even though the event's first attempt is older than Stripe's 24-hour identifier
   * window, where Stripe can no longer tell it is a duplicate. Only after reconciliation.
   */
  force?: boolean;
  /** Who asked, for the record. */
  requestedBy?: string;
}

/** Sent by an operator to a dead event: try again with the same identifier. */
export const retrySignal = defineSignal<[RetryRequest?]>('retry');
export const stateQuery = defineQuery<UsageState>('state');

export interface RelayWorkflowInput {
  relayId: string;
}

/** Error types the delivery activity throws; the workflow records them on the row. */
export const ErrorTypes = {
  /** Stripe refused the event for good (4xx other than 429 and the duplicate identifier). */
  rejected: 'StripeRejected',
  retryable: 'StripeRetryable',
  rateLimited: 'StripeRateLimited',
  /** 429s for longer than MAX_DEFERRAL_MS. */
  deferredTooLong: 'DeferredTooLong',
  /** The outbox row or its billing customer is missing: nothing to send. */
  missing: 'OutboxRowMissing',
  /** Sending now could bill twice (identifier window passed) or Stripe cannot take it (timestamp). */
  unsafeToSend: 'UnsafeToSend',
} as const;

/** Relays are per task queue, so deployments sharing a namespace keep their relays apart. */
export function relayWorkflowId(taskQueue: string, index: number): string {
  return `billing-outbox-relay:${taskQueue}:${index}`;
}
