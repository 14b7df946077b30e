/**
 * Whether Stripe is down, as this worker sees it: calls for two customers and more keep failing
 * with a 5xx or no answer, with no other answer between, for `afterMs` and more. A customer keeps
 * failing while its failures, twice and more, are each within `windowMs` of the one before and the
 * last of now: one customer's failures, a poison event's, are that customer's, and a poison
 * customer beside another's stray failures (one, or two more than `windowMs` apart) is not an
 * outage, however long the poison lasts. Once down, it stays down until Stripe answers (a success, a refusal, a 429) or no call
 * has failed for `quietMs`: the deliveries it holds come back every few minutes, each on whichever
 * worker takes it.
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
  /** When Stripe went down, as judged now (null: not down, or no failure for `quietMs`). */
  downSince(): number | null;
}

export interface OutageWatchOptions {
  /** Failures for this long, of two customers that keep failing, before Stripe is taken for down. */
  afterMs: number;
  /** Once Stripe is taken for down, this long without a failure ends the outage. Longer than the
   * longest wait of a delivery held by an outage times the workers taking them. */
  quietMs: number;
  /**
   * A customer keeps failing while its failures are this close to each other and the last to now.
   * Wider than the gap between one event's failures early in its retries with no answer at all
   * (a call timeout, the lease's unanswered hold, the backoff: about a minute with the defaults).
   */
  windowMs?: number;
  now?: () => number;
}

/** Customers remembered: enough to find two that keep failing among a few strays. */
const CUSTOMERS_KEPT = 16;

/** windowMs's default: two minutes. */
export const OUTAGE_WINDOW_MS = 120_000;

export function outageWatch({ afterMs, quietMs, windowMs = OUTAGE_WINDOW_MS, now = Date.now }: OutageWatchOptions): OutageWatch {
  // Since Stripe last answered: each customer's (a few) run of failures (when it began, its last,
  // how many), the last failure of any, and since when Stripe is down (null: not yet).
  const customers = new Map<string, { first: number; last: number; count: number }>();
  let last: number | null = null;
  let down: number | null = null;
  const reset = () => {
    down = null;
    last = null;
    customers.clear();
  };
  return {
    answered: reset,
    downSince: () => (down !== null && last !== null && now() - last <= quietMs ? down : null),
    failed(customer) {
      const at = now();
      if (down !== null && last !== null && at - last > quietMs) reset();
      last = at;
      if (down !== null) return down;
      if (customer !== null) {
        const run = customers.get(customer);
        customers.delete(customer);
        customers.set(customer, run && at - run.last <= windowMs ? { first: run.first, last: at, count: run.count + 1 } : { first: at, last: at, count: 1 });
        if (customers.size > CUSTOMERS_KEPT) customers.delete(customers.keys().next().value!);
      }
      // The customers that keep failing (twice and more, the last time within windowMs), by when
      // each began; from when the second of them began, two customers have kept failing.
      const firsts = [...customers.values()].flatMap((c) => (c.count >= 2 && at - c.last <= windowMs ? [c.first] : []));
      const [, second] = firsts.sort((x, y) => x - y);
      if (second === undefined || at - second < afterMs) return null;
      down = second;
      return down;
    },
  };
}
