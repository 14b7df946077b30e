/**
 * Cancelling a sent event: takes back a meter event Stripe has received (a meter event
 * adjustment of type `cancel`), the only correction Stripe offers, and only within 24 hours of
 * receiving the event.
 *
 * Decision, in order: the row must exist and be `sent` (anything else has nothing at Stripe to
 * cancel as far as we know); its `sent_at` must be less than 24 h ago (checked here so that a hopeless
 * call is not made; Stripe received the event at or before `sent_at`, so Stripe may still refuse a
 * little earlier, and that refusal is reported as such); then Stripe is asked; on success the row
 * becomes `cancelled` (guarded by `status = 'sent'`). Stripe's refusal to cancel an event it has already
 * cancelled counts as success: it is what a repeated cancel meets when the first one got through
 * without an answer (a timeout). Every outcome is recorded in operator_actions.
 * The CLI (`billing-outbox cancel`) only parses and prints.
 */
import Stripe from 'stripe';
import type { Queryable } from '../db.js';
import { scrub } from '../log.js';
import { findCancelCandidate, markCancelled, recordOperatorAction, type CancelCandidateRow } from '../outbox/sql/operator.js';
import { cancelMeterEvent } from '../stripe/client.js';
import { CANCEL_WINDOW_MS } from '../stripe/rules.js';
import { formatDuration } from '../duration.js';
import type { Schema } from '../outbox/sql/schema.js';

export type CancelOutcome = 'cancelled' | 'refused' | 'failed';

export interface CancelResult {
  key: string;
  outcome: CancelOutcome;
  message: string;
  row: { status: string; eventName: string; quantity: number; tenantId: string; sentAt: string | null; cancelledAt: string | null } | null;
}

/** Why a row that is not `sent` cannot be cancelled. */
function notSentReason(row: CancelCandidateRow): string {
  switch (row.status) {
    case 'cancelled':
      return `already cancelled (at ${row.cancelled_at?.toISOString() ?? 'an unknown time'})`;
    case 'rejected_async':
      return `Stripe rejected it after accepting it (${row.last_error_code ?? 'no code'}, at ${row.rejected_at?.toISOString() ?? 'an unknown time'}): it is not counted, there is nothing to cancel`;
    case 'dead':
      return 'it is a dead letter: as far as we know Stripe does not have it (check with `billing-outbox reconcile` if an attempt may have got through)';
    default:
      return `it is ${row.status}, not sent yet: only an event Stripe has acknowledged can be cancelled; wait until it is sent`;
  }
}

export async function cancelEvent(
  db: Queryable,
  schema: Schema,
  key: string,
  opts: { actor: string; stripe: () => Pick<Stripe, 'billing'> },
): Promise<CancelResult> {
  const row = await findCancelCandidate(db, schema, key);
  if (!row) return { key, outcome: 'failed', message: 'no outbox row with this key', row: null };

  let result = await decide(db, schema, row, opts);
  try {
    await recordOperatorAction(db, schema, {
      actor: opts.actor,
      action: 'cancel',
      key,
      tenantId: row.tenant_id,
      forced: false,
      outcome: result.outcome,
      detail: result.message,
    });
  } catch (err) {
    // What happened at Stripe stands; an unrecorded action is still a failure the operator must see.
    result = { ...result, outcome: 'failed', message: `${result.message} (and recording it in operator_actions failed: ${scrub((err as Error).message)})` };
  }
  return result;
}

async function decide(db: Queryable, schema: Schema, row: CancelCandidateRow, opts: { stripe: () => Pick<Stripe, 'billing'> }): Promise<CancelResult> {
  const key = row.idempotency_key;
  const view = async (): Promise<CancelResult['row']> => {
    const current = (await findCancelCandidate(db, schema, key)) ?? row;
    return {
      status: current.status,
      eventName: current.event_name,
      quantity: current.quantity,
      tenantId: current.tenant_id,
      sentAt: current.sent_at?.toISOString() ?? null,
      cancelledAt: current.cancelled_at?.toISOString() ?? null,
    };
  };
  const done = async (outcome: CancelOutcome, message: string): Promise<CancelResult> => ({ key, outcome, message, row: await view() });

  if (row.status !== 'sent' && row.status !== 'accepted') return done('refused', `not cancelled: ${notSentReason(row)}`);
  if (!row.sent_at || row.sent_age_ms === null) return done('refused', 'not cancelled: the row is sent but has no sent_at, so the 24 h window cannot be checked');
  // By the database's clock, which stamped sent_at: an operator's laptop minutes fast would
  // otherwise refuse, without asking Stripe, a cancel Stripe would still take.
  const age = row.sent_age_ms;
  if (age >= CANCEL_WINDOW_MS) {
    return done(
      'refused',
      `not cancelled: sent ${formatDuration(age)} ago (${row.sent_at.toISOString()}); Stripe cancels an event only within 24 hours of ` +
        'receiving it. Stripe was not called. The usage stays billed: correct it another way (e.g. a credit on the invoice).',
    );
  }

  try {
    // The identifier Stripe got, not necessarily the key (a namespace, a rebill).
    await cancelMeterEvent(opts.stripe(), { eventName: row.event_name, identifier: row.identifier });
  } catch (err) {
    if (isAlreadyCancelled(err)) {
      // An earlier cancel got through although its caller never heard (a timeout, a lost answer):
      // Stripe refuses to cancel twice. The event is cancelled at Stripe, so the row says so.
      return recordCancelled(
        db,
        schema,
        row,
        `Stripe had already cancelled it (an earlier cancel got through without an answer): ${(err as Error).message}`,
        done,
      );
    }
    if (err instanceof Stripe.errors.StripeInvalidRequestError) {
      const missing = err.code === 'resource_missing';
      // The stream takes an event and processes it later: one accepted minutes ago may not be there yet.
      const early = missing && row.status === 'accepted' && age < STREAM_PROCESSING_MS;
      return done(
        'refused',
        `Stripe refused the cancel (${err.code ?? `HTTP ${err.statusCode ?? '?'}`}): ${err.message}` +
          (early
            ? ` Stripe took the event ${formatDuration(age)} ago on the meter event stream and may not have processed it yet: cancel again in a few minutes (reconcile if it still has none).`
            : missing
              ? ' Stripe has no such event: reconcile (billing-outbox reconcile) before anything else.'
              : ''),
      );
    }
    // No answer, or an unexpected one: nothing changed on our side. A cancel may be repeated.
    return done('failed', `could not reach a decision from Stripe: ${scrub((err as Error).message)}; the row is unchanged, try again`);
  }
  return recordCancelled(db, schema, row, `Stripe accepted the cancel of ${row.quantity} ${row.event_name} for tenant ${row.tenant_id}`, done);
}

/** Stripe has the event cancelled: the row becomes `cancelled` (if it is still delivered). */
async function recordCancelled(
  db: Queryable,
  schema: Schema,
  row: CancelCandidateRow,
  what: string,
  done: (outcome: CancelOutcome, message: string) => Promise<CancelResult>,
): Promise<CancelResult> {
  const key = row.idempotency_key;
  try {
    if (await markCancelled(db, schema, key)) return await done('cancelled', `${what}; the row is cancelled`);
    const current = await findCancelCandidate(db, schema, key);
    return await done('cancelled', `${what}, but the row had meanwhile become ${current?.status ?? 'missing'} and was left as it is`);
  } catch (err) {
    // Stripe has cancelled it; only our row does not say so yet. The same command records it while
    // the 24 h cancel window lasts (its repeat is answered by Stripe's stored answer).
    return {
      key,
      outcome: 'failed',
      message: `${what}, but recording it on the row failed (${scrub((err as Error).message)}): the row still says ${row.status}; run the same cancel again (before ${new Date((row.sent_at?.getTime() ?? 0) + CANCEL_WINDOW_MS).toISOString()}) to record it`,
      row: null,
    };
  }
}

/**
 * How long after the stream took an event a cancel Stripe answers "no such event" is taken for
 * Stripe not having processed it yet, rather than for an event Stripe never had.
 */
const STREAM_PROCESSING_MS = 10 * 60_000;

/**
 * Stripe's refusal to cancel an event it has already cancelled (one cancelled by other means: ours
 * repeat under one Idempotency-Key, src/stripe/client.ts). Stripe documents neither a code nor a
 * wording for it, so the message is the signal: the local Stripe's wording
 * (src/embedded/stripe/adjustments.ts `alreadyCancelled`), and an adjustment said to exist already.
 */
const ALREADY_CANCELLED = /\bhas already been cancell?ed\b|\badjustment already exists\b/i;

function isAlreadyCancelled(err: unknown): boolean {
  return err instanceof Stripe.errors.StripeInvalidRequestError && ALREADY_CANCELLED.test(err.message);
}
