/**
 * Whether Stripe is down, as this worker sees it: its calls have failed with a 5xx or no answer,
 * with no other answer between, for `afterMs` and more, and within the last `windowMs` for three
 * customers and more, or for two of which each failed twice. One customer's failures, a poison
 * event's, are that customer's; a poison customer beside another's stray failure is not an
 * outage, however long the poison lasts (two other customers failing within `windowMs`, or one
 * twice, with no answer from Stripe on this worker between, is taken for one). Three customers
 * are enough: with several workers, a customer's retries land on any of them, and each worker may
 * see each customer fail once. Failures of one customer less than a second apart count once (the
 * events of one failed v2 request). Once down, it stays down until Stripe answers (a success, a
 * refusal, a 429) or no call has failed for `quietMs`: the deliveries it holds come back every few
 * minutes, each on whichever worker takes it.
 *
 * While Stripe is down, a delivery that fails this way waits instead of spending an attempt
 * (activities/delivery.ts), so an outage longer than the retry policy does not turn every event in
 * flight into a dead letter. Each worker judges by its own calls: no state is shared, and a worker
 * restarted mid-outage judges again from its next failures (spending the attempts they cost),
 * except that a delivery held comes back with the judgement that held it (DeliverInput).
 */
export interface OutageWatch {
  /** Stripe answered (anything but a 5xx or no answer). */
  answered(): void;
  /** A call for this customer failed with a 5xx or got no answer. Returns when Stripe went down, or null. */
  failed(customer: string | null): number | null;
  /** When Stripe went down, as judged now (null: not down, or no failure for `quietFor`, `quietMs` by default). */
  downSince(quietFor?: number): number | null;
  /** Whether Stripe has answered this worker since `at` (ms). */
  answeredSince(at: number): boolean;
}

export interface OutageWatchOptions {
  /** Failures, with no answer between, for this long before Stripe is taken for down. */
  afterMs: number;
  /**
   * Once Stripe is taken for down, this long without a failure ends the outage. Longer than the
   * longest wait of a delivery held by an outage times the workers taking them.
   */
  quietMs: number;
  /**
   * How far back the customers failing are counted; before Stripe is taken for down, a failure
   * this long after the one before starts afresh. Wider than the gap between one event's failures
   * early in its retries with no answer at all (a call timeout, the lease's unanswered hold, the
   * backoff: about a minute with the defaults).
   */
  windowMs?: number;
  now?: () => number;
}

/**
 * Customers remembered, the least recently failed forgotten first: more than fail within windowMs
 * in all but the largest outages (whose customers then fail in turn faster than afterMs).
 */
const CUSTOMERS_KEPT = 4_096;
/** One customer's failures closer than this count once: the events of one failed v2 request. */
const SAME_REQUEST_MS = 1_000;

/** windowMs's default: two minutes. */
export const OUTAGE_WINDOW_MS = 120_000;

export function outageWatch({ afterMs, quietMs, windowMs = OUTAGE_WINDOW_MS, now = Date.now }: OutageWatchOptions): OutageWatch {
  // Since Stripe last answered: when the failures began and the last of them, each customer's run
  // of failures (each within windowMs of the one before: when it began, its last, how many), and
  // since when Stripe is down (null: not yet).
  let began: number | null = null;
  let last = 0;
  let down: number | null = null;
  let answeredAt = -Infinity;
  const customers = new Map<string, { first: number; last: number; count: number }>();
  const reset = () => {
    began = null;
    down = null;
    customers.clear();
  };
  return {
    answered() {
      answeredAt = now();
      reset();
    },
    answeredSince: (at) => answeredAt >= at,
    downSince: (quietFor = quietMs) => (down !== null && now() - last <= quietFor ? down : null),
    failed(customer) {
      const at = now();
      if (began !== null && at - last > (down === null ? windowMs : quietMs)) reset();
      began ??= at;
      last = at;
      if (down !== null) return down;
      if (customer !== null) {
        const run = customers.get(customer);
        customers.delete(customer);
        if (!run || at - run.last > windowMs) customers.set(customer, { first: at, last: at, count: 1 });
        else customers.set(customer, { first: run.first, last: at, count: run.count + (at - run.last >= SAME_REQUEST_MS ? 1 : 0) });
        if (customers.size > CUSTOMERS_KEPT) customers.delete(customers.keys().next().value!);
      }
      // The customers failing now (their last failure within windowMs), the most failing first.
      for (const [c, run] of customers) if (at - run.last > windowMs) customers.delete(c);
      const failing = [...customers.values()].sort((a, b) => b.count - a.count);
      const [, second, third] = failing;
      if (!third && (second?.count ?? 0) < 2) return null;
      // Timed from when the second customer began failing: a poison customer's long stretch is
      // not the outage's.
      const [, from] = failing.map((run) => run.first).sort((a, b) => a - b) as [number, number];
      if (at - from < afterMs) return null;
      down = from;
      return down;
    },
  };
}
