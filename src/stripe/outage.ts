/**
 * Whether Stripe is down, as this worker sees it: its calls to more than one customer have failed
 * with a 5xx or no answer, with no other answer between, for `afterMs` and more. One customer's
 * failures are that customer's (a poison event spends its attempts and goes dead as before); any
 * answer from Stripe (a success, a refusal, a 429) ends the outage at once.
 *
 * While Stripe is down, a delivery that fails this way waits instead of spending an attempt
 * (activities/delivery.ts), so an outage longer than the retry policy does not turn every event in
 * flight into a dead letter. Each worker judges by its own calls: no state is shared, and a worker
 * restarted mid-outage judges again from its next failures.
 */
export interface OutageWatch {
  /** Stripe answered (anything but a 5xx or no answer). */
  answered(): void;
  /** A call for this customer failed with a 5xx or got no answer. Returns when Stripe went down, or null. */
  failed(customer: string | null): number | null;
}

export interface OutageWatchOptions {
  /** Failures for this long (and for two customers at least) before Stripe is taken for down. */
  afterMs: number;
  /**
   * A failure this long after the one before starts a new stretch: the two are not one outage.
   * Longer than the longest wait of a delivery held by an outage, whose next call is the next failure.
   */
  gapMs: number;
  now?: () => number;
}

export function outageWatch({ afterMs, gapMs, now = Date.now }: OutageWatchOptions): OutageWatch {
  // The stretch of failures since Stripe last answered: when it began, when it last failed, and
  // (up to two) customers it failed for.
  let began: number | null = null;
  let last = 0;
  const customers = new Set<string>();
  return {
    answered() {
      began = null;
      customers.clear();
    },
    failed(customer) {
      const at = now();
      if (began === null || at - last > gapMs) {
        began = at;
        customers.clear();
      }
      last = at;
      if (customer !== null && customers.size < 2) customers.add(customer);
      return customers.size >= 2 && at - began >= afterMs ? began : null;
    },
  };
}
