/**
 * The relay's lane window against a real Temporal whose answers can be slowed: a busy lane keeps
 * growing its share while Temporal starts workflows quickly, and is held to the window's floor
 * while quiet tenants' events are being claimed beside it and the starts are slow. The unit test
 * (`unit/lane-window.test.ts`) checks the window's rules; this checks that the relay feeds it what
 * the claim says and claims by it.
 */
import net from 'node:net';
import { randomUUID } from 'node:crypto';
import { Client } from '@temporalio/client';
import { MockActivityEnvironment } from '@temporalio/testing';
import { NativeConnection } from '@temporalio/worker';
import { Registry } from 'prom-client';
import { afterAll, beforeAll, expect, it } from 'vitest';
import { createRelayActivities } from '../activities/relay.js';
import { withTransaction } from '../src/db.js';
import { createMetrics } from '../src/metrics.js';
import { recordUsage } from '../src/outbox/enqueue.js';
import { LaneWindow, laneWindowFloor } from '../src/outbox/lane-window.js';
import { OutboxNotifier } from '../src/outbox/notifier.js';
import { testConfig, useDatabase } from './hooks.js';

const LANE = 20;
const FLOOR = laneWindowFloor(LANE);
const QUIET = ['quiet1', 'quiet2', 'quiet3', 'quiet4', 'quiet5'];
const t = useDatabase({ customers: { flood: 'cus_flood', ...Object.fromEntries(QUIET.map((q) => [q, `cus_${q}`])) } });

/** A TCP proxy in front of Temporal that holds every chunk, both ways, `delayMs` (in order). */
let delayMs = 0;
let slow: net.Server;
const sockets = new Set<net.Socket>();
let connection: NativeConnection;
let client: Client;
// v2 lanes of 20 (floor 2); starts go to a task queue nobody polls: only the relay is under test.
const config = testConfig({ STRIPE_METER_API: 'v2', LANE_MAX_IN_FLIGHT: String(LANE), TEMPORAL_TASK_QUEUE: `idle-${randomUUID()}` });

beforeAll(async () => {
  const [host, port] = (config.temporal.address ?? '').split(':') as [string, string];
  const forward = (from: net.Socket, to: net.Socket) =>
    from.on('data', (bytes: Buffer) => (delayMs === 0 ? to.write(bytes) : setTimeout(() => to.write(bytes), delayMs)));
  slow = net.createServer((client) => {
    const upstream = net.connect(Number(port), host);
    for (const s of [client, upstream]) sockets.add(s.setNoDelay(true));
    forward(client, upstream);
    forward(upstream, client);
    const end = () => (client.destroy(), upstream.destroy());
    client.on('error', end).on('close', end);
    upstream.on('error', end).on('close', end);
  });
  await new Promise<void>((resolve) => slow.listen(0, '127.0.0.1', resolve));
  const address = `127.0.0.1:${(slow.address() as net.AddressInfo).port}`;
  // A worker's own kind of connection: the relay starts workflows eagerly, as in a worker.
  connection = await NativeConnection.connect({ address });
  client = new Client({ connection, namespace: config.temporal.namespace });
});

afterAll(async () => {
  await connection?.close();
  for (const s of sockets) s.destroy();
  await new Promise((resolve) => slow?.close(resolve));
});

/** What the flood's lane has claimed so far (claimed, dispatched or sent). */
async function floodClaimed(): Promise<number> {
  const { rows } = await t.pool.query(`SELECT count(*)::int AS n FROM outbox WHERE tenant_id = 'flood' AND status <> 'pending'`);
  return rows[0].n;
}

/** What the flood's lane has claimed or dispatched, sampled. */
async function floodInFlight(): Promise<number> {
  const { rows } = await t.pool.query(`SELECT count(*)::int AS n FROM outbox WHERE tenant_id = 'flood' AND status IN ('claimed', 'dispatched')`);
  return rows[0].n;
}

it('holds a busy lane to its floor beside quiet tenants while starts are slow, then pauses it, and lets it grow while they are quick', async () => {
  await t.pool.query(
    `INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key, usage_id)
     SELECT 'flood', 'api_requests', 1, now(), 'flood:' || g, 'flood-' || g FROM generate_series(1, 2000) g`,
  );
  const metrics = createMetrics(new Registry());
  const window = async () => (await metrics.laneWindow.get()).values[0]!.value;
  const pause = async () => (await metrics.lanePause.get()).values[0]!.value;
  const notifier = new OutboxNotifier(t.db.url);
  // One relay's activities for the whole test: the window lives as long as the worker's relays.
  // Congested from 200 ms, not 15: in CI other test files share this Temporal and both cores, and a
  // quick phase must not read their noise as congestion (at 50 ms it did once, and at 100 ms with
  // three files at once, in fresh-clone runs). The slow phase's starts take 400 ms or more.
  const laneWindow = new LaneWindow(LANE, { congestedStartMs: 200 });
  const { relayOutbox } = createRelayActivities({ db: t.pool, client, notifier, config, runForMs: 3_500, metrics, laneWindow });

  /**
   * Runs the relay for its runForMs while, every 100 ms, the lanes' deliveries "finish" (their rows
   * marked sent) and a quiet tenant records a new event. Returns the flood's in-flight, sampled
   * just before each finish, over the last second.
   */
  async function relayBesideQuietTenants(): Promise<number[]> {
    let running = true;
    const samples: { at: number; n: number }[] = [];
    const others = (async () => {
      for (let i = 0; running; i++) {
        await new Promise((resolve) => setTimeout(resolve, 100));
        samples.push({ at: Date.now(), n: await floodInFlight() });
        await t.pool.query(`UPDATE outbox SET status = 'sent', sent_at = now() WHERE status = 'dispatched'`);
        await withTransaction(t.pool, (c) => recordUsage(c, { usageId: randomUUID(), tenantId: QUIET[i % QUIET.length]!, quantity: 1 }));
      }
    })();
    try {
      await new MockActivityEnvironment().run(relayOutbox, 'relay-window');
    } finally {
      running = false;
      await others;
    }
    const end = samples.at(-1)!.at;
    return samples.filter((s) => s.at > end - 1_000).map((s) => s.n);
  }

  try {
    // Quick starts: the window starts from its floor (quiet tenants are served) and grows a step a second.
    const quick = await relayBesideQuietTenants();
    expect(await window()).toBeGreaterThan(FLOOR);
    expect(Math.max(...quick)).toBeGreaterThan(FLOOR);

    // Temporal slow to answer (every start 2 × 200 ms on the wire): held to the floor.
    delayMs = 200;
    const held = await relayBesideQuietTenants();
    expect(await window()).toBe(FLOOR);
    expect(Math.max(...held)).toBeLessThanOrEqual(FLOOR);

    // Still slow, at the floor: the lane now waits a pause (up to a second) after each claim of its
    // rows. Unpaused, a claim every ~400 ms takes FLOOR of them (~16 in the 3.5 s); paused, a claim
    // every 1.4 s or more (3 claims, 6 rows).
    expect(await pause()).toBeGreaterThan(0);
    const before = await floodClaimed();
    await relayBesideQuietTenants();
    expect(await pause()).toBe(1);
    expect((await floodClaimed()) - before).toBeLessThanOrEqual(5 * FLOOR);
  } finally {
    delayMs = 0;
    await notifier.close();
  }
});
