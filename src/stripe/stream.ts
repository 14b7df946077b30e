/**
 * Stripe's v2 meter event stream (STRIPE_METER_API=v2), one batcher per worker: deliveries hand
 * their event to `send`, which resolves when the request carrying it was accepted (or rejects with
 * that request's error, for the delivery to classify like any Stripe failure). Up to 100 events go
 * in one request (Stripe's limit); a batch leaves when it is full or `lingerMs` after its first
 * event, so an idle worker adds a few milliseconds and a busy one fills its requests.
 *
 * The stream authenticates with a session token (`POST /v2/billing/meter_event_session`, valid
 * 15 minutes): created when first needed, shared by the worker's requests, replaced a minute
 * before it expires and at once when Stripe says it expired (`temporary_session_expired`, one
 * retry of that request with the new token).
 *
 * A request Stripe refuses as a whole (400) when it carried several events is sent again one event
 * per request: one malformed event must not take 99 good ones down with it. Duplicates of an
 * identifier are dropped by Stripe silently (24 h), so a resend after a lost answer is harmless.
 */
import Stripe from 'stripe';
import { meterEventPayload, type MeterEvent } from './meters.js';
import { MAX_STREAM_BATCH } from './rules.js';
import type { MeterEventSender } from './sender.js';

/** One event as the stream takes it (the package's own parameter type). */
type WireEvent = Parameters<Stripe['v2']['billing']['meterEventStream']['create']>[0]['events'][number];

/** What the batcher needs of Stripe: sessions from the secret-key client, streams from a token's. */
export interface StreamStripe {
  createSession(): Promise<{ token: string; expiresAt: Date }>;
  sendEvents(token: string, events: WireEvent[]): Promise<void>;
}

/** The real one: the secret-key client for sessions, a client per session token for the stream. */
export function stripeStream(secretKeyClient: Stripe, clientFor: (token: string) => Stripe): StreamStripe {
  const clients = new Map<string, Stripe>();
  return {
    async createSession() {
      const s = await secretKeyClient.v2.billing.meterEventSession.create();
      // An ISO-8601 string: parsed as one (the package's own example multiplies it by 1000).
      return { token: s.authentication_token, expiresAt: new Date(s.expires_at) };
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

interface Waiting {
  event: MeterEvent;
  resolve: () => void;
  reject: (err: unknown) => void;
}

const REFRESH_BEFORE_EXPIRY_MS = 60_000;

export class MeterEventStream implements MeterEventSender {
  readonly api = 'v2';
  private queue: Waiting[] = [];
  private timer: NodeJS.Timeout | undefined;
  private session: Promise<{ token: string; expiresAt: Date }> | undefined;
  /** Requests made, for the benchmarks' requests-per-event figure. */
  requests = 0;

  constructor(
    private readonly stripe: StreamStripe,
    private readonly opts: {
      lingerMs?: number;
      maxBatch?: number;
      /** Waits for a slot of the account-wide pace before each request. */
      pace?: () => Promise<void>;
      now?: () => number;
    } = {},
  ) {}

  /** Sends `event` in the next batch; settles with that batch's outcome. */
  send(event: MeterEvent): Promise<void> {
    return new Promise((resolve, reject) => {
      this.queue.push({ event, resolve, reject });
      if (this.queue.length >= (this.opts.maxBatch ?? MAX_STREAM_BATCH)) this.flush();
      else this.timer ??= setTimeout(() => this.flush(), this.opts.lingerMs ?? 5);
    });
  }

  private flush(): void {
    clearTimeout(this.timer);
    this.timer = undefined;
    while (this.queue.length > 0) {
      const batch = this.queue.splice(0, this.opts.maxBatch ?? MAX_STREAM_BATCH);
      void this.deliver(batch);
    }
  }

  private async deliver(batch: Waiting[]): Promise<void> {
    try {
      await this.post(batch.map((w) => w.event));
      for (const w of batch) w.resolve();
    } catch (err) {
      if (batch.length > 1 && err instanceof Stripe.errors.StripeInvalidRequestError) {
        // Which event made the request invalid is not said: each one goes again on its own.
        await Promise.all(batch.map((w) => this.deliver([w])));
        return;
      }
      for (const w of batch) w.reject(err);
    }
  }

  private async post(events: MeterEvent[]): Promise<void> {
    await this.opts.pace?.();
    const body = events.map(toWireEvent);
    for (let tries = 1; ; tries++) {
      const { pending, token } = await this.currentSession();
      try {
        this.requests++;
        await this.stripe.sendEvents(token, body);
        return;
      } catch (err) {
        if (!isSessionExpired(err) || tries > 1) throw err;
        // Stripe's clock says the session is over before ours does: a new one, and this request again.
        if (this.session === pending) this.session = undefined;
      }
    }
  }

  /** The session to use: the worker's, unless it expires within a minute (then a new one, shared). */
  private async currentSession(): Promise<{ pending: Promise<{ token: string; expiresAt: Date }>; token: string }> {
    for (;;) {
      const pending = (this.session ??= this.stripe.createSession());
      let session: { token: string; expiresAt: Date };
      try {
        session = await pending;
      } catch (err) {
        if (this.session === pending) this.session = undefined;
        throw err;
      }
      if (session.expiresAt.getTime() - (this.opts.now ?? Date.now)() > REFRESH_BEFORE_EXPIRY_MS) return { pending, token: session.token };
      if (this.session === pending) this.session = undefined;
    }
  }

  /** Sends what is queued now (a worker shutting down). */
  drain(): void {
    this.flush();
  }
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
