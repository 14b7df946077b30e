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
}

export interface UsageWorkflowInput {
  /** The outbox row's idempotency key: also this workflow's id and Stripe's `identifier`. */
  key: string;
  tenantId: string;
  retry: RetryPolicyInput;
}

export interface UsageState {
  status: OutboxStatus;
  /** Calls made to Stripe for this event, as counted on the outbox row. */
  attempts: number;
  lastError: { code: string; message: string } | null;
}

/** Sent by an operator to a dead event: try again with the same identifier. */
export const retrySignal = defineSignal('retry');
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
  /** The outbox row or its billing customer is missing: nothing to send. */
  missing: 'OutboxRowMissing',
} as const;

export function relayWorkflowId(index: number): string {
  return `billing-outbox-relay-${index}`;
}
