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
import { connectTemporal } from '../src/temporal/worker.js';
import { testConfig, useDatabase } from './hooks.js';

const t = useDatabase();
let temporal: Awaited<ReturnType<typeof connectTemporal>>;
const config = testConfig();
beforeAll(async () => {
  temporal = await connectTemporal(config.temporal);
});
afterAll(async () => {
  await temporal?.clientConnection.close();
  await temporal?.connection.close();
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
