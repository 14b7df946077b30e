/** The v2 batcher's queue, pure: customers served in turn, an identifier waiting only once. */
import { describe, expect, it } from 'vitest';
import type { MeterEvent } from '../../src/stripe/meters.js';
import { StreamQueue, type Waiting } from '../../src/stripe/stream-queue.js';

function waiting(customer: string, identifier: string, settled: string[] = []): Waiting {
  const event: MeterEvent = {
    eventName: 'api_requests',
    keys: { customerKey: 'stripe_customer_id', valueKey: 'value' },
    stripeCustomerId: customer,
    quantity: 1,
    identifier,
    occurredAt: new Date(0),
  };
  return { event, resolve: () => settled.push(`${identifier} ok`), reject: (err) => settled.push(`${identifier} ${String(err)}`) };
}

const ids = (ws: Waiting[]) => ws.map((w) => w.event.identifier);

describe('StreamQueue', () => {
  it("a flood queued first does not delay another customer's event: one each per round", () => {
    const q = new StreamQueue();
    for (let i = 0; i < 300; i++) q.push(waiting('cus_flood', `f-${i}`));
    q.push(waiting('cus_b', 'b-0'));
    q.push(waiting('cus_c', 'c-0'));
    const first = q.take(100);
    expect(ids(first).slice(0, 4)).toEqual(['f-0', 'b-0', 'c-0', 'f-1']);
    expect(first).toHaveLength(100);
    expect(q.size).toBe(202);
    // The flood's own order is kept.
    expect(ids(q.take(3))).toEqual(['f-98', 'f-99', 'f-100']);
  });

  it('the ring goes on where the last request stopped', () => {
    const q = new StreamQueue();
    for (let i = 0; i < 4; i++) {
      q.push(waiting('cus_a', `a-${i}`));
      q.push(waiting('cus_b', `b-${i}`));
      q.push(waiting('cus_c', `c-${i}`));
    }
    expect(ids(q.take(2))).toEqual(['a-0', 'b-0']);
    expect(ids(q.take(2))).toEqual(['c-0', 'a-1']);
    // A customer whose queue ran dry rejoins at the back.
    q.push(waiting('cus_d', 'd-0'));
    expect(ids(q.take(4))).toEqual(['b-1', 'c-1', 'a-2', 'd-0']);
  });

  it('an identifier already waiting takes no second place; both sends settle with it', () => {
    const settled: string[] = [];
    const q = new StreamQueue();
    q.push(waiting('cus_a', 'same', settled));
    q.push(waiting('cus_a', 'other', settled));
    q.push(waiting('cus_a', 'same', settled));
    expect(q.size).toBe(2);
    const [same, other] = q.take(100);
    expect(ids([same!, other!])).toEqual(['same', 'other']);
    same!.resolve();
    other!.reject('boom');
    expect(settled).toEqual(['same ok', 'same ok', 'other boom']);
    // Once taken, the identifier may wait again (a later attempt).
    q.push(waiting('cus_a', 'same', settled));
    expect(q.size).toBe(1);
  });

  it("a customer set apart is passed over, keeping its place, and has a take of its own when the turn starts with it", () => {
    const q = new StreamQueue();
    for (const i of [0, 1]) for (const c of ['a', 'b', 'c']) q.push(waiting(`cus_${c}`, `${c}-${i}`));
    const apart = (customer: string) => customer === 'cus_b';
    expect(ids(q.take(100, apart))).toEqual(['a-0', 'c-0', 'a-1', 'c-1']);
    expect(ids(q.take(100, apart))).toEqual(['b-0', 'b-1']);
    // Others first in the ring: passed over again; its own take when it comes first.
    q.push(waiting('cus_a', 'a-2'));
    q.push(waiting('cus_b', 'b-2'));
    q.push(waiting('cus_c', 'c-2'));
    expect(ids(q.take(1, apart))).toEqual(['a-2']);
    expect(ids(q.take(100, apart))).toEqual(['b-2']);
    expect(ids(q.take(100, apart))).toEqual(['c-2']);
    expect(q.size).toBe(0);
    // Its own take is its share of the request among the customers waiting, not a whole request.
    for (let i = 0; i < 10; i++) q.push(waiting('cus_b', `b-flood-${i}`));
    for (const c of ['a', 'c', 'd', 'e']) q.push(waiting(`cus_${c}`, `${c}-3`));
    expect(ids(q.take(10, apart))).toEqual(['b-flood-0', 'b-flood-1']);
    expect(ids(q.take(10, apart))).toEqual(['a-3', 'c-3', 'd-3', 'e-3']);
  });

  it('20,000 events of one customer come out whole and in order, 100 at a time', () => {
    const q = new StreamQueue();
    for (let i = 0; i < 20_000; i++) q.push(waiting('cus_flood', `f-${i}`));
    const out: string[] = [];
    while (q.size > 0) out.push(...ids(q.take(100)));
    expect(out).toEqual(Array.from({ length: 20_000 }, (_, i) => `f-${i}`));
    expect(q.take(100)).toEqual([]);
  });
});
