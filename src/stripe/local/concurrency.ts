/**
 * Requests in flight per (customer, event name).
 *
 * Stripe allows one concurrent meter-event call per customer per meter. A request counts as in
 * flight from the moment its body has arrived until its answer is due, even if the caller hung up
 * (Stripe keeps working on it), so it stays in flight during any simulated latency. Requests that end up rejected count
 * too: they arrived at the same time, which is what a pipeline must avoid.
 *
 * With zero latency a request is answered in the same tick it arrives, so overlap is rare; set a
 * latency (Stripe answers in tens of milliseconds) to make concurrency observable.
 */
export class InFlightTracker {
  private inFlight = new Map<string, number>();
  private peaks = new Map<string, number>();
  /** Bumped by reset(), so requests that started before it do not decrement the new counts. */
  private generation = 0;

  /** Registers an arriving request. `othersInFlight` counts the requests already in flight. */
  enter(customer: string, eventName: string): { othersInFlight: number; leave: () => void } {
    const pair = pairKey(customer, eventName);
    const others = this.inFlight.get(pair) ?? 0;
    this.inFlight.set(pair, others + 1);
    this.peaks.set(pair, Math.max(this.peaks.get(pair) ?? 0, others + 1));
    const generation = this.generation;
    let left = false;
    const leave = () => {
      if (left || generation !== this.generation) return;
      left = true;
      this.inFlight.set(pair, (this.inFlight.get(pair) ?? 1) - 1);
    };
    return { othersInFlight: others, leave };
  }

  /** The most requests for this pair that were in flight at once, counted at each arrival. */
  maxSeen(customer: string, eventName: string): number {
    return this.peaks.get(pairKey(customer, eventName)) ?? 0;
  }

  reset(): void {
    this.generation++;
    this.inFlight = new Map();
    this.peaks = new Map();
  }
}

function pairKey(customer: string, eventName: string): string {
  return JSON.stringify([customer, eventName]);
}
