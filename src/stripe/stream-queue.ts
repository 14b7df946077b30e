/**
 * What waits in the v2 batcher for a request (src/stripe/stream.ts): one queue per Stripe customer,
 * served in turn. A request is filled by taking one event of each customer in the ring, round after
 * round, and the ring goes on where the last request stopped: a customer with 20,000 events queued
 * takes one place in each round, so another customer's new event leaves in the next request, not
 * after the flood. A tenant is billed as its Stripe customer, so this is the turn per tenant the
 * claim also gives (the batcher sees events, not outbox rows).
 *
 * A customer set apart (one whose event broke requests it shared, src/stripe/stream.ts) is not mixed
 * into the others' requests: when the ring's turn starts with it, a request takes its events alone,
 * as many as a round of the ring would give it over the request (its share, not a whole request).
 *
 * An identifier already waiting is not queued twice: a second `send` of it (a retried attempt whose
 * first one gave up while its event still waited) joins the waiting one and settles with it, so one
 * request never carries an identifier twice and an event never takes two places.
 */
import type { MeterEvent } from './meters.js';

/** One event waiting for a request, and everyone waiting for its outcome. */
export interface Waiting {
  event: MeterEvent;
  resolve: () => void;
  reject: (err: unknown) => void;
  /** The failure of an earlier request with this event that Stripe may have acted on (it was followed up). */
  mayHaveReached?: unknown;
}

interface CustomerQueue {
  items: Waiting[];
  /** Index of the first event not yet taken. */
  head: number;
}

export class StreamQueue {
  /** Customer → its events in arrival order. Map order is the ring: the next customer served is the first key. */
  private readonly byCustomer = new Map<string, CustomerQueue>();
  /** Identifier → its waiting entry, while it waits. */
  private readonly byIdentifier = new Map<string, Waiting>();

  /** Events waiting. */
  get size(): number {
    return this.byIdentifier.size;
  }

  /** Queues `w` at the end of its customer's queue, or joins the entry already waiting with its identifier. */
  push(w: Waiting): void {
    const waiting = this.byIdentifier.get(w.event.identifier);
    if (waiting) {
      const { resolve, reject } = waiting;
      waiting.resolve = () => {
        resolve();
        w.resolve();
      };
      waiting.reject = (err) => {
        reject(err);
        w.reject(err);
      };
      return;
    }
    this.byIdentifier.set(w.event.identifier, w);
    const customer = w.event.stripeCustomerId;
    const queue = this.byCustomer.get(customer);
    if (queue) queue.items.push(w);
    else this.byCustomer.set(customer, { items: [w], head: 0 });
  }

  /**
   * Up to `max` events, one per customer in turn; a customer served goes to the back of the ring.
   * A customer `apart` is passed over, keeping its place, unless the turn starts with it: then its
   * events alone, its share of `max` among the customers waiting.
   */
  take(max: number, apart: (customer: string) => boolean = () => false): Waiting[] {
    const taken: Waiting[] = [];
    const first = this.byCustomer.keys().next();
    if (!first.done && apart(first.value)) {
      const share = Math.ceil(max / this.byCustomer.size);
      while (taken.length < share && this.byCustomer.has(first.value)) taken.push(this.takeOne(first.value));
      return taken;
    }
    while (taken.length < max) {
      let customer: string | undefined;
      for (const c of this.byCustomer.keys()) {
        if (!apart(c)) {
          customer = c;
          break;
        }
      }
      if (customer === undefined) break;
      taken.push(this.takeOne(customer));
    }
    return taken;
  }

  /** The next event of `customer`, which goes to the back of the ring (out of it with none left). */
  private takeOne(customer: string): Waiting {
    const queue = this.byCustomer.get(customer)!;
    const w = queue.items[queue.head++]!;
    this.byIdentifier.delete(w.event.identifier);
    this.byCustomer.delete(customer);
    if (queue.head < queue.items.length) {
      // Array.shift would copy a flood's queue on every take; the taken head is dropped in bulk.
      if (queue.head >= 1024 && queue.head * 2 >= queue.items.length) {
        queue.items.splice(0, queue.head);
        queue.head = 0;
      }
      this.byCustomer.set(customer, queue);
    }
    return w;
  }
}
