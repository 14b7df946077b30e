/**
 * Whether Stripe is down, as this worker sees it: its calls for two customers and more have failed
 * with a 5xx or no answer, with no other answer between, for `afterMs` and more (both customers
 * within the last `afterMs`: one customer's failures, a poison event's, are that customer's, and a
 * poison event beside one stray failure of another is not an outage for long). Once down, it stays
 * down until Stripe answers (a success, a refusal, a 429) or no call has failed for `quietMs`: the
 * deliveries it holds come back every few minutes, each on whichever worker takes it.
 *
 * While Stripe is down, a delivery that fails this way waits instead of spending an attempt
 * (activities/delivery.ts), so an outage longer than the retry policy does not turn every event in
 * flight into a dead letter. Each worker judges by its own calls: no state is shared, and a worker
 * restarted mid-outage judges again from its next failures (spending the attempts they cost).
 */
export interface OutageWatch {
  /** Stripe answered (anything but a 5xx or no answer). */
  answered(): void;
  /** A call for this customer failed with a 5xx or got no answer. Returns when Stripe went down, or null. */
  failed(customer: string | null): number | null;
}

export interface OutageWatchOptions {
  /** Failures for this long, for two customers within it, before Stripe is taken for down. */
  afterMs: number;
  /**
   * Before Stripe is taken for down, a failure this long after the one before starts a new stretch;
   * once it is, this long without a failure ends the outage. Longer than the longest wait of a
   * delivery held by an outage times the workers taking them.
   */
  quietMs: number;
  now?: () => number;
}

/** Customers remembered in a stretch: enough to find two failing within `afterMs`. */
const CUSTOMERS_KEPT = 16;

export function outageWatch({ afterMs, quietMs, now = Date.now }: OutageWatchOptions): OutageWatch {
  // The stretch of failures since Stripe last answered: when it began, when it last failed, when
  // each customer (a few) last failed in it, and since when Stripe is down (null: not yet).
  let began: number | null = null;
  let last = 0;
  let down: number | null = null;
  const customers = new Map<string, number>();
  const reset = () => {
    began = null;
    down = null;
    customers.clear();
  };
  return {
    answered: reset,
    failed(customer) {
      const at = now();
      if (began !== null && at - last > quietMs) reset();
      began ??= at;
      last = at;
      if (down !== null) return down;
      if (customer !== null) {
        customers.delete(customer);
        customers.set(customer, at);
        if (customers.size > CUSTOMERS_KEPT) customers.delete(customers.keys().next().value!);
      }
      const recent = [...customers.values()].filter((t) => at - t <= afterMs).length;
      if (recent >= 2 && at - began >= afterMs) down = began;
      return down;
    },
  };
}
