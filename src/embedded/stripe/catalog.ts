/**
 * Customers and meters: the objects a meter event must refer to. `reset()` of the server keeps them.
 */
import type { MeterFormula, MeterInfo, MeterKeyOptions } from './types.js';

export interface CustomerObject {
  id: string;
  object: 'customer';
  created: number;
  livemode: false;
  name: string | null;
  email: string | null;
  metadata: Record<string, string>;
}

export interface MeterObject {
  id: string;
  object: 'billing.meter';
  created: number;
  display_name: string;
  event_name: string;
  event_time_window: null;
  livemode: false;
  status: 'active' | 'inactive';
  status_transitions: { deactivated_at: number | null };
  updated: number;
  default_aggregation: { formula: MeterFormula };
  customer_mapping: { event_payload_key: string; type: 'by_id' };
  value_settings: { event_payload_key: string };
}

export class Catalog {
  private readonly customers = new Map<string, CustomerObject>();
  private readonly meters = new Map<string, MeterObject>();
  private customerSeq = 0;
  private meterSeq = 0;

  private readonly nowSeconds: () => number;
  constructor(nowSeconds: () => number) {
    this.nowSeconds = nowSeconds;
  }

  /** Registers a customer with a chosen id (test setup; the API itself never lets you choose). */
  addCustomer(id: string, fields: Partial<Pick<CustomerObject, 'name' | 'email' | 'metadata'>> = {}): CustomerObject {
    const existing = this.customers.get(id);
    if (existing) return existing;
    const customer: CustomerObject = {
      id,
      object: 'customer',
      created: this.nowSeconds(),
      livemode: false,
      name: fields.name ?? null,
      email: fields.email ?? null,
      metadata: fields.metadata ?? {},
    };
    this.customers.set(id, customer);
    return customer;
  }

  /** POST /v1/customers: Stripe assigns the id. */
  createCustomer(fields: Partial<Pick<CustomerObject, 'name' | 'email' | 'metadata'>>): CustomerObject {
    let id: string;
    do id = `cus_local_${++this.customerSeq}`;
    while (this.customers.has(id));
    return this.addCustomer(id, fields);
  }

  customer(id: string): CustomerObject | undefined {
    return this.customers.get(id);
  }

  /** How many customers and meters there are (cheap: for LocalStripe.stateMark). */
  get counts(): string {
    return `${this.customers.size}/${this.meters.size}`;
  }

  listCustomers(): CustomerObject[] {
    // Stripe lists newest first.
    return [...this.customers.values()].reverse();
  }

  /**
   * Adds an active meter for `eventName`, or returns the existing one's id. A meter names the
   * payload keys it reads the customer and the value from (Stripe's defaults unless given), and
   * its formula (sum unless given).
   */
  addMeter(eventName: string, keys: MeterKeyOptions = {}): string {
    const existing = this.meterForEvent(eventName);
    if (existing) return existing.id;
    const id = `mtr_local_${++this.meterSeq}`;
    const now = this.nowSeconds();
    this.meters.set(id, {
      id,
      object: 'billing.meter',
      created: now,
      display_name: eventName,
      event_name: eventName,
      event_time_window: null,
      livemode: false,
      status: 'active',
      status_transitions: { deactivated_at: null },
      updated: now,
      default_aggregation: { formula: keys.formula ?? 'sum' },
      customer_mapping: { event_payload_key: keys.customerKey ?? 'stripe_customer_id', type: 'by_id' },
      value_settings: { event_payload_key: keys.valueKey ?? 'value' },
    });
    return id;
  }

  /** Stripe routes a meter event to the one active meter whose `event_name` matches exactly. */
  meterForEvent(eventName: string): MeterObject | undefined {
    for (const meter of this.meters.values()) if (meter.event_name === eventName && meter.status === 'active') return meter;
    return undefined;
  }

  /**
   * What an operator does to change a meter's payload keys (Stripe does not let them change):
   * deactivates the active meter for `eventName` and creates another with `keys`. Returns its id.
   */
  replaceMeter(eventName: string, keys: MeterKeyOptions): string {
    const old = this.meterForEvent(eventName);
    if (old) this.deactivate(old);
    return this.addMeter(eventName, keys);
  }

  /** Stripe's `POST /v1/billing/meters/:id/deactivate`: its events are refused until another meter takes the name. */
  deactivate(meter: MeterObject): MeterObject {
    if (meter.status === 'active') {
      meter.status = 'inactive';
      meter.status_transitions = { deactivated_at: this.nowSeconds() };
      meter.updated = this.nowSeconds();
    }
    return meter;
  }

  meter(id: string): MeterObject | undefined {
    return this.meters.get(id);
  }

  listMeters(): MeterObject[] {
    return [...this.meters.values()];
  }

  /** Puts back customers and meters saved by `listCustomers`/`listMeters` (ids kept). */
  restore(customers: readonly CustomerObject[], meters: readonly MeterObject[]): void {
    for (const c of [...customers].reverse()) this.customers.set(c.id, { ...c });
    for (const m of meters) this.meters.set(m.id, { ...m });
    const seq = (ids: string[], prefix: string) => Math.max(0, ...ids.map((id) => Number(id.slice(prefix.length))).filter(Number.isInteger));
    this.customerSeq = Math.max(this.customerSeq, seq([...this.customers.keys()], 'cus_local_'));
    this.meterSeq = Math.max(this.meterSeq, seq([...this.meters.keys()], 'mtr_local_'));
  }

  meterInfos(): MeterInfo[] {
    return this.listMeters().map((m) => ({ id: m.id, eventName: m.event_name }));
  }
}
