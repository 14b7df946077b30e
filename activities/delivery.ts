/**
 * Activities of the usage workflow: report one event to Stripe, and keep its outbox row current.
 */
import { activityInfo, ApplicationFailure } from '@temporalio/activity';
import type Stripe from 'stripe';
import type { Queryable } from '../src/db.js';
import { beginAttempt, markDead, markRetrying, markSent, recordAttemptError } from '../src/outbox-sql.js';
import { classifyStripeError, sendMeterEvent } from '../src/stripe-client.js';
import { ErrorTypes } from '../workflows/shared.js';

export interface DeliveryDeps {
  db: Queryable;
  stripe: Pick<Stripe, 'billing'>;
}

export interface DeliveryResult {
  /** `sent`: Stripe accepted it now; `duplicate`: Stripe already had it (an earlier lost answer). */
  outcome: 'sent' | 'duplicate' | 'already_sent';
  attempts: number;
}

export function createDeliveryActivities({ db, stripe }: DeliveryDeps) {
  return {
    /**
     * One attempt to report the event: count the attempt, call Stripe once, mark the row sent.
     * Each failure is classified here, where the call is made, into an ApplicationFailure whose
     * type tells Temporal (and the workflow) whether another attempt can help.
     */
    async deliverUsage(key: string): Promise<DeliveryResult> {
      const row = await beginAttempt(db, key, activityInfo().workflowExecution?.workflowId ?? key);
      if (!row) {
        throw ApplicationFailure.create({ type: ErrorTypes.missing, message: `no outbox row with key ${key}`, details: ['outbox_row_missing'], nonRetryable: true });
      }
      if (row.status === 'sent') return { outcome: 'already_sent', attempts: row.attempt_count };
      if (!row.stripe_customer_id) {
        const message = 'the tenant has no Stripe customer mapping';
        await recordAttemptError(db, key, 'customer_mapping_missing', message);
        throw ApplicationFailure.create({ type: ErrorTypes.missing, message, details: ['customer_mapping_missing'], nonRetryable: true });
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
          return { outcome: 'duplicate', attempts: await markSent(db, key) };
        }
        await recordAttemptError(db, key, failure.code, failure.message);
        switch (failure.kind) {
          case 'rejected':
            throw ApplicationFailure.create({ type: ErrorTypes.rejected, message: failure.message, details: [failure.code], nonRetryable: true });
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
      return { outcome: 'sent', attempts: await markSent(db, key) };
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
