/**
 * Stripe's meters: which meter an event name is recorded on, and the payload keys that meter reads.
 */
import type Stripe from 'stripe';

/**
 * The meter each event name is recorded on. Stripe routes a meter event to the one active meter
 * with that `event_name`; an inactive meter is kept only when no active one has the name.
 */
export async function metersByEventName(client: Pick<Stripe, 'billing'>): Promise<Map<string, Stripe.Billing.Meter>> {
  const byName = new Map<string, Stripe.Billing.Meter>();
  for await (const meter of client.billing.meters.list({ limit: 100 })) {
    const current = byName.get(meter.event_name);
    if (!current || (current.status !== 'active' && meter.status === 'active')) byName.set(meter.event_name, meter);
  }
  return byName;
}

/** Stripe's default payload keys, for a meter created without naming its own. */
export const DEFAULT_METER_KEYS = { customerKey: 'stripe_customer_id', valueKey: 'value' } as const;

/** Where a meter reads an event's customer and value from. */
export interface MeterKeys {
  meterId: string;
  /** `customer_mapping.event_payload_key` (Stripe's default: stripe_customer_id). */
  customerKey: string;
  /** `value_settings.event_payload_key` (Stripe's default: value). */
  valueKey: string;
}

/**
 * The payload keys of each meter, read from Stripe's meter list and cached for the life of the
 * worker. An event name not in the cache makes it read the list again (a meter created since), at
 * most once per `refreshEveryMs` however many events ask: a wrong event name in a backlog must not
 * turn into one list call per event. Stripe does not let a meter's payload keys change, so an entry
 * never goes stale; a meter deactivated since is Stripe's to refuse (`archived_meter`).
 */
export class MeterCatalog {
  private byName = new Map<string, MeterKeys>();
  private loading: Promise<void> | undefined;
  private loadedAt = Number.NEGATIVE_INFINITY;

  constructor(
    private readonly stripe: Pick<Stripe, 'billing'>,
    private readonly opts: { refreshEveryMs?: number; now?: () => number } = {},
  ) {}

  /** The keys of the active meter for `eventName`; undefined when Stripe has no active meter for it. */
  async keysFor(eventName: string): Promise<MeterKeys | undefined> {
    const cached = this.byName.get(eventName);
    if (cached) return cached;
    const now = this.opts.now ?? Date.now;
    if (now() - this.loadedAt >= (this.opts.refreshEveryMs ?? 10_000)) await this.reload();
    return this.byName.get(eventName);
  }

  /** Reads the meter list again; concurrent callers share one read. Errors reach every caller. */
  private reload(): Promise<void> {
    this.loading ??= (async () => {
      try {
        const meters = await metersByEventName(this.stripe);
        const next = new Map<string, MeterKeys>();
        for (const [name, meter] of meters) {
          if (meter.status !== 'active') continue;
          next.set(name, {
            meterId: meter.id,
            customerKey: meter.customer_mapping?.event_payload_key ?? 'stripe_customer_id',
            valueKey: meter.value_settings?.event_payload_key ?? 'value',
          });
        }
        this.byName = next;
        this.loadedAt = (this.opts.now ?? Date.now)();
      } finally {
        this.loading = undefined;
      }
    })();
    return this.loading;
  }
}
