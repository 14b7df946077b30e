/**
 * Activities of the usage workflow: report one event to Stripe, and keep its outbox row current.
 */
import { randomUUID } from 'node:crypto';
import { activityInfo, ApplicationFailure, Context, log } from '@temporalio/activity';
import Stripe from 'stripe';
import { isDatabaseUnavailable, type Queryable } from '../src/db.js';
import type { DeliveryMetrics } from '../src/metrics.js';
import {
  beginAttempt,
  findRowByKey,
  markDead,
  markDelivered,
  markRetrying,
  markSentAndHandOff,
  recordAttemptError,
  undoAttempt,
  type AttemptRow,
} from '../src/outbox/sql/delivery.js';
import { AT_STRIPE } from '../src/outbox/statuses.js';
import { sendMeterEvent } from '../src/stripe/client.js';
import { classifyStripeError } from '../src/stripe/errors.js';
import type { OutboxNotifier } from '../src/outbox/notifier.js';
import { holdTurn, releaseTurn, renewTurn, takeTurn } from '../src/stripe/meter-lease.js';
import type { MeterCatalog, MeterKeys } from '../src/stripe/meters.js';
import type { MeterEventStream } from '../src/stripe/stream.js';
import { reserveSlots, SlotPacer } from '../src/stripe/rate-limit.js';
import { inHours, SAFE_RESEND_WINDOW_MS, timestampProblem } from '../src/stripe/rules.js';
import { ErrorTypes, RATE_LIMIT_JITTER_MS, type DeferralReason, type DeliverInput } from '../workflows/shared.js';

export interface DeliveryDeps {
  db: Queryable;
  /** The Stripe client's timeout: a call holds its (customer, meter) lease at most this long. */
  stripeTimeoutMs: number;
  /** Account-wide Stripe calls per second (src/stripe/rate-limit.ts). */
  stripeCallsPerSecond: number;
  stripe: Pick<Stripe, 'billing'>;
  /** The payload keys of each meter (read from Stripe, cached). */
  meters: Pick<MeterCatalog, 'keysFor'>;
  /** Wakes a delivery waiting for a lease when the holder hands it off (without it: polling). */
  notifier?: Pick<OutboxNotifier, 'mark' | 'wait' | 'handOff' | 'handedTo'>;
  /** Aborted when this worker is shutting down: waiting deliveries step aside at once. */
  stopping?: AbortSignal;
  /** With STRIPE_METER_API=v2: the worker's batcher on Stripe's meter event stream (else v1 calls). */
  stream?: MeterEventStream;
  /** How long a delivery waits in place for its (customer, meter) turn (config.lanes.turnWaitMs). */
  turnWaitMs?: number;
  /**
   * After a v1 call that got no answer (the client's timeout, a dropped connection) the pair's lease
   * is kept this long and handed to nobody: a second call for the pair must not reach Stripe while
   * the first may still be in progress there (STRIPE_UNANSWERED_HOLD_MS).
   */
  unansweredHoldMs?: number;
  /** This process's counters; nothing is recorded without it. */
  metrics?: DeliveryMetrics;
}

export type DeliveryResult =
  /** `sent`: Stripe accepted it now; `duplicate`: Stripe already had it (an earlier lost answer). */
  | { outcome: 'sent' | 'duplicate' | 'already_sent'; attempts: number }
  /**
   * Not this time, and not a failure: Stripe said 429 (`rate_limited`), our own account-wide pace
   * has no slot soon enough (`paced`), or another call for the same customer and meter holds the
   * lease (`customer_busy`). The workflow waits `retryAfterMs` and asks again; no retry attempt of
   * the delivery policy is spent. Only Stripe's 429s count towards RETRY_MAX_RATE_LIMITED_MS.
   */
  | { outcome: 'deferred'; reason: DeferralReason; retryAfterMs: number; attempts: number };

function fail(type: string, code: string, message: string): ApplicationFailure {
  return ApplicationFailure.create({ type, message, details: [code], nonRetryable: true });
}

/** Room for our own queries around the Stripe call while holding the lease. */
const LEASE_MARGIN_MS = 5_000;
/** Less than this left of the lease beyond the call's timeout, and it is renewed before the call. */
const LEASE_RENEW_SLACK_MS = 2_000;
/** When Stripe says 429 without Retry-After. */
const DEFAULT_RETRY_AFTER_MS = 1_000;

/** Longest an activity waits in place for its call slot; a longer queue is waited out in the workflow. */
const MAX_PACING_WAIT_MS = 1_000;
/**
 * A lease handed to the next waiting delivery is its for this long, time enough to begin its
 * attempt (which extends it to cover the call); a waiter that died meanwhile loses it this soon.
 */
const HAND_OFF_LEASE_MS = 5_000;

/** How late a paced call may go out before it takes a new slot (at least one interval). */
const LATE_TOLERANCE_MS = 100;

/** One attempt's hold on its (customer, meter) lease. */
interface Turn {
  holder: string;
  /** The lease was handed on with the row's own update (markSentAndHandOff). */
  handedOff: boolean;
  /** The call's outcome is unknown (no answer): Stripe may still be working on it. */
  unanswered?: boolean;
}

/** A delivery that found PostgreSQL away comes back this much later (plus up to a second). */
const DATABASE_RETRY_MS = 2_000;

/** A delivery that stepped aside from a busy (customer, meter) comes back this much later. */
const BUSY_RETRY_MS = 250;
/** A waiting delivery re-checks at least this often (an expired lease sends no hand-off). */
const TURN_POLL_MS = 1_000;
/** A waiter's place in the queue outlives its last check by this much, then lapses (a dead worker). */
const WAITER_TTL_MS = 5_000;
/** Heartbeats during an attempt; the activity's heartbeat timeout is a few of these. */
const HEARTBEAT_EVERY_MS = 2_000;

export function createDeliveryActivities(deps: DeliveryDeps) {
  const { db, stripe, meters, metrics, notifier, stopping, stream, stripeTimeoutMs, stripeCallsPerSecond } = deps;
  const turnWaitMs = deps.turnWaitMs ?? 10_000;
  const unansweredHoldMs = deps.unansweredHoldMs ?? 30_000;
  const pacer = new SlotPacer(db, { bucket: 'stripe_calls', perSecond: stripeCallsPerSecond, maxWaitMs: MAX_PACING_WAIT_MS });
  /** Counted once the row is marked sent, timed from its commit. */
  const acknowledged = (key: string, outcome: string, attempts: number, createdAt: Date) => {
    // The SDK's activity logger adds the workflow id, run id and attempt to every line.
    log.info('meter event acknowledged by Stripe', { idempotencyKey: key, outcome, attempts });
    metrics?.eventsSent.inc();
    metrics?.commitToAck.observe(Math.max(0, Date.now() - createdAt.getTime()) / 1000);
  };
  const activities = {
    /**
     * One attempt to report the event: count the attempt, call Stripe once, mark the row sent.
     * Each failure is classified here, where the call is made, into an ApplicationFailure whose
     * type tells Temporal (and the workflow) whether another attempt can help.
     */
    async deliverUsage(input: DeliverInput): Promise<DeliveryResult> {
      try {
        return await (stream ? attemptByStream(input, stream) : attemptWithTurn(input));
      } catch (err) {
        // PostgreSQL away (before the call, or after it when the row could not be marked): not the
        // event's failure. The workflow waits and comes back without spending an attempt; a call
        // made again is caught by Stripe's identifier dedup, and past 23 h by the resend guard.
        if (!isDatabaseUnavailable(err)) throw err;
        log.warn('database unavailable during delivery; waiting it out', { idempotencyKey: input.key, error: String(err) });
        return { outcome: 'deferred', reason: 'database_unavailable', retryAfterMs: DATABASE_RETRY_MS + Math.floor(Math.random() * 1_000), attempts: 0 };
      }
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
  return activities;

  /** One v1 attempt: wait for the (customer, meter) turn, then pace, begin and make the call. */
  async function attemptWithTurn(input: DeliverInput): Promise<DeliveryResult> {
    const ctx = Context.current();
    const info = activityInfo();
    const turn: Turn = {
      // One holder per execution of this activity, never reused: a later execution for the same
      // event (the regular activity after the first try in the workflow task, both attempt 1) must
      // not inherit, and so renew at once, the lease an unanswered call of an earlier one holds.
      holder: `${info.workflowExecution?.workflowId ?? input.key}/${info.workflowExecution?.runId ?? ''}/${info.attempt}/${randomUUID()}`,
      handedOff: false,
    };
    // A liveness signal for the whole attempt (waiting, pacing, the call): a worker that dies is
    // noticed by the heartbeat timeout, not only by the attempt's timeout.
    const beat = setInterval(() => ctx.heartbeat(), HEARTBEAT_EVERY_MS);
    try {
      for (;;) {
        const got = await waitForTurn(input.key, turn.holder, ctx);
        if (got === 'gave_up') return { outcome: 'deferred', reason: 'customer_busy', retryAfterMs: BUSY_RETRY_MS, attempts: 0 };
        const result = await attempt(input, turn, got === 'acquired', ctx);
        // The lease lapsed before the call could begin (a hand-off not taken up in time): back in
        // the queue, nothing sent, nothing counted.
        if (result !== 'lease_lost') return result;
      }
    } finally {
      clearInterval(beat);
      // Unless the row's update already did: hands the lease (or our place in its queue) to the
      // next delivery of the pair, in this process at once, elsewhere by NOTIFY. If this fails
      // (PostgreSQL away), the lease lapses by itself; the outcome stands. After a call that got no
      // answer, nobody gets it until `unansweredHoldMs` have passed: Stripe may still be on it.
      if (turn.unanswered) {
        await holdTurn(db, turn.holder, unansweredHoldMs).catch(() => undefined);
      } else if (!turn.handedOff) {
        const handOffs = await releaseTurn(db, turn.holder, HAND_OFF_LEASE_MS).catch((err: unknown) => {
          log.warn('could not hand the lease on; it will lapse', { idempotencyKey: input.key, error: String(err) });
          return [];
        });
        for (const h of handOffs) notifier?.handOff(h.lane, h.nextHolder ?? undefined);
      }
    }
  }

  /**
   * Waits, inside the activity, for the (customer, meter) lease of `key`: woken by the holder's
   * hand-off (or every second, to notice an expired lease), heartbeating. Gives up after
   * `turnWaitMs`, or at once when the worker is shutting down, so that a waiting delivery
   * neither holds a shutting-down worker nor runs into its attempt timeout; the workflow then
   * comes back after a short timer, without spending a retry attempt.
   */
  async function waitForTurn(key: string, holder: string, ctx: Context): Promise<'acquired' | 'no_target' | 'gave_up'> {
    const until = Date.now() + turnWaitMs;
    const stop = stopping ? AbortSignal.any([ctx.cancellationSignal, stopping]) : ctx.cancellationSignal;
    const lease = { key, holder, leaseMs: stripeTimeoutMs + LEASE_MARGIN_MS, waitTtlMs: WAITER_TTL_MS };
    // The pair is known after the first try; from then on each try is preceded by the mark of the
    // wait that follows it, so a hand-off between the try and the wait still wakes the wait.
    let lane: string | undefined;
    let mark: number | undefined;
    for (;;) {
      // Takes the lease if it is free (and nobody older waits), or joins (refreshes our place in) its queue.
      const turn = await takeTurn(db, lease);
      if (turn.outcome !== 'busy') return turn.outcome;
      if (lane === undefined) {
        lane = turn.lane!;
        mark = notifier?.mark(lane);
        continue;
      }
      // Waits to be handed the lease by its holder (no query: the hand-off names us), at most until
      // our place needs refreshing or a lapsed lease may need taking.
      const retryAt = Date.now() + TURN_POLL_MS;
      for (;;) {
        if (stop.aborted || Date.now() >= until) return 'gave_up';
        const left = Math.min(retryAt, until) - Date.now();
        if (left <= 0) break;
        if (notifier) await notifier.wait(left, stop, mark, lane);
        else await ctx.sleep(left);
        if (notifier?.handedTo(lane) === holder) return 'acquired';
        mark = notifier?.mark(lane);
      }
      ctx.heartbeat();
    }
  }

  /**
   * A call whose database work ran late (a stalled query, a starved process) would reach Stripe
   * bunched with others that were late too: a burst over the account limit although every slot was
   * paced. Past one interval late, it takes a new place in the pace instead.
   */
  async function keepPace(slotAt: number): Promise<void> {
    // A little lateness bunches a few calls, well within the headroom under Stripe's limit.
    const toleranceMs = Math.max(1_000 / stripeCallsPerSecond, LATE_TOLERANCE_MS);
    if (Date.now() - slotAt <= toleranceMs) return;
    const again = await reserveSlots(db, { bucket: 'stripe_calls', count: 1, perSecond: stripeCallsPerSecond });
    if (again.waitMs > 0) await Context.current().sleep(again.waitMs);
  }

  /**
   * One call to Stripe: count it, send it, mark the row sent. Each failure is classified here,
   * where the call is made.
   */
  async function attempt({ key, force = false }: DeliverInput, turn: Turn, leased: boolean, ctx: Context): Promise<DeliveryResult | 'lease_lost'> {
    /** Marks the row sent and hands the lease on, in one statement. */
    const sent = async () => {
      const { attempts, handOffs } = await markSentAndHandOff(db, key, turn.holder, HAND_OFF_LEASE_MS);
      turn.handedOff = true;
      for (const h of handOffs) notifier?.handOff(h.lane, h.nextHolder ?? undefined);
      return attempts;
    };
    const workflowId = activityInfo().workflowExecution?.workflowId ?? key;
    // Our place in the account-wide pace of Stripe calls, reserved while the attempt begins: both
    // are on the path between one call of a (customer, meter) and the next.
    const leaseMs = stripeTimeoutMs + LEASE_MARGIN_MS;
    const leaseFrom = Date.now();
    const [slot, begun] = await Promise.all([
      pacer.take(),
      beginAttempt(db, key, {
        workflowId,
        safeWindowMs: SAFE_RESEND_WINDOW_MS,
        force,
        // Extended to cover the call, and checked still ours: only then is the attempt begun.
        ...(leased ? { lease: { holder: turn.holder, leaseMs } } : {}),
      }),
    ]);
    if (!begun.leaseHeld) return 'lease_lost';
    const row = begun.row;
    if (!slot.granted) {
      // The account-wide queue is over a second long (rare: relays dispatch at the same pace): the
      // workflow waits it out on a timer. The attempt was begun but no call made: not counted.
      if (row && !(AT_STRIPE as readonly string[]).includes(row.status)) await undoAttempt(db, key, { wasFirst: row.attempt_count === 1 });
      const retryAfterMs = Math.max(100, slot.waitMs - MAX_PACING_WAIT_MS / 2) + Math.floor(Math.random() * RATE_LIMIT_JITTER_MS);
      return { outcome: 'deferred', reason: 'paced', retryAfterMs, attempts: 0 };
    }
    const slotAt = Date.now() + slot.waitMs;
    if (slot.waitMs > 0) await ctx.sleep(slot.waitMs);
    const ready = await readyToSend(key, row);
    if ('outcome' in ready) return ready;
    // The lease must outlast the call (and the pace's wait before it). If this process stalled since
    // it was extended (a long GC pause, a starved CPU) it is renewed, checked still ours; a lapsed
    // one is never called on: the attempt is undone and the delivery queues again.
    if (leased && Date.now() + stripeTimeoutMs > leaseFrom + leaseMs - LEASE_RENEW_SLACK_MS && !(await renewTurn(db, turn.holder, leaseMs))) {
      if (row && !(AT_STRIPE as readonly string[]).includes(row.status)) await undoAttempt(db, key, { wasFirst: row.attempt_count === 1 });
      return 'lease_lost';
    }
    try {
      await keepPace(slotAt);
      await sendMeterEvent(stripe, {
        eventName: ready.row.event_name,
        keys: ready.keys,
        stripeCustomerId: ready.customer,
        quantity: ready.row.quantity,
        identifier: key,
        occurredAt: ready.row.occurred_at,
      });
    } catch (err) {
      if (err instanceof Stripe.errors.StripeConnectionError) turn.unanswered = true;
      return failed(key, ready.row, err, sent);
    }
    const attempts = await sent();
    acknowledged(key, 'sent', attempts, ready.row.created_at);
    return { outcome: 'sent', attempts };
  }

  /**
   * One attempt through the v2 meter event stream: no (customer, meter) turn (the stream has no
   * such rule) and no per-event pace (the stream paces its requests); the event goes out in the
   * worker's next batch, and the row becomes `accepted`: Stripe validates it later.
   */
  async function attemptByStream({ key, force = false }: DeliverInput, events: MeterEventStream): Promise<DeliveryResult> {
    const workflowId = activityInfo().workflowExecution?.workflowId ?? key;
    const begun = await beginAttempt(db, key, { workflowId, safeWindowMs: SAFE_RESEND_WINDOW_MS, force });
    const ready = await readyToSend(key, begun.row);
    if ('outcome' in ready) return ready;
    const accepted = async () => markDelivered(db, key, 'accepted');
    try {
      await events.send({
        eventName: ready.row.event_name,
        keys: ready.keys,
        stripeCustomerId: ready.customer,
        quantity: ready.row.quantity,
        identifier: key,
        occurredAt: ready.row.occurred_at,
      });
    } catch (err) {
      return failed(key, ready.row, err, accepted);
    }
    const attempts = await accepted();
    acknowledged(key, 'accepted', attempts, ready.row.created_at);
    return { outcome: 'sent', attempts };
  }

  /**
   * What stands between a begun attempt and the call: the row must exist and be inside the resend
   * window (or forced), not already at Stripe, mapped to a customer, inside Stripe's timestamp
   * window, and its meter must exist (its payload keys are read from Stripe). Each refusal is
   * recorded on the row and thrown as a non-retryable failure; an event Stripe already has ends
   * the attempt as `already_sent`.
   */
  async function readyToSend(
    key: string,
    row: AttemptRow | undefined,
  ): Promise<DeliveryResult | { row: AttemptRow; customer: string; keys: MeterKeys }> {
    if (!row) {
      const existing = await findRowByKey(db, key);
      if (!existing) {
        throw fail(ErrorTypes.missing, 'outbox_row_missing', `no outbox row with key ${key}`);
      }
      const message =
        `first attempted ${existing.first_attempted_at?.toISOString()}, more than ${inHours(SAFE_RESEND_WINDOW_MS)} h ago: ` +
        `Stripe's 24 h identifier dedup may no longer catch a duplicate. Reconcile, then retry with force.`;
      await recordAttemptError(db, key, 'identifier_window_expired', message);
      metrics?.stripeErrors.inc({ class: 'unsafe' });
      throw fail(ErrorTypes.unsafeToSend, 'identifier_window_expired', message);
    }
    // Stripe already has it (and may since have rejected it, or we cancelled it): never again.
    if ((AT_STRIPE as readonly string[]).includes(row.status)) {
      return { outcome: 'already_sent', attempts: row.attempt_count };
    }
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
    // The keys this event's meter reads: a payload under other keys is accepted by Stripe and
    // rejected later, so an unknown meter is a dead letter now, with its reason. (Reading the
    // meter list can fail like any call to Stripe: classified as one.)
    let keys: MeterKeys | undefined;
    try {
      keys = await meters.keysFor(row.event_name);
    } catch (err) {
      return failed(key, row, err, async () => row.attempt_count);
    }
    if (!keys) {
      const message = `Stripe has no active meter for event name ${JSON.stringify(row.event_name)}: create the meter, then retry`;
      await recordAttemptError(db, key, 'no_meter', message);
      metrics?.stripeErrors.inc({ class: 'rejected' });
      throw fail(ErrorTypes.rejected, 'no_meter', message);
    }
    return { row, customer: row.stripe_customer_id, keys };
  }

  /**
   * A call that did not simply succeed, classified where it was made: Stripe already had it
   * (delivered), a refusal for good, a 429 to wait out, or a failure another attempt may pass.
   */
  async function failed(key: string, row: AttemptRow, err: unknown, delivered: () => Promise<number>): Promise<DeliveryResult> {
    if (err instanceof ApplicationFailure) throw err;
    const failure = classifyStripeError(err);
    if (failure.kind === 'delivered') {
      const attempts = await delivered();
      metrics?.stripeErrors.inc({ class: 'delivered_duplicate' });
      acknowledged(key, 'duplicate', attempts, row.created_at);
      return { outcome: 'duplicate', attempts };
    }
    await recordAttemptError(db, key, failure.code, failure.message);
    metrics?.stripeErrors.inc({ class: failure.kind });
    log.warn('meter event call failed', { idempotencyKey: key, class: failure.kind, code: failure.code, message: failure.message });
    switch (failure.kind) {
      case 'rejected':
        throw fail(ErrorTypes.rejected, failure.code, failure.message);
      case 'rate_limited':
        return {
          outcome: 'deferred',
          reason: 'rate_limited',
          retryAfterMs: (failure.retryAfterMs ?? DEFAULT_RETRY_AFTER_MS) + Math.floor(Math.random() * RATE_LIMIT_JITTER_MS),
          attempts: row.attempt_count,
        };
      case 'retryable':
        throw ApplicationFailure.create({ type: ErrorTypes.retryable, message: failure.message, details: [failure.code] });
    }
  }
}

export type DeliveryActivities = ReturnType<typeof createDeliveryActivities>;
