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

/** Customers remembered, the least recently failed forgotten first: three are enough to judge. */
const CUSTOMERS_KEPT = 64;
/** One customer's failures closer than this count once: the events of one failed v2 request. */
const SAME_REQUEST_MS = 1_000;

/** windowMs's default: two minutes. */
export const OUTAGE_WINDOW_MS = 120_000;

export function outageWatch({ afterMs, quietMs, windowMs = OUTAGE_WINDOW_MS, now = Date.now }: OutageWatchOptions): OutageWatch {
  // Since Stripe last answered: when the failures began and the last of them, each customer's
  // (a few) failures counted, and since when Stripe is down (null: not yet).
  let began: number | null = null;
  let last = 0;
  let down: number | null = null;
  const customers = new Map<string, number[]>();
  const reset = () => {
    began = null;
    down = null;
    customers.clear();
  };
  return {
    answered: reset,
    downSince: () => (down !== null && now() - last <= quietMs ? down : null),
    failed(customer) {
      const at = now();
      if (began !== null && at - last > (down === null ? windowMs : quietMs)) reset();
      began ??= at;
      last = at;
      if (down !== null) return down;
      if (customer !== null) {
        const times = (customers.get(customer) ?? []).filter((t) => at - t <= windowMs);
        if (times.length === 0 || at - times.at(-1)! >= SAME_REQUEST_MS) times.push(at);
        customers.delete(customer);
        customers.set(customer, times);
        if (customers.size > CUSTOMERS_KEPT) customers.delete(customers.keys().next().value!);
      }
      // How often each customer failed within windowMs, most first.
      const counts = [...customers.values()].map((times) => times.filter((t) => at - t <= windowMs).length).sort((a, b) => b - a);
      const [, second = 0, third = 0] = counts;
      if ((third === 0 && second < 2) || at - began < afterMs) return null;
      // Since the failures began, or windowMs ago if that is later (a poison customer's long stretch is not the outage's).
      down = Math.max(began, at - windowMs);
      return down;
    },
  };
}
