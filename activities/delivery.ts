/**
 * Activities of the usage workflow: report one event to Stripe, and keep its outbox row current.
 */
import { activityInfo, ApplicationFailure } from '@temporalio/activity';
import type Stripe from 'stripe';
import type { Queryable } from '../src/db.js';
import type { DeliveryMetrics } from '../src/metrics.js';
import { beginAttempt, findRowByKey, markDead, markRetrying, markSent, recordAttemptError } from '../src/outbox-sql.js';
import { classifyStripeError, sendMeterEvent } from '../src/stripe-client.js';
import { ErrorTypes, MAX_EVENT_AGE_MS, MAX_EVENT_FUTURE_MS, SAFE_RESEND_WINDOW_MS, type DeliverInput } from '../workflows/shared.js';

export interface DeliveryDeps {
  db: Queryable;
  stripe: Pick<Stripe, 'billing'>;
  /** This process's counters; nothing is recorded without it. */
  metrics?: DeliveryMetrics;
}

export interface DeliveryResult {
  /** `sent`: Stripe accepted it now; `duplicate`: Stripe already had it (an earlier lost answer). */
  outcome: 'sent' | 'duplicate' | 'already_sent';
  attempts: number;
}

function fail(type: string, code: string, message: string): ApplicationFailure {
  return ApplicationFailure.create({ type, message, details: [code], nonRetryable: true });
}

/** Stripe only takes usage stamped within the past 35 days and at most 5 minutes ahead. */
export function timestampProblem(occurredAt: Date, now: number): { code: string; message: string } | undefined {
  const age = now - occurredAt.getTime();
  if (age > MAX_EVENT_AGE_MS) {
    return {
      code: 'timestamp_too_far_in_past',
      message: `usage from ${occurredAt.toISOString()} is older than Stripe's 35-day window and cannot be reported`,
    };
  }
  if (-age > MAX_EVENT_FUTURE_MS) {
    return {
      code: 'timestamp_in_future',
      message: `usage stamped ${occurredAt.toISOString()} is more than 5 minutes in the future`,
    };
  }
  return undefined;
}

export function createDeliveryActivities({ db, stripe, metrics }: DeliveryDeps) {
  /** Counted once the row is marked sent, timed from its commit. */
  const acknowledged = (createdAt: Date) => {
    metrics?.eventsSent.inc();
    metrics?.commitToAck.observe(Math.max(0, Date.now() - createdAt.getTime()) / 1000);
  };
  return {
    /**
     * One attempt to report the event: count the attempt, call Stripe once, mark the row sent.
     * Each failure is classified here, where the call is made, into an ApplicationFailure whose
     * type tells Temporal (and the workflow) whether another attempt can help.
     */
    async deliverUsage({ key, force = false }: DeliverInput): Promise<DeliveryResult> {
      const workflowId = activityInfo().workflowExecution?.workflowId ?? key;
      const row = await beginAttempt(db, key, { workflowId, safeWindowMs: SAFE_RESEND_WINDOW_MS, force });
      if (!row) {
        const existing = await findRowByKey(db, key);
        if (!existing) {
          throw fail(ErrorTypes.missing, 'outbox_row_missing', `no outbox row with key ${key}`);
        }
        const message =
          `first attempted ${existing.first_attempted_at?.toISOString()}, more than ${SAFE_RESEND_WINDOW_MS / 3_600_000} h ago: ` +
          `Stripe's 24 h identifier dedup may no longer catch a duplicate. Reconcile, then retry with force.`;
        await recordAttemptError(db, key, 'identifier_window_expired', message);
        metrics?.stripeErrors.inc({ class: 'unsafe' });
        throw fail(ErrorTypes.unsafeToSend, 'identifier_window_expired', message);
      }
      if (row.status === 'sent') return { outcome: 'already_sent', attempts: row.attempt_count };
      if (!row.stripe_customer_id) {
        const message = 'the tenant has no Stripe customer mapping';
        await recordAttemptError(db, key, 'customer_mapping_missing', message);
        throw fail(ErrorTypes.missing, 'customer_mapping_missing', message);
      }
      const outside = timestampProblem(row.occurred_at, Date.now());
      if (outside) {
        await recordAttemptError(db, key, outside.code, outside.message);
        metrics?.stripeErrors.inc({ class: 'unsafe' });
        throw fail(ErrorTypes.unsafeToSend, outside.code, outside.message);
      }

      try {
        await sendMeterEvent(stripe, {
          eventName: row.event_name,
          stripeCustomerId: row.stripe_customer_id,
          quantity: row.quantity,
          identifier: key,
          occurredAt: row.occurred_at,
        });
      } catch (err) {
        const failure = classifyStripeError(err);
        if (failure.kind === 'delivered') {
          const attempts = await markSent(db, key);
          metrics?.stripeErrors.inc({ class: 'delivered_duplicate' });
          acknowledged(row.created_at);
          return { outcome: 'duplicate', attempts };
        }
        await recordAttemptError(db, key, failure.code, failure.message);
        metrics?.stripeErrors.inc({ class: failure.kind });
        switch (failure.kind) {
          case 'rejected':
            throw fail(ErrorTypes.rejected, failure.code, failure.message);
          case 'rate_limited':
            throw ApplicationFailure.create({
              type: ErrorTypes.rateLimited,
              message: failure.message,
              details: [failure.code],
              nextRetryDelay: failure.retryAfterMs,
            });
          case 'retryable':
            throw ApplicationFailure.create({ type: ErrorTypes.retryable, message: failure.message, details: [failure.code] });
        }
      }
      const attempts = await markSent(db, key);
      acknowledged(row.created_at);
      return { outcome: 'sent', attempts };
    },

    /** After the last attempt: the row becomes a dead letter carrying the final error. */
    async markDead(input: { key: string; code: string; message: string }): Promise<number> {
      return markDead(db, input.key, input.code, input.message);
    },

    /** An operator asked for another try: the dead letter is back in flight. */
    async markRetrying(key: string): Promise<void> {
      await markRetrying(db, key);
    },
  };
}

export type DeliveryActivities = ReturnType<typeof createDeliveryActivities>;
