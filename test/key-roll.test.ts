/**
 * Keys rolled while the workers run, each from a secret mounted as a file (a Kubernetes secret),
 * which the running worker reads again (src/key-file.ts), with no restart:
 * - Stripe's "roll key" can expire the old key at once; STRIPE_API_KEY_FILE is then rewritten. The
 *   events refused meanwhile are held, not dead, and each is billed once with the new key.
 * - A Temporal Cloud API key is rotated by making a second key, putting it in TEMPORAL_API_KEY_FILE
 *   and deleting the first once nothing uses it. Here Temporal Cloud's key check is a proxy in
 *   front of the dev server (test/api-key-proxy.ts), over TLS as Cloud is.
 * - An mTLS client certificate is renewed before it expires (cert-manager rewrites the secret's
 *   files) and the old one is revoked: the running worker connects again with the new files.
 *   Here the server's certificate check is a TLS proxy that accepts the certificates it is told.
 */
import { randomUUID, X509Certificate } from 'node:crypto';
import { copyFileSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import type tls from 'node:tls';
import { afterAll, afterEach, beforeAll, beforeEach, describe, expect, inject, it } from 'vitest';
import { checkHealth, temporalHealthConnection } from '../src/api/health.js';
import { createLogger } from '../src/log.js';
import { outboxStatus } from '../src/ops/status.js';
import { createWorker } from '../src/worker.js';
import { KEY_FILE_RECHECK_MS } from '../src/key-file.js';
import { CREDENTIALS_REFUSED } from '../src/stripe/errors.js';
import { startApiKeyProxy, type ApiKeyProxy } from './api-key-proxy.js';
import { certMaker, SERVER_EXT, startMtlsFrontend, type MtlsFrontend } from './certs.js';
import { useStripe, waitFor, workflowBundle } from './hooks.js';
import './provided.js';

const t = useStripe({ perTest: true, customers: { acme: 'cus_acme', globex: 'cus_globex' }, stripe: { meters: ['api_requests'] } });

let dir: string;
beforeEach(() => void (dir = mkdtempSync(path.join(tmpdir(), 'key-roll-'))));
afterEach(() => rmSync(dir, { recursive: true, force: true }));

it.each(['v1', 'v2'])('%s: a key rolled in its file is taken up by the running worker; what was refused meanwhile is billed once', async (api) => {
  const file = path.join(dir, 'stripe-api-key');
  writeFileSync(file, 'sk_test_before_roll\n');
  t.stripe.rollApiKey('sk_test_before_roll');
  // v2 sends with a meter event session's token, made with the key: short sessions, so the worker
  // needs a new one (and the key) soon after the roll.
  t.stripe.setSessionLifetime(1_000);
  const config = t.configWith({ STRIPE_API_KEY: '', STRIPE_API_KEY_FILE: file, STRIPE_METER_API: api });
  // Short for the test: how soon a held delivery asks again (15 s in production).
  const pipeline = await t.startPipeline({ ...config, timings: { ...config.timings, credentialsRetryMs: 300 } });
  const delivered = api === 'v1' ? 'sent' : 'accepted';
  const before = await t.backlog('acme', 2);
  for (const key of before) await t.waitStatus(key, delivered);

  // Rolled, the old key expiring at once: every call is refused until the file has the new key.
  t.stripe.rollApiKey('sk_test_after_roll');
  // v2: the session made with the old key lives out its second first (Stripe does not end it).
  if (api === 'v2') await new Promise((resolve) => setTimeout(resolve, 1_500));
  const during = [...(await t.backlog('acme', 3)), ...(await t.backlog('globex', 3))];
  // The first refusals hold their events (the relay holds the rest back while Stripe refuses the key).
  await waitFor('events held by the refused key', async () => {
    const r = await outboxStatus(t.pool, t.schema);
    return (r.inFlightByLastError.find((e) => e.code === CREDENTIALS_REFUSED)?.count ?? 0) > 0;
  });
  for (const key of during) expect(t.eventsFor(key)).toEqual([]);

  // Taken up within KEY_FILE_RECHECK_MS and a held delivery's next try.
  writeFileSync(file, 'sk_test_after_roll\n');
  for (const key of during) await t.waitStatus(key, delivered, 60_000);
  for (const key of [...before, ...during]) expect(t.eventsFor(key)).toHaveLength(1);
  const status = await outboxStatus(t.pool, t.schema);
  expect(status.counts.dead).toBe(0);
  expect(status.alarms).toEqual([]);
  await pipeline.stop();
});

describe('Temporal Cloud API key', () => {
  let cloud: ApiKeyProxy;
  let certDir: string;
  beforeAll(async () => {
    certDir = mkdtempSync(path.join(tmpdir(), 'key-roll-certs-'));
    const certs = certMaker(certDir);
    certs.ca('ca');
    certs.cert('server', 'ca', SERVER_EXT);
    cloud = await startApiKeyProxy({ upstream: inject('temporalAddress'), key: readFileSync(certs.file('server.key')), cert: readFileSync(certs.file('server.pem')), accept: [] });
  });
  afterAll(async () => {
    await cloud?.close();
    rmSync(certDir, { recursive: true, force: true });
  });

  it('rotated in TEMPORAL_API_KEY_FILE reaches the running worker and its client: with the old key deleted, events still go through', async () => {
    const file = path.join(dir, 'temporal-api-key');
    writeFileSync(file, 'cloud-key-1\n');
    cloud.accept(['cloud-key-1']);
    const config = t.configWith({ TEMPORAL_ADDRESS: cloud.address, TEMPORAL_TLS_CA_FILE: path.join(certDir, 'ca.pem'), TEMPORAL_API_KEY_FILE: file });
    const pipeline = await t.startPipeline(config);
    for (const key of await t.backlog('acme', 2)) await t.waitStatus(key, 'sent');

    // A second key, both valid while the secret changes; then the first is deleted.
    cloud.accept(['cloud-key-1', 'cloud-key-2']);
    writeFileSync(file, 'cloud-key-2\n');
    await new Promise((resolve) => setTimeout(resolve, KEY_FILE_RECHECK_MS + 2_000));
    cloud.accept(['cloud-key-2']);
    const deleted = cloud.calls().length;

    // Starts (the relay's client) and the workflow tasks' completions (the worker's own connection;
    // with eager start a task comes back with its start, and polls begun before the deletion, with
    // the key they were accepted with, are still waiting).
    const after = [...(await t.backlog('acme', 3)), ...(await t.backlog('globex', 3))];
    for (const key of after) await t.waitStatus(key, 'sent', 60_000);
    for (const key of after) expect(t.eventsFor(key)).toHaveLength(1);
    const since = cloud.calls().slice(deleted);
    expect(since.filter((c) => c.key !== 'cloud-key-2')).toEqual([]);
    expect(since.some((c) => c.path.endsWith('/StartWorkflowExecution'))).toBe(true);
    expect(since.some((c) => c.path.endsWith('/RespondWorkflowTaskCompleted'))).toBe(true);
    // The API's /health asks what an API key may ask (its namespace), and says Temporal is up.
    const health = temporalHealthConnection(config.temporal);
    try {
      expect(await checkHealth({ db: t.pool, temporal: health, log: { warn: () => undefined } }, 5_000)).toEqual({ status: 'ok', postgres: 'ok', temporal: 'ok' });
    } finally {
      await health.close();
    }
    await pipeline.stop();
  });
});

describe('Temporal mTLS client certificate', () => {
  let certDir: string;
  let proxy: MtlsFrontend;
  let address: string;
  /** The client certificates the server accepts (SHA-256 fingerprints), and each handshake's. */
  let accepted = new Set<string>();
  const handshakes: string[] = [];
  const open = new Map<tls.TLSSocket, string>();
  const fingerprint = (pem: string) => new X509Certificate(readFileSync(pem)).fingerprint256;
  const accept = (fingerprints: string[]) => {
    accepted = new Set(fingerprints);
    // A revoked certificate's connections are cut, as a server's revocation ends its sessions.
    for (const [socket, fp] of open) if (!accepted.has(fp)) socket.destroy();
  };

  beforeAll(async () => {
    certDir = mkdtempSync(path.join(tmpdir(), 'key-roll-mtls-'));
    const certs = certMaker(certDir);
    proxy = await startMtlsFrontend(certs, inject('temporalAddress'), (socket) => {
      const fp = socket.getPeerCertificate().fingerprint256;
      handshakes.push(fp);
      if (!accepted.has(fp)) return false;
      open.set(socket, fp);
      socket.on('close', () => open.delete(socket));
      return true;
    });
    address = proxy.address;
    certs.cert('client-1', 'client-ca', 'extendedKeyUsage=clientAuth\n');
    certs.cert('client-2', 'client-ca', 'extendedKeyUsage=clientAuth\n');
  });
  afterAll(async () => {
    for (const socket of open.keys()) socket.destroy();
    await proxy?.close();
    rmSync(certDir, { recursive: true, force: true });
  });

  it('renewed in its files, then the old one revoked: the running worker connects again with the new one, and events still go through', async () => {
    const file = (name: string) => path.join(certDir, name);
    const certFile = path.join(dir, 'tls.crt');
    const keyFile = path.join(dir, 'tls.key');
    copyFileSync(file('client-1.pem'), certFile);
    copyFileSync(file('client-1.key'), keyFile);
    const [first, second] = [fingerprint(file('client-1.pem')), fingerprint(file('client-2.pem'))];
    accept([first]);
    const lines: string[] = [];
    const worker = await createWorker({
      database: t.db.url,
      temporal: { address, tls: { caFile: file('server-ca.pem'), certFile, keyFile, serverName: 'localhost' } },
      taskQueue: `mtls-${randomUUID()}`,
      stripe: { apiKey: 'sk_test_mtls', apiBase: t.stripe.url },
      tuning: { relayCount: 1, relayPollIntervalMs: 200 },
      workflowBundle: workflowBundle(),
      workerOptions: { shutdownGraceTime: '10 seconds' },
      log: createLogger('info', { write: (line: string) => void lines.push(line) }),
    });
    const running = worker.run();
    try {
      for (const key of await t.backlog('acme', 2)) await t.waitStatus(key, 'sent', 60_000);

      // Renewed: both accepted while the secret's files change (the certificate first, its key a
      // moment later: in between they are no pair, and nothing is done with them).
      accept([first, second]);
      copyFileSync(file('client-2.pem'), certFile);
      await new Promise((resolve) => setTimeout(resolve, 300));
      copyFileSync(file('client-2.key'), keyFile);
      await waitFor('the worker on a connection with the new files', async () => lines.some((l) => l.includes('made with the new TLS files')), KEY_FILE_RECHECK_MS + 30_000);

      // The old certificate revoked: its connections cut, its handshakes refused.
      const revokedAt = handshakes.length;
      accept([second]);
      const after = [...(await t.backlog('acme', 3)), ...(await t.backlog('globex', 3))];
      for (const key of after) await t.waitStatus(key, 'sent', 60_000);
      for (const key of after) expect(t.eventsFor(key)).toHaveLength(1);
      expect(handshakes.slice(revokedAt).filter((fp) => fp !== second)).toEqual([]);
      // Its health probe's connection too: Temporal answers it with the new certificate.
      expect(await worker.health()).toMatchObject({ worker: 'running', temporal: 'ok' });
      expect(lines.filter((l) => l.includes('connecting with them failed'))).toEqual([]);
    } finally {
      await worker.shutdown();
      await running;
    }
  });
});
