/**
 * Meter event sessions: the short-lived credentials of the v2 meter event stream.
 *
 * POST /v2/billing/meter_event_session (secret key) hands out an `authentication_token`; the stream
 * accepts only that token, never the secret key. "Authentication tokens are only valid for 15
 * minutes", counted here by the server's simulated clock, so `advanceClock` expires them and a
 * pipeline's refresh path can be tested without waiting.
 */
import { STREAM_SESSION_TTL_MS } from '../../stripe/rules.js';
import { newId } from './wire.js';

export interface MeterEventSession {
  id: string;
  token: string;
  /** ms by the simulated clock */
  createdAt: number;
  expiresAt: number;
}

export type SessionLookup = { kind: 'valid'; session: MeterEventSession } | { kind: 'expired'; session: MeterEventSession } | { kind: 'unknown' };

export class MeterEventSessions {
  private readonly byToken = new Map<string, MeterEventSession>();
  /** How long a new session lasts: Stripe's 15 minutes, unless a test wants another Stripe. */
  lifetimeMs: number;

  private readonly now: () => number;
  constructor(
    now: () => number,
    lifetimeMs = STREAM_SESSION_TTL_MS,
  ) {
    this.now = now;
    this.lifetimeMs = lifetimeMs;
  }

  /** Sessions handed out so far. */
  get issued(): number {
    return this.byToken.size;
  }

  create(): MeterEventSession {
    const createdAt = this.now();
    const session: MeterEventSession = {
      id: newId('mes_local', 24),
      // Opaque to clients; the prefix only makes a token recognisable in a log.
      token: newId('ek_test', 48),
      createdAt,
      expiresAt: createdAt + this.lifetimeMs,
    };
    this.byToken.set(session.token, session);
    return session;
  }

  /** Expired sessions are kept, so their token answers "expired" rather than "unknown". */
  lookup(token: string | undefined): SessionLookup {
    const session = token === undefined ? undefined : this.byToken.get(token);
    if (!session) return { kind: 'unknown' };
    return this.now() >= session.expiresAt ? { kind: 'expired', session } : { kind: 'valid', session };
  }
}

/** The 200 body: a `v2.billing.meter_event_session`, its times in ISO-8601 like every v2 object. */
export function sessionBody(session: MeterEventSession): Record<string, unknown> {
  return {
    id: session.id,
    object: 'v2.billing.meter_event_session',
    authentication_token: session.token,
    created: new Date(session.createdAt).toISOString(),
    expires_at: new Date(session.expiresAt).toISOString(),
    livemode: false,
  };
}
