/**
 * Who gets the next connection to PostgreSQL when requests outnumber them: the tenants waiting,
 * in turn. The pool alone serves its waiters first come, first served, so one tenant's flood of
 * requests put every other tenant's request behind all of its own, for as long as the flood
 * lasted (and went on running requests whose callers had given up). Here each tenant queues for
 * itself and the tenants take turns, and no request waits past its deadline: it is answered 503
 * (the client tries again with the same usage_id) instead.
 */
import { ConnectWaitError } from '../db.js';

interface Waiter {
  admit: () => void;
  refuse: () => void;
  deadline: number;
  timer: NodeJS.Timeout;
}

/** A turn that comes with less than this left is refused at once: no connection would come in time. */
const MIN_TURN_MS = 25;

export class TenantTurns {
  private active = 0;
  /** Tenant → its requests waiting, in arrival order. Map order is the turn: the first key goes next. */
  private readonly waiting = new Map<string, Waiter[]>();

  /** Requests let through at once: the pool's connections. */
  private readonly slots: number;

  constructor(slots: number) {
    this.slots = slots;
  }

  /**
   * Waits for the tenant's turn, until `deadline` (`performance.now()` ms) at most (then ConnectWaitError);
   * returns the release, to call once the request is done with the database.
   */
  async enter(tenant: string, deadline: number): Promise<() => void> {
    if (this.active < this.slots && this.waiting.size === 0) {
      this.active++;
      return this.releaser();
    }
    const waitMs = Math.max(0, deadline - performance.now());
    await new Promise<void>((resolve, reject) => {
      const queue = this.waiting.get(tenant) ?? [];
      if (queue.length === 0) this.waiting.set(tenant, queue);
      const refuse = () => reject(new ConnectWaitError(waitMs));
      const waiter: Waiter = {
        admit: resolve,
        refuse,
        deadline,
        timer: setTimeout(() => {
          queue.splice(queue.indexOf(waiter), 1);
          if (queue.length === 0 && this.waiting.get(tenant) === queue) this.waiting.delete(tenant);
          refuse();
        }, waitMs),
      };
      queue.push(waiter);
    });
    return this.releaser();
  }

  private releaser(): () => void {
    let released = false;
    return () => {
      if (released) return;
      released = true;
      this.active--;
      this.next();
    };
  }

  /**
   * Lets the next tenant's oldest request through; that tenant goes to the back of the turn. One
   * whose deadline is all but past is refused instead, and the turn goes on.
   */
  private next(): void {
    while (this.active < this.slots) {
      const first = this.waiting.entries().next();
      if (first.done) return;
      const [tenant, queue] = first.value;
      const waiter = queue.shift()!;
      this.waiting.delete(tenant);
      if (queue.length > 0) this.waiting.set(tenant, queue);
      clearTimeout(waiter.timer);
      if (waiter.deadline - performance.now() < MIN_TURN_MS) {
        waiter.refuse();
        continue;
      }
      this.active++;
      waiter.admit();
    }
  }
}
