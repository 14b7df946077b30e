/**
 * Stripe's v2 meter event stream (STRIPE_METER_API=v2), one batcher per worker: deliveries hand
 * their event to `send`, which resolves when the request carrying it was accepted (or rejects with
 * that request's error, for the delivery to classify like any Stripe failure). Up to 100 events go
 * in one request (Stripe's limit).
 *
 * When a request leaves. A request is made when 100 events wait, or when the oldest waiting event
 * has lingered: `lingerMs` (5 ms) on a quiet worker, where nothing would join it, and `maxLingerMs`
 * (500 ms) once events arrive fast enough that waiting gathers company (at least two expected
 * within it, by the arrival rate of the last second or so). Half a second is nothing to a bill and
 * is what a worker fed ~13 events/s needs to send five or more per request (at 200 ms the chaos
 * run's v2 workers sent 0.42 requests per event); a busy worker's requests fill long before it. Retried events come back one by one,
 * each on its own backoff, and a backlog drains at the pace of the workflows in front of the
 * batcher: with a 5 ms linger both went out almost one event per request; with the longer linger
 * they share requests, and a busy worker's requests fill before the linger is up. Then the
 * request takes its slot of the account-wide pace, and only then its events: what arrived while it
 * waited goes too, so when the pace is the bound (20 requests/s in test mode) requests fill
 * instead of queueing. At most `maxInFlight` (8) requests are pacing or in flight at once and one
 * waits for the pace at a time; the rest of the backlog waits here, in the queue that serves
 * customers in turn (src/stripe/stream-queue.ts), not in a FIFO of requests already formed.
 *
 * The stream authenticates with a session token (`POST /v2/billing/meter_event_session`, 15 minutes
 * today): created when first needed, shared by the worker's requests. A session is judged by its
 * own lifetime (`expires_at − created`, both Stripe's), counted on our clock from when we asked for
 * it: it is replaced once less than a quarter of that lifetime (at most a minute) is left, so
 * neither a short-lived session nor a worker clock far from Stripe's makes it look spent on
 * arrival. A new session is always used at least once. Stripe saying it expired
 * (`temporary_session_expired`) replaces it at once, with one retry of that request. A session
 * request that fails, or a session Stripe refuses on its first use, makes the next session request
 * wait (exponential backoff with jitter, bounded), shared by every caller. The gap between Stripe's
 * `created` and our clock is the clock skew: a gauge, and one warning past 30 s.
 *
 * A request Stripe refuses as a whole (400) when it carried several events is sent again one event
 * per request: one malformed event must not take 99 good ones down with it. A request that fails
 * another way that may pass (5xx, a connection error) is split in halves and each half resent, level
 * by level, for as long as some request of the level before went through: one event that makes
 * every request it is in fail ends up failing alone, the others accepted. When a whole level fails
 * it is Stripe, not an event, and the rest share the failure: in an outage a batch costs at most
 * three requests (the batch, then its two halves). Duplicates of an identifier are dropped by
 * Stripe silently (24 h), so a resend after a lost answer is harmless.
 */
import { performance } from 'node:perf_hooks';
import Stripe from 'stripe';
import type { Logger } from '../log.js';
import type { Metrics } from '../metrics.js';
import { classifyStripeError, StreamSessionError } from './errors.js';
import { meterEventPayload, type MeterEvent } from './meters.js';
import { MAX_STREAM_BATCH, STREAM_SESSION_TTL_MS } from './rules.js';
import type { MeterEventSender } from './sender.js';
import { StreamQueue, type Waiting } from './stream-queue.js';

/** One event as the stream takes it (the package's own parameter type). */
type WireEvent = Parameters<Stripe['v2']['billing']['meterEventStream']['create']>[0]['events'][number];

/** A session as Stripe hands it out; both times are Stripe's clock. */
export interface StreamSession {
  token: string;
  created: Date;
  expiresAt: Date;
}

/** What the batcher needs of Stripe: sessions from the secret-key client, streams from a token's. */
export interface StreamStripe {
  createSession(): Promise<StreamSession>;
  sendEvents(token: string, events: WireEvent[]): Promise<void>;
}

/** The real one: the secret-key client for sessions, a client per session token for the stream. */
export function stripeStream(secretKeyClient: Stripe, clientFor: (token: string) => Stripe): StreamStripe {
  const clients = new Map<string, Stripe>();
  return {
    async createSession() {
      const s = await secretKeyClient.v2.billing.meterEventSession.create();
      // ISO-8601 strings: parsed as such (the package's own example multiplies them by 1000).
      return { token: s.authentication_token, created: new Date(s.created), expiresAt: new Date(s.expires_at) };
    },
    async sendEvents(token, events) {
      let client = clients.get(token);
      if (!client) {
        clients.clear();
        clients.set(token, (client = clientFor(token)));
      }
      await client.v2.billing.meterEventStream.create({ events });
    },
  };
}

/** How a request failed; `requestMs` is how long the request itself took, absent when none was made (the pace or the session failed). */
interface Failure {
  err: unknown;
  requestMs?: number;
}

/** A session in use: its token, how long Stripe gave it, and when (our clock) we asked for it. */
interface HeldSession {
  token: string;
  lifetimeMs: number;
  /** Our clock when the session was requested: Stripe made it no earlier, so it lasts at least until this + lifetime. */
  askedAt: number;
  /** A stream request with it went through. */
  used: boolean;
}

/** Replace a session once less than this share of its lifetime is left ... */
const REFRESH_WHEN_LEFT = 0.25;
/** ... or this much, whichever is less (with 15-minute sessions: a minute before the end). */
const REFRESH_BEFORE_EXPIRY_MS = 60_000;
/** A gap this large between Stripe's clock and ours is logged (once). */
export const CLOCK_SKEW_WARN_MS = 30_000;
/** A failed request that took longer than this is a slow Stripe, not one bad event: it is not split. */
const SPLIT_ONLY_FAILURES_WITHIN_MS = 5_000;
/**
 * How long a customer whose event failed alone, in a split whose other requests went through, is
 * kept out of the others' requests (StreamQueue.take): a poison event comes back with its retries,
 * and each request it shared would be split again (a dozen requests and pace slots instead of one).
 * Longer than the retry policy's longest interval (5 minutes by default), and each failure of its
 * event alone, in a split or in a request of its own, sets it apart again.
 */
export const APART_MS = 10 * 60_000;

/** The arrival rate is counted over about this long (an exponentially decaying count). */
const RATE_WINDOW_MS = 1_000;
/** Waiting `maxLingerMs` is worth it when at least this many more events are expected within it. */
const LINGER_WHEN_EXPECTED = 2;

export interface MeterEventStreamOptions {
  /** How long the oldest event waits on a quiet worker (default 5 ms). */
  lingerMs?: number;
  /** How long it waits on a busy one (default 500 ms): the most a request's batching adds to an event. */
  maxLingerMs?: number;
  maxBatch?: number;
  /** Requests pacing or in flight at once (default 8); the backlog waits in the queue meanwhile. */
  maxInFlight?: number;
  /** Waits for a slot of the account-wide pace before each request. */
  pace?: () => Promise<void>;
  /** Our clock (ms); only differences of it are used to age a session. */
  now?: () => number;
  /** Backoff of session requests after failures: the first wait, and the most any one wait is. */
  sessionBackoff?: { initialMs: number; maxMs: number };
  /** Where the clock skew against Stripe goes (`billing_outbox_stripe_clock_skew_seconds`). */
  metrics?: Pick<Metrics, 'stripeClockSkew'>;
  log?: Pick<Logger, 'warn'>;
}

export class MeterEventStream implements MeterEventSender {
  readonly api = 'v2';
  private readonly queue = new StreamQueue();
  /** Customers set apart (APART_MS), and until when (performance.now()). */
  private readonly apartUntil = new Map<string, number>();
  private readonly isApart = (customer: string): boolean => {
    const until = this.apartUntil.get(customer);
    if (until === undefined) return false;
    if (until > performance.now()) return true;
    this.apartUntil.delete(customer);
    return false;
  };
  /** Set when the oldest waiting event has lingered long enough: a request may leave with fewer than 100. */
  private due = false;
  private timer: NodeJS.Timeout | undefined;
  /** A request waiting for its slot of the pace (one at a time: it takes its events once it has the slot). */
  private pacing = false;
  /** Requests pacing or in flight, each with the follow-ups of its failure. */
  private inFlight = 0;
  /** Arrivals, decayed over RATE_WINDOW_MS: about the events of the last second. */
  private recentArrivals = 0;
  private lastArrivalAt = 0;
  private session: Promise<HeldSession> | undefined;
  /** Session requests that failed, and sessions refused on first use, since a stream request last went through. */
  private sessionFailures = 0;
  private skewWarned = false;
  /** Stream requests made, for the benchmarks' requests-per-event figure. */
  requests = 0;
  /** Session requests made. */
  sessionRequests = 0;
  /** Most requests pacing or in flight at once so far. */
  peakInFlight = 0;
  /** Stripe's clock minus ours (ms), as of the last session; undefined before the first. */
  private skewMs: number | undefined;

  private readonly stripe: StreamStripe;
  private readonly opts: MeterEventStreamOptions;
  constructor(
    stripe: StreamStripe,
    opts: MeterEventStreamOptions = {},
  ) {
    this.stripe = stripe;
    this.opts = opts;
  }

  /**
   * Stripe's clock minus ours (ms), as of the last session. Before the first, a session is opened to
   * measure it (the next request uses it): events judged on an unmeasured clock before any was sent
   * would be held back, refused, or sent outside Stripe's window. No session to be had now: its
   * failure, as a request would have met it (StreamSessionError).
   */
  async clockSkewMs(): Promise<number> {
    if (this.skewMs === undefined) {
      try {
        await this.currentSession();
      } catch (err) {
        throw new StreamSessionError(err);
      }
    }
    return this.skewMs ?? 0;
  }

  /** Sends `event` in a coming request; settles with that request's outcome. */
  send(event: MeterEvent): Promise<void> {
    return new Promise((resolve, reject) => {
      const lingerMs = this.lingerMs();
      this.queue.push({ event, resolve, reject });
      this.timer ??= setTimeout(() => {
        this.timer = undefined;
        this.due = true;
        this.pump();
      }, lingerMs);
      this.pump();
    });
  }

  /** Counts the arrival and says how long a request that starts with it may wait for company. */
  private lingerMs(): number {
    const at = performance.now();
    this.recentArrivals = this.recentArrivals * Math.exp(-(at - this.lastArrivalAt) / RATE_WINDOW_MS) + 1;
    this.lastArrivalAt = at;
    const maxLingerMs = this.opts.maxLingerMs ?? 500;
    const expected = (this.recentArrivals / RATE_WINDOW_MS) * maxLingerMs;
    return expected >= LINGER_WHEN_EXPECTED ? maxLingerMs : (this.opts.lingerMs ?? 5);
  }

  private get maxBatch(): number {
    return Math.min(this.opts.maxBatch ?? MAX_STREAM_BATCH, MAX_STREAM_BATCH);
  }

  /** Starts a request if one may leave: events due or a full batch, no request pacing, a free place. */
  private pump(): void {
    if (this.pacing || this.queue.size === 0) return;
    if (!this.due && this.queue.size < this.maxBatch) return;
    if (this.inFlight >= (this.opts.maxInFlight ?? 8)) return;
    this.pacing = true;
    this.inFlight++;
    this.peakInFlight = Math.max(this.peakInFlight, this.inFlight);
    void this.request().finally(() => {
      this.inFlight--;
      this.pump();
    });
  }

  /** One request: its slot of the pace first, then the events waiting by then (up to 100), then the request and its follow-ups. */
  private async request(): Promise<void> {
    let paceFailure: unknown;
    let paced = false;
    try {
      await this.opts.pace?.();
      paced = true;
    } catch (err) {
      paceFailure = err;
    }
    const batch = this.queue.take(this.maxBatch, this.isApart);
    if (this.queue.size === 0) {
      this.due = false;
      clearTimeout(this.timer);
      this.timer = undefined;
    }
    this.pacing = false;
    // The next request may wait for its slot while this one is sent.
    this.pump();
    if (!paced) {
      // No request was made: the pace says nothing about the events, and they all take its failure.
      for (const w of batch) w.reject(paceFailure);
      return;
    }
    await this.deliver(batch);
  }

  /**
   * Sends `batch` and settles each event. A failed request is followed up level by level: a 400
   * (the request refused as a whole) is halved between customers, and one customer's events are
   * resent one by one; a failure that may pass (5xx,
   * a connection error) halves the request between customers (`halve`) and resends both halves, as
   * long as some request of the level before went through (the first split is always made).
   * Whatever is left takes its error.
   */
  private async deliver(batch: Waiting[]): Promise<void> {
    const first = await this.attempt(batch, true);
    let failing = first ? [{ batch, ...first }] : [];
    let someThrough = true;
    for (let level = 0; failing.length > 0; level++) {
      const halves: Waiting[][] = [];
      const alone: Waiting[] = [];
      for (const f of failing) {
        if (f.batch.length > 1 && refusedAsMalformed(f)) {
          // Which event made the request invalid is not said. Events of several customers are
          // halved between them first (nothing of a refused request reached Stripe): the halves
          // without the bad event go through in a request each, instead of one request per event,
          // each taking a slot of the account's pace. One customer's events go again one by one.
          if (new Set(f.batch.map((w) => w.event.stripeCustomerId)).size > 1) halves.push(...halve(f.batch));
          else alone.push(...f.batch);
        } else if (someThrough && f.batch.length > 1 && mayHalve(f)) {
          for (const w of f.batch) w.mayHaveReached ??= f.err;
          halves.push(...halve(f.batch));
        } else {
          // One event failing alone where the rest of its level went through, or in a request of
          // its customer set apart: its customer's next events go in requests of their own.
          const customer = f.batch.length === 1 && mayHalve(f) ? f.batch[0]!.event.stripeCustomerId : undefined;
          if (customer !== undefined && ((level > 0 && someThrough) || this.isApart(customer))) this.apartUntil.set(customer, performance.now() + APART_MS);
          for (const w of f.batch) rejectWith(w, f.err);
        }
      }
      const [results] = await Promise.all([
        Promise.all(halves.map(async (half) => ({ batch: half, failed: await this.attempt(half) }))),
        Promise.all(alone.map((w) => this.deliverAlone(w))),
      ]);
      failing = results.flatMap((r) => (r.failed ? [{ batch: r.batch, ...r.failed }] : []));
      // A level where no request went through (nor was answered as malformed, an answer about the
      // request): Stripe is failing, not one event; no more splits.
      someThrough = results.some((r) => !r.failed || refusedAsMalformed(r.failed));
    }
  }

  private async deliverAlone(w: Waiting): Promise<void> {
    const failed = await this.attempt([w]);
    if (failed) rejectWith(w, failed.err);
  }

  /** One request for `batch`: resolves its events and returns nothing, or returns how it failed. */
  private async attempt(batch: Waiting[], paced = false): Promise<Failure | undefined> {
    const failure = await this.post(batch.map((w) => w.event), paced);
    if (!failure) for (const w of batch) w.resolve();
    return failure;
  }

  /** One request, after its slot of the pace unless it has one (`paced`). */
  private async post(events: MeterEvent[], paced: boolean): Promise<Failure | undefined> {
    const body = events.map(toWireEvent);
    try {
      if (!paced) await this.opts.pace?.();
    } catch (err) {
      return { err };
    }
    for (let tries = 1; ; tries++) {
      let held: { pending: Promise<HeldSession>; session: HeldSession };
      try {
        held = await this.currentSession();
      } catch (err) {
        return { err: new StreamSessionError(err) };
      }
      const { pending, session } = held;
      const startedAt = performance.now();
      try {
        this.requests++;
        await this.stripe.sendEvents(session.token, body);
        session.used = true;
        this.sessionFailures = 0;
        return undefined;
      } catch (err) {
        const failure = { err, requestMs: performance.now() - startedAt };
        // The stream authenticates only by the session's token: a 401 there is about the session
        // (expired, or one Stripe no longer knows), not the key, which only the session's creation
        // can tell. Held on to, it failed every request until the session's own end, as a refused key.
        if (!isSessionExpired(err) && (err as { statusCode?: number }).statusCode !== 401) return failure;
        // Refused before it ever worked: a session that is no good, counted like a failed session request.
        if (!session.used) this.sessionFailures++;
        // Stripe's clock says the session is over before ours does: a new one, and this request again.
        if (this.session === pending) this.session = undefined;
        if (tries > 1) return failure;
      }
    }
  }

  /**
   * The session to use: the worker's, unless it is near the end of its lifetime; then a new one
   * (shared), used whatever its age: at most one session request per call.
   */
  private async currentSession(): Promise<{ pending: Promise<HeldSession>; session: HeldSession }> {
    const held = this.session;
    if (held) {
      const session = await this.settle(held);
      if (!this.spent(session)) return { pending: held, session };
      if (this.session === held) this.session = undefined;
    }
    const pending = (this.session ??= this.openSession());
    return { pending, session: await this.settle(pending) };
  }

  private async settle(pending: Promise<HeldSession>): Promise<HeldSession> {
    try {
      return await pending;
    } catch (err) {
      if (this.session === pending) this.session = undefined;
      throw err;
    }
  }

  /** Less than a quarter of its lifetime (at most a minute) left, by the time elapsed on our clock since we asked for it. */
  private spent(session: HeldSession): boolean {
    const margin = Math.min(REFRESH_BEFORE_EXPIRY_MS, session.lifetimeMs * REFRESH_WHEN_LEFT);
    return this.now() - session.askedAt >= session.lifetimeMs - margin;
  }

  /** A new session, after the backoff the failures so far call for. */
  private async openSession(): Promise<HeldSession> {
    const waitMs = this.sessionBackoffMs();
    if (waitMs > 0) await new Promise((resolve) => setTimeout(resolve, waitMs));
    const askedAt = this.now();
    this.sessionRequests++;
    let s: StreamSession;
    try {
      s = await this.stripe.createSession();
    } catch (err) {
      this.sessionFailures++;
      throw err;
    }
    const answeredAt = this.now();
    const created = s.created.getTime();
    const lifetime = s.expiresAt.getTime() - created;
    // Unreadable times: Stripe's documented 15 minutes, and Stripe's word (401) if it is less.
    const lifetimeMs = Number.isFinite(lifetime) && lifetime > 0 ? lifetime : STREAM_SESSION_TTL_MS;
    if (Number.isFinite(created)) this.observeSkew(created - (askedAt + answeredAt) / 2);
    return { token: s.token, lifetimeMs, askedAt, used: false };
  }

  /** Exponential with jitter: nothing at first; then `initialMs`, doubling, at most `maxMs`, each drawn from its upper half. */
  private sessionBackoffMs(): number {
    if (this.sessionFailures === 0) return 0;
    const { initialMs, maxMs } = this.opts.sessionBackoff ?? { initialMs: 500, maxMs: 10_000 };
    const ceiling = Math.min(maxMs, initialMs * 2 ** Math.min(this.sessionFailures - 1, 30));
    return ceiling / 2 + Math.random() * (ceiling / 2);
  }

  private observeSkew(skewMs: number): void {
    this.skewMs = skewMs;
    this.opts.metrics?.stripeClockSkew.set(skewMs / 1000);
    if (Math.abs(skewMs) >= CLOCK_SKEW_WARN_MS && !this.skewWarned) {
      this.skewWarned = true;
      this.opts.log?.warn(
        { clockSkewSeconds: Math.round(skewMs / 1000) },
        "this worker's clock is off Stripe's (Stripe's minus ours, by a meter event session's created time): fix its time sync",
      );
    }
  }

  private now(): number {
    return (this.opts.now ?? Date.now)();
  }

  /** Sends what is queued now, without lingering (a worker shutting down). */
  drain(): void {
    if (this.queue.size === 0) return;
    this.due = true;
    this.pump();
  }
}

/**
 * Settles a failed event with `err`, unless that is the account's refusal of the key (401, 403)
 * after an earlier request with the event failed in a way Stripe may have acted on (a lost answer,
 * a 5xx): then with that earlier failure. The delivery takes back an attempt refused for the key as
 * one that sent nothing (no attempt spent, the 23 h resend window not started); this one may have
 * sent the event, and its window must stand, or a resend after a long key outage could bill twice.
 */
function rejectWith(w: Waiting, err: unknown): void {
  // A failure that says nothing was sent (a refused key, no session) does not hide an earlier
  // request of the event that may have reached Stripe: the event fails with that one.
  const nothingSent = classifyStripeError(err).kind === 'credentials' || err instanceof StreamSessionError;
  w.reject(w.mayHaveReached !== undefined && nothingSent ? w.mayHaveReached : err);
}

/** Stripe answered the request itself with a 400: one of its events is malformed. */
function refusedAsMalformed(f: Failure): boolean {
  return f.requestMs !== undefined && f.err instanceof Stripe.errors.StripeInvalidRequestError;
}

/**
 * A request that failed in a way that may pass another time (5xx, 409, a connection error), not the
 * account's way (429, 401, 403), and quickly: a request that took long to fail is a slow Stripe,
 * and halving it would stack more such waits inside one attempt. A failure before any request
 * (the pace, the session) says nothing about the events.
 */
function mayHalve(f: Failure): boolean {
  if (f.requestMs === undefined || f.requestMs > SPLIT_ONLY_FAILURES_WITHIN_MS || isSessionExpired(f.err)) return false;
  return classifyStripeError(f.err).kind === 'retryable';
}

/**
 * Two requests from one that failed, split between Stripe customers: each customer's events stay
 * together, the halves as even as whole customers allow (arrival order kept within each). One
 * customer's event that breaks every request it is in then fails its own customer's half only: the
 * other half goes through, and its events are not failed for a request they shared with it. A
 * batch of one customer is cut in the middle.
 */
function halve(items: Waiting[]): [Waiting[], Waiting[]] {
  const sizes = new Map<string, number>();
  for (const w of items) sizes.set(w.event.stripeCustomerId, (sizes.get(w.event.stripeCustomerId) ?? 0) + 1);
  if (sizes.size === 1) {
    const middle = Math.ceil(items.length / 2);
    return [items.slice(0, middle), items.slice(middle)];
  }
  const first = new Set<string>();
  let taken = 0;
  for (const [customer, n] of sizes) {
    // The last customer always goes to the second half, so neither is empty.
    if (first.size === sizes.size - 1 || (taken > 0 && taken + n / 2 > items.length / 2)) break;
    first.add(customer);
    taken += n;
  }
  return [items.filter((w) => first.has(w.event.stripeCustomerId)), items.filter((w) => !first.has(w.event.stripeCustomerId))];
}

export function isSessionExpired(err: unknown): boolean {
  const e = err as { type?: string; code?: string; statusCode?: number } | null;
  return e?.type === 'TemporarySessionExpiredError' || e?.code === 'billing_meter_event_session_expired';
}

function toWireEvent(e: MeterEvent): WireEvent {
  return {
    event_name: e.eventName,
    payload: meterEventPayload(e),
    identifier: e.identifier,
    timestamp: e.occurredAt.toISOString(),
  };
}
