/**
 * Temporal over TLS, for real: a TLS-terminating proxy (Node's `tls`) in front of the shared dev
 * server, with certificates made here by openssl: TLS with a custom CA, mTLS with a client
 * certificate the proxy requires, and clear messages for a wrong CA, a missing client certificate
 * and incomplete settings.
 */
import { copyFileSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { afterAll, beforeAll, describe, expect, inject, it } from 'vitest';
import { ConfigError, loadConfig } from '../src/config.js';
import { temporalUnreachable } from '../src/reachable.js';
import { connectClient, connectTemporal, onTlsFilesChanged, TemporalConnectionError, tlsFilesNow } from '../src/temporal/connection.js';
import { startApiKeyProxy, type ApiKeyProxy } from './api-key-proxy.js';
import { certMaker, startMtlsFrontend, type MtlsFrontend } from './certs.js';
import './provided.js';

const dir = mkdtempSync(path.join(os.tmpdir(), 'billing-outbox-tls-'));
const certs = certMaker(dir);
const file = certs.file;

let proxy: MtlsFrontend;
let proxyAddress: string;
const accepted: boolean[] = [];

beforeAll(async () => {
  // Terminates TLS, requires a client certificate signed by client-ca, and passes the bytes on.
  proxy = await startMtlsFrontend(certs, inject('temporalAddress'), (socket) => accepted.push(socket.authorized) > 0);
  certs.ca('wrong-ca');
  certs.cert('worker', 'client-ca', 'extendedKeyUsage=clientAuth\n');
  certs.cert('stranger', 'wrong-ca', 'extendedKeyUsage=clientAuth\n');
  proxyAddress = proxy.address;
});

afterAll(async () => {
  await proxy?.close();
  rmSync(dir, { recursive: true, force: true });
});

const configWith = (env: Record<string, string>) => loadConfig({ NODE_ENV: 'test', LOG_LEVEL: 'silent', TEMPORAL_ADDRESS: proxyAddress, ...env });

describe('Temporal over TLS', () => {
  it('connects the worker and the client with mTLS: a custom CA and a client certificate the server requires', async () => {
    const config = configWith({
      TEMPORAL_TLS_CA_FILE: file('server-ca.pem'),
      TEMPORAL_TLS_CERT_FILE: file('worker.pem'),
      TEMPORAL_TLS_KEY_FILE: file('worker.key'),
    });
    expect(config.temporal.tls).toEqual({ caFile: file('server-ca.pem'), certFile: file('worker.pem'), keyFile: file('worker.key') });
    const { connection, client, clientConnection } = await connectTemporal(config.temporal);
    try {
      const info = await client.workflowService.getSystemInfo({});
      expect(info.serverVersion).toMatch(/^\d+\.\d+/);
      // The worker's native connection, through the same proxy.
      expect((await connection.workflowService.getSystemInfo({})).serverVersion).toBe(info.serverVersion);
      const described = await client.workflowService.describeNamespace({ namespace: config.temporal.namespace });
      expect(described.namespaceInfo?.name).toBe('default');
    } finally {
      await clientConnection.close();
      await connection.close();
    }
    expect(accepted.length).toBeGreaterThanOrEqual(2);
    expect(accepted.every(Boolean)).toBe(true);
  });

  it('says what to check when the server certificate is signed by another CA', async () => {
    const config = configWith({ TEMPORAL_TLS_CA_FILE: file('wrong-ca.pem'), TEMPORAL_TLS_CERT_FILE: file('worker.pem'), TEMPORAL_TLS_KEY_FILE: file('worker.key') });
    const err = await connectClient(config.temporal).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(TemporalConnectionError);
    expect((err as Error).message).toMatch(
      new RegExp(`^cannot connect to Temporal at ${proxyAddress.replace(/\./g, '\\.')} over TLS \\(CA ${file('wrong-ca.pem').replace(/\./g, '\\.')}, client certificate .*worker\\.pem\\): .+; check TEMPORAL_TLS_CA_FILE`),
    );
  });

  it('says what to check when the server requires a client certificate and none is given, or one it does not trust', async () => {
    for (const env of [
      { TEMPORAL_TLS_CA_FILE: file('server-ca.pem') },
      { TEMPORAL_TLS_CA_FILE: file('server-ca.pem'), TEMPORAL_TLS_CERT_FILE: file('stranger.pem'), TEMPORAL_TLS_KEY_FILE: file('stranger.key') },
    ] as Record<string, string>[]) {
      const config = configWith(env);
      const err = await connectTemporal(config.temporal).catch((e: unknown) => e);
      expect(err, JSON.stringify(env)).toBeInstanceOf(TemporalConnectionError);
      expect((err as Error).message).toContain('TEMPORAL_TLS_CERT_FILE and TEMPORAL_TLS_KEY_FILE (if the server requires a client certificate)');
    }
  });

  it('a TLS mistake is not taken for a Temporal that is away: a starting worker fails at once, with the hint', async () => {
    for (const env of [
      { TEMPORAL_TLS_CA_FILE: file('wrong-ca.pem'), TEMPORAL_TLS_CERT_FILE: file('worker.pem'), TEMPORAL_TLS_KEY_FILE: file('worker.key') },
      { TEMPORAL_TLS_CA_FILE: file('server-ca.pem') },
      { TEMPORAL_TLS_CA_FILE: file('server-ca.pem'), TEMPORAL_TLS_CERT_FILE: file('stranger.pem'), TEMPORAL_TLS_KEY_FILE: file('stranger.key') },
      {},
    ] as Record<string, string>[]) {
      const err = await connectTemporal(configWith(env).temporal).catch((e: unknown) => e);
      expect(err, JSON.stringify(env)).toBeInstanceOf(TemporalConnectionError);
      expect(temporalUnreachable(err), `${JSON.stringify(env)}: ${String(err)}`).toBe(false);
    }
  });

  it('without TLS settings, says that the server may speak TLS', async () => {
    const err = await connectClient(configWith({}).temporal).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(TemporalConnectionError);
    expect((err as Error).message).toContain('without TLS');
    expect((err as Error).message).toContain('set TEMPORAL_TLS=true');
  });
});

describe('Temporal connection settings', () => {
  const problems = (env: Record<string, string>) => {
    try {
      configWith(env);
    } catch (err) {
      expect(err).toBeInstanceOf(ConfigError);
      return (err as ConfigError).problems;
    }
    throw new Error('accepted');
  };

  it('refuses incomplete or contradictory TLS settings, one line each', () => {
    expect(problems({ TEMPORAL_TLS_CERT_FILE: file('worker.pem') })).toEqual([
      'TEMPORAL_TLS_CERT_FILE: mTLS needs both TEMPORAL_TLS_CERT_FILE and TEMPORAL_TLS_KEY_FILE (one is missing)',
    ]);
    expect(problems({ TEMPORAL_TLS_CA_FILE: file('nope.pem') })).toEqual([`TEMPORAL_TLS_CA_FILE: no such file: ${file('nope.pem')}`]);
    expect(problems({ TEMPORAL_TLS: 'false', TEMPORAL_TLS_CA_FILE: file('server-ca.pem') })).toEqual(['TEMPORAL_TLS_CA_FILE: is set while TEMPORAL_TLS=false']);
    expect(problems({ TEMPORAL_TLS: 'yes' })).toEqual(['TEMPORAL_TLS: must be true or false']);
    expect(problems({ TEMPORAL_TLS: 'false', TEMPORAL_API_KEY: 'a-temporal-api-key' })).toEqual([
      'TEMPORAL_API_KEY: is set while TEMPORAL_TLS=false (the key would cross the network in clear text on every call)',
    ]);
  });

  it('turns TLS on for an API key (Temporal Cloud), reads secrets from *_FILE, and never both', () => {
    writeFileSync(file('api-key'), 'key-from-a-secret-file\n');
    const cloud = configWith({ TEMPORAL_API_KEY_FILE: file('api-key'), TEMPORAL_NAMESPACE: 'acme.a1b2c' });
    expect(cloud.temporal).toMatchObject({ apiKey: 'key-from-a-secret-file', tls: {}, namespace: 'acme.a1b2c' });
    expect(configWith({ TEMPORAL_TLS: 'true' }).temporal.tls).toEqual({});
    expect(configWith({}).temporal.tls).toBeUndefined();
    expect(problems({ TEMPORAL_API_KEY: 'inline', TEMPORAL_API_KEY_FILE: file('api-key') })).toEqual(['TEMPORAL_API_KEY_FILE: TEMPORAL_API_KEY is set too; set one of them']);
    expect(problems({ STRIPE_API_KEY_FILE: file('missing') })).toEqual([`STRIPE_API_KEY_FILE: cannot read ${file('missing')} (ENOENT)`]);
  });
});

describe('renewed TLS files (onTlsFilesChanged)', () => {
  it('asks for a reconnect once the certificate and its key are a new pair, not while only one of them is new, and again after a failed one', async () => {
    certs.cert('renewed', 'client-ca', 'extendedKeyUsage=clientAuth\n');
    copyFileSync(file('worker.pem'), file('live.pem'));
    copyFileSync(file('worker.key'), file('live.key'));
    const temporal = configWith({ TEMPORAL_TLS_CA_FILE: file('server-ca.pem'), TEMPORAL_TLS_CERT_FILE: file('live.pem'), TEMPORAL_TLS_KEY_FILE: file('live.key') }).temporal;
    let asked = 0;
    let fail = true;
    const stop = onTlsFilesChanged(temporal, async () => {
      asked++;
      if (fail) throw new Error('refused');
    }, 50);
    const settle = () => new Promise((resolve) => setTimeout(resolve, 300));
    try {
      await settle();
      expect(asked).toBe(0);
      // The certificate rewritten, its key not yet: no pair, nothing asked.
      copyFileSync(file('renewed.pem'), file('live.pem'));
      await settle();
      expect(asked).toBe(0);
      // The pair complete: asked, and asked again while the reconnect fails.
      copyFileSync(file('renewed.key'), file('live.key'));
      await settle();
      expect(asked).toBeGreaterThan(1);
      // Once one succeeds, the files are in use: nothing more is asked.
      fail = false;
      await settle();
      const done = asked;
      await settle();
      expect(asked).toBe(done);
    } finally {
      stop();
    }
  });
});

describe('TLS files renewed while the worker started (between its connection and its watch)', () => {
  it('are news to the watch: it is told what the connection was made with, not what the files hold when it begins', async () => {
    certs.cert('renewed-early', 'client-ca', 'extendedKeyUsage=clientAuth\n');
    copyFileSync(file('worker.pem'), file('early.pem'));
    copyFileSync(file('worker.key'), file('early.key'));
    const temporal = configWith({ TEMPORAL_TLS_CA_FILE: file('server-ca.pem'), TEMPORAL_TLS_CERT_FILE: file('early.pem'), TEMPORAL_TLS_KEY_FILE: file('early.key') }).temporal;
    const madeWith = tlsFilesNow(temporal.tls!);
    copyFileSync(file('renewed-early.pem'), file('early.pem'));
    copyFileSync(file('renewed-early.key'), file('early.key'));
    let asked = 0;
    const stop = onTlsFilesChanged(temporal, async () => void asked++, 50, madeWith);
    try {
      await new Promise((resolve) => setTimeout(resolve, 300));
      expect(asked).toBe(1);
    } finally {
      stop();
    }
  });
});

describe('Temporal Cloud API key', () => {
  let cloud: ApiKeyProxy;
  beforeAll(async () => {
    cloud = await startApiKeyProxy({ upstream: inject('temporalAddress'), key: readFileSync(file('server.key')), cert: readFileSync(file('server.pem')), accept: ['cloud-key-1'] });
  });
  afterAll(async () => cloud?.close());
  const cloudConfig = (env: Record<string, string>) => loadConfig({ NODE_ENV: 'test', LOG_LEVEL: 'silent', TEMPORAL_ADDRESS: cloud.address, TEMPORAL_TLS_CA_FILE: file('server-ca.pem'), ...env });

  it('is sent by the worker and the client on every call', async () => {
    const from = cloud.calls().length;
    const { connection, client, clientConnection } = await connectTemporal(cloudConfig({ TEMPORAL_API_KEY: 'cloud-key-1' }).temporal);
    try {
      await client.workflowService.getSystemInfo({});
      await connection.workflowService.getSystemInfo({});
      await client.workflowService.describeNamespace({ namespace: 'default' });
    } finally {
      await clientConnection.close();
      await connection.close();
    }
    const calls = cloud.calls().slice(from);
    expect(calls.length).toBeGreaterThanOrEqual(3);
    expect(calls.filter((c) => c.key !== 'cloud-key-1')).toEqual([]);
  });

  it('a key the server refuses is a mistake, said at once, not a Temporal that is away', async () => {
    const err = await connectTemporal(cloudConfig({ TEMPORAL_API_KEY: 'not-a-cloud-key' }).temporal).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(TemporalConnectionError);
    expect((err as Error).message).toContain('TEMPORAL_API_KEY');
    expect(temporalUnreachable(err), String(err)).toBe(false);
  });
});
