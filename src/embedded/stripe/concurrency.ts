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
  /** Per pair, when each request still in flight is due to be answered (ms, monotonic clock). */
  private inFlight = new Map<string, Set<{ due: number }>>();
  private peaks = new Map<string, number>();

  /**
   * Registers an arriving request whose answer is due in `latencyMs`. `othersInFlight` counts the
   * requests of the pair whose answers were not yet due when this one arrived. Judged by the clock,
   * not by when a timer of this process fires: a stalled process is not Stripe, and must not make
   * two calls overlap that did not. `leave()` ends the request early (answered before its time).
   */
  enter(customer: string, eventName: string, latencyMs = 0): { othersInFlight: number; leave: () => void } {
    const pair = pairKey(customer, eventName);
    const now = performance.now();
    const flights = this.inFlight.get(pair) ?? new Set();
    for (const f of flights) if (f.due <= now) flights.delete(f);
    const others = flights.size;
    const flight = { due: now + Math.max(0, latencyMs) };
    // Answered in the same tick (no latency): in flight for that instant only.
    if (latencyMs > 0) flights.add(flight);
    this.inFlight.set(pair, flights);
    this.peaks.set(pair, Math.max(this.peaks.get(pair) ?? 0, others + 1));
    const leave = () => {
      flight.due = Math.min(flight.due, performance.now());
      flights.delete(flight);
    };
    return { othersInFlight: others, leave };
  }

  /** Requests of every pair whose answers are not yet due. */
  totalNow(): number {
    const now = performance.now();
    let n = 0;
    for (const flights of this.inFlight.values()) for (const f of flights) if (f.due > now) n++;
    return n;
  }

  /** The most requests for this pair that were in flight at once, counted at each arrival. */
  maxSeen(customer: string, eventName: string): number {
    return this.peaks.get(pairKey(customer, eventName)) ?? 0;
  }

  reset(): void {
    this.inFlight = new Map();
    this.peaks = new Map();
  }
}

function pairKey(customer: string, eventName: string): string {
  return JSON.stringify([customer, eventName]);
}
