/**
 * The statuses module is the one list; the schema spells it once more (a CHECK constraint and the
 * claim's partial index cannot import TypeScript). This fails the moment the two disagree.
 */
import { expect, it } from 'vitest';
import { AT_STRIPE, AWAITING_RELAY, DELIVERED, IN_FLIGHT, OUTBOX_STATUSES, UNBILLED, UNSETTLED } from '../src/outbox/statuses.js';
import { useDatabase } from './hooks.js';

const t = useDatabase();

const quoted = (definition: string) => [...definition.matchAll(/'([a-z_]+)'::text/g)].map((m) => m[1]!).sort();

it("the schema's CHECK constraint allows exactly OUTBOX_STATUSES", async () => {
  const { rows } = await t.pool.query<{ def: string }>(
    `SELECT pg_get_constraintdef(oid) AS def FROM pg_constraint WHERE conname = 'outbox_status_check'`,
  );
  expect(rows).toHaveLength(1);
  expect(quoted(rows[0]!.def)).toEqual([...OUTBOX_STATUSES].sort());
});

it("the claim's partial indexes cover exactly AWAITING_RELAY and IN_FLIGHT", async () => {
  const def = async (name: string) =>
    (await t.pool.query<{ def: string }>(`SELECT indexdef AS def FROM pg_indexes WHERE indexname = $1`, [name])).rows[0]!.def;
  expect(quoted(await def('outbox_lane_idx'))).toEqual([...AWAITING_RELAY].sort());
  expect(quoted(await def('outbox_in_flight_idx'))).toEqual([...IN_FLIGHT].sort());
});

it('the named sets partition the statuses the way the pipeline relies on', () => {
  // Every status is either settled at Stripe, or unsettled: never both, never neither.
  expect([...AT_STRIPE, ...UNSETTLED].sort()).toEqual([...OUTBOX_STATUSES].sort());
  for (const s of [...UNBILLED, ...DELIVERED]) expect(AT_STRIPE).toContain(s);
  expect([...DELIVERED, ...UNBILLED].sort()).toEqual([...AT_STRIPE].sort());
  for (const s of AWAITING_RELAY) expect(UNSETTLED).toContain(s);
});
