/**
 * Account-wide request rate limit. Stripe's published limits are per second (live mode 1,000 meter
 * events/s; test mode 25 operations/s), so this admits at most `perSecond` requests in any sliding
 * one-second window of real time. Rejected requests do not use up the allowance.
 */
import { performance } from 'node:perf_hooks';

export class SlidingWindowLimiter {
  private admitted: number[] = [];

  private readonly perSecond: number | undefined;
  private readonly clock: () => number;
  constructor(
    perSecond: number | undefined,
    clock: () => number = () => performance.now(),
  ) {
    this.perSecond = perSecond;
    this.clock = clock;
  }

  tryAcquire(): boolean {
    if (this.perSecond === undefined) return true;
    const now = this.clock();
    this.admitted = this.admitted.filter((at) => now - at < 1000);
    if (this.admitted.length >= this.perSecond) return false;
    this.admitted.push(now);
    return true;
  }

  reset(): void {
    this.admitted = [];
  }
}
