/**
 * Activities of the usage workflow: report one event to Stripe, and keep its outbox row current.
 */
import { activityInfo, ApplicationFailure } from '@temporalio/activity';
import type pg from 'pg';
import type Stripe from 'stripe';
import { classifyStripeError, sendMeterEvent } from '../src/stripe-client.js';
import { ErrorTypes } from '../workflows/shared.js';

export interface DeliveryDeps {
  pool: pg.Pool;
  stripe: Stripe;
}

export interface DeliveryResult {
  /** `sent`: Stripe accepted it now; `duplicate`: Stripe already had it (an earlier lost answer). */
  outcome: 'sent' | 'duplicate' | 'already_sent';
  attempts: number;
}

interface AttemptRow {
  status: string;
  attempt_count: number;
  event_name: string;
  quantity: number;
  occurred_at: Date;
  stripe_customer_id: string | null;
}

export function createDeliveryActivities({ pool, stripe }: DeliveryDeps) {
  /** Stores the error of a failed attempt on the row, so `dead` listings show it. */
  async function recordError(key: string, code: string, message: string): Promise<void> {
    await pool.query(
      `UPDATE outbox SET last_error_code = $2, last_error_message = $3, updated_at = now()
       WHERE idempotency_key = $1 AND status <> 'sent'`,
      [key, code, message.slice(0, 1000)],
    );
  }

  async function markSent(key: string): Promise<number> {
    const { rows } = await pool.query<{ attempt_count: number }>(
      `UPDATE outbox SET status = 'sent', sent_at = now(), last_error_code = NULL, last_error_message = NULL,
              claimed_by = NULL, claim_id = NULL, processing_deadline = NULL, updated_at = now()
       WHERE idempotency_key = $1
       RETURNING attempt_count`,
      [key],
    );
    return rows[0]?.attempt_count ?? 0;
  }

  return {
    /**
     * One attempt to report the event. Counts the attempt on the row and reads what to send in the
     * same statement, calls Stripe once, and marks the row sent. Throws an ApplicationFailure that
     * tells Temporal whether another attempt can help.
     */
    async deliverUsage(key: string): Promise<DeliveryResult> {
      const { rows } = await pool.query<AttemptRow>(
        `UPDATE outbox o
           SET attempt_count = o.attempt_count + CASE WHEN o.status = 'sent' THEN 0 ELSE 1 END,
               first_attempted_at = COALESCE(o.first_attempted_at, now()),
               workflow_id = COALESCE(o.workflow_id, $2),
               updated_at = now()
         WHERE o.idempotency_key = $1
         RETURNING o.status, o.attempt_count, o.event_name, o.quantity, o.occurred_at,
                   (SELECT c.stripe_customer_id FROM billing_customers c WHERE c.tenant_id = o.tenant_id) AS stripe_customer_id`,
        [key, activityInfo().workflowExecution?.workflowId ?? key],
      );
      const row = rows[0];
      if (!row) {
        throw ApplicationFailure.create({ type: ErrorTypes.missing, message: `no outbox row with key ${key}`, nonRetryable: true });
      }
      if (row.status === 'sent') return { outcome: 'already_sent', attempts: row.attempt_count };
      if (!row.stripe_customer_id) {
        const message = 'the tenant has no Stripe customer mapping';
        await recordError(key, 'customer_mapping_missing', message);
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
          return { outcome: 'duplicate', attempts: await markSent(key) };
        }
        await recordError(key, failure.code, failure.message);
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
      return { outcome: 'sent', attempts: await markSent(key) };
    },

    /** After the last attempt: the row becomes a dead letter carrying the final error. */
    async markDead(input: { key: string; code: string; message: string }): Promise<number> {
      const { rows } = await pool.query<{ attempt_count: number }>(
        `UPDATE outbox SET status = 'dead', dead_at = now(), last_error_code = $2, last_error_message = $3,
                claimed_by = NULL, claim_id = NULL, processing_deadline = NULL, updated_at = now()
         WHERE idempotency_key = $1 AND status <> 'sent'
         RETURNING attempt_count`,
        [input.key, input.code, input.message.slice(0, 1000)],
      );
      return rows[0]?.attempt_count ?? 0;
    },

    /** An operator asked for another try: the dead letter is back in flight. */
    async markRetrying(key: string): Promise<void> {
      await pool.query(
        `UPDATE outbox SET status = 'dispatched', dead_at = NULL, updated_at = now()
         WHERE idempotency_key = $1 AND status = 'dead'`,
        [key],
      );
    },
  };
}

export type DeliveryActivities = ReturnType<typeof createDeliveryActivities>;
