/**
 * The LISTEN/NOTIFY notifier and the relay activity around it, when PostgreSQL's LISTEN connection
 * cannot be made: the relay must go on claiming and heartbeating (its polling covers what it does
 * not hear), not wait for the connection.
 */
import { MockActivityEnvironment } from '@temporalio/testing';
import { afterAll, beforeAll, expect, it } from 'vitest';
import { createRelayActivities } from '../activities/relay.js';
import net from 'node:net';
import { OutboxNotifier } from '../src/outbox/notifier.js';
import { schemaFor } from '../src/outbox/sql/schema.js';
import { connectTemporal } from '../src/temporal/worker.js';
import { cleanUpAway, failingOver } from './away.js';
import { testConfig, useDatabase, waitFor } from './hooks.js';

const t = useDatabase();
let temporal: Awaited<ReturnType<typeof connectTemporal>>;
const config = testConfig();
beforeAll(async () => {
  temporal = await connectTemporal(config.temporal);
});
afterAll(async () => {
  await temporal?.close();
  await cleanUpAway();
});

/**
 * A port held for the test by a server that hangs up on every connection: no database there, and
 * nothing else can take the port meanwhile (a port found free and let go could be).
 */
let refusing: net.Server;
let refusingPort: number;
beforeAll(async () => {
  refusing = net.createServer((socket) => socket.destroy());
  await new Promise<void>((resolve) => refusing.listen(0, '127.0.0.1', resolve));
  refusingPort = (refusing.address() as net.AddressInfo).port;
});
afterAll(() => new Promise<void>((resolve) => refusing.close(() => resolve())));

it('start() returns at once while the database refuses connections, and wait() still times out', async () => {
  // Every connection to this port is hung up on at once.
  const notifier = new OutboxNotifier(`postgres://nobody:secret@127.0.0.1:${refusingPort}/nothing`);
  try {
    expect(notifier.start()).toBeUndefined();
    expect(notifier.listening).toBe(false);
    await notifier.wait(50);
    expect(notifier.listening).toBe(false);
  } finally {
    await notifier.close();
  }
});

it('the relay activity keeps polling and heartbeating while its LISTEN connection is down', async () => {
  const notifier = new OutboxNotifier(`postgres://nobody:secret@127.0.0.1:${refusingPort}/nothing`);
  const { relayOutbox } = createRelayActivities({
    db: t.pool,
    client: temporal.client,
    notifier,
    config,
    runForMs: 1_500,
  });
  const env = new MockActivityEnvironment();
  let heartbeats = 0;
  env.on('heartbeat', () => heartbeats++);
  try {
    // Bounded by runForMs: before the fix it never got past awaiting the connection.
    const result = await env.run(relayOutbox, 'relay-test');
    expect(result).toEqual({ claimed: 0, started: 0, alreadyStarted: 0, failedToStart: 0, refused: 0, closedRuns: 0 });
    expect(heartbeats).toBeGreaterThanOrEqual(2);
  } finally {
    await notifier.close();
  }
}, 20_000);

it('a LISTEN connection gone silent (a failover) is found by its probe and replaced: notifications are heard again', async () => {
  const proxy = await failingOver(t.db.url);
  const notifier = new OutboxNotifier(proxy.url, undefined, { probeEveryMs: 500 });
  try {
    notifier.start();
    await waitFor('listening', async () => notifier.listening);
    const heard = async () => {
      const mark = notifier.mark();
      await t.pool.query(`NOTIFY "${schemaFor().outboxChannel}"`);
      await notifier.wait(500, undefined, mark);
      return notifier.mark() !== mark;
    };
    expect(await heard()).toBe(true);
    proxy.failOver();
    expect(await heard()).toBe(false);
    // Asked every 500 ms, unanswered for 5 s: replaced over a new connection, which hears again.
    await waitFor('a notification heard after the failover', heard, 30_000);
  } finally {
    await notifier.close();
  }
});

it('a server that goes silent after the start-up, before LISTEN is answered, is left for a new connection that listens', async () => {
  // A proxy that carries the start-up, then holds the first connection's LISTEN unanswered for good.
  const target = new URL(t.db.url);
  const sockets: net.Socket[] = [];
  let silenced = 0;
  const proxy = net.createServer((client) => {
    const upstream = net.connect(Number(target.port), target.hostname);
    sockets.push(client, upstream);
    let silent = false;
    client.on('data', (bytes: Buffer) => {
      if (!silent && silenced === 0 && bytes.includes('LISTEN')) {
        silent = true;
        silenced++;
      }
      if (!silent) upstream.write(bytes);
    });
    upstream.on('data', (bytes: Buffer) => void (silent || client.write(bytes)));
    const end = () => (client.destroy(), upstream.destroy());
    client.on('error', end).on('close', end);
    upstream.on('error', end).on('close', end);
  });
  await new Promise<void>((resolve) => proxy.listen(0, '127.0.0.1', resolve));
  const url = new URL(t.db.url);
  url.hostname = '127.0.0.1';
  url.port = String((proxy.address() as net.AddressInfo).port);
  const notifier = new OutboxNotifier(url.toString(), undefined, { probeEveryMs: 500 });
  try {
    notifier.start();
    // Its LISTEN unanswered for 5 s, then a new connection.
    await waitFor('listening over a second connection', async () => notifier.listening, 20_000);
    expect(silenced).toBe(1);
    const mark = notifier.mark();
    await t.pool.query(`NOTIFY "${schemaFor().outboxChannel}"`);
    await notifier.wait(2_000, undefined, mark);
    expect(notifier.mark()).not.toBe(mark);
  } finally {
    await notifier.close();
    for (const s of sockets) s.destroy();
    await new Promise((resolve) => proxy.close(resolve));
  }
}, 40_000);

it('closed while it connects: the connection it was making is ended, not left listening for good', async () => {
  const database = decodeURIComponent(new URL(t.db.url).pathname.slice(1));
  // Only connections made from here on (the tests above leave theirs to the server to end).
  const since = (await t.pool.query<{ now: Date }>('SELECT clock_timestamp() AS now')).rows[0]!.now;
  const listeners = async () =>
    Number(
      (await t.pool.query(`SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND application_name = 'billing-outbox-listen' AND backend_start >= $2`, [database, since])).rows[0]
        .count,
    );
  const notifier = new OutboxNotifier(t.db.url, undefined, { probeEveryMs: 500 });
  notifier.start();
  await notifier.close();
  // Long enough for the connect and its LISTENs to have finished.
  await new Promise((r) => setTimeout(r, 1_500));
  expect(notifier.listening).toBe(false);
  expect(await listeners()).toBe(0);
});

it('the outbox insert trigger notifies the schema channel at commit, unless the session set billing_outbox.notify = off', async () => {
  const listener = await t.pool.connect();
  const heard: string[] = [];
  listener.on('notification', (n) => heard.push(n.payload ?? ''));
  const channel = schemaFor().outboxChannel;
  await listener.query(`LISTEN "${channel}"`);
  const insert = (c: { query: (text: string, values: unknown[]) => Promise<unknown> }, id: string) =>
    c.query(`INSERT INTO outbox (tenant_id, usage_id, event_name, quantity, occurred_at, idempotency_key) VALUES ('acme', $1, 'api_requests', 1, now(), 'u:acme:' || $1)`, [id]);
  await t.pool.query(`INSERT INTO billing_customers VALUES ('acme', 'cus_acme') ON CONFLICT DO NOTHING`);
  const writer = await t.pool.connect();
  try {
    // Delivered in commit order: quiet insert, a marker, a notifying insert (the trigger's payload is empty).
    await writer.query('BEGIN');
    await writer.query(`SET LOCAL billing_outbox.notify = off`);
    await insert(writer, `quiet-${Date.now()}`);
    await writer.query('COMMIT');
    await writer.query('SELECT pg_notify($1, $2)', [channel, 'marker']);
    await writer.query('BEGIN');
    await insert(writer, `loud-${Date.now()}`);
    await writer.query('COMMIT');
    await waitFor('the notifying commit heard', async () => heard.length >= 2, 5_000);
    expect(heard).toEqual(['marker', '']);
  } finally {
    await listener.query('UNLISTEN *');
    listener.release();
    writer.release();
  }
});
