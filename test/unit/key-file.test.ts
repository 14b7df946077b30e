import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { afterEach, beforeEach, describe, expect, it } from 'vitest';
import { loadConfig } from '../../src/config.js';
import { keyFromFile, type KeyFileNews } from '../../src/key-file.js';
import { stripeKeyFromFile } from '../../src/stripe/client.js';
import { temporalApiKey } from '../../src/temporal/connection.js';

let dir: string;
let file: string;
let clock: number;
beforeEach(() => {
  dir = mkdtempSync(path.join(tmpdir(), 'key-file-'));
  file = path.join(dir, 'secret');
  writeFileSync(file, 'sk_test_old\n');
  clock = 1_000_000;
});
afterEach(() => rmSync(dir, { recursive: true, force: true }));

describe('keyFromFile: a rolled key is read again from its file', () => {
  let news: KeyFileNews[];
  beforeEach(() => void (news = []));
  const reader = (refuse?: (key: string) => string | undefined) =>
    keyFromFile(file, 'sk_test_old', { recheckMs: 10_000, now: () => clock, onNews: (n) => news.push(n), ...(refuse ? { refuse } : {}) });

  it('uses the new key once the recheck interval has passed, not before', () => {
    const key = reader();
    writeFileSync(file, 'sk_test_new\n');
    clock += 9_999;
    expect(key()).toBe('sk_test_old');
    clock += 1;
    expect(key()).toBe('sk_test_new');
    expect(news).toEqual([{ kind: 'changed' }]);
    // Unchanged after that: nothing more to say.
    clock += 10_000;
    expect(key()).toBe('sk_test_new');
    expect(news).toHaveLength(1);
  });

  it.each([
    ['the file is gone', () => rmSync(file), 'cannot be read (ENOENT)'],
    ['the file is empty', () => writeFileSync(file, '\n'), 'is empty'],
    ['its user refuses the key', () => writeFileSync(file, 'refuse-me\n'), 'not this one'],
  ])('keeps the key in use when %s, and says so once', (_, change, reason) => {
    const key = reader((k) => (k === 'refuse-me' ? 'not this one' : undefined));
    change();
    for (let i = 0; i < 3; i++) {
      clock += 10_000;
      expect(key()).toBe('sk_test_old');
    }
    expect(news).toEqual([{ kind: 'unreadable', reason }]);
    // Fixed: the new key is taken, and a later problem is reported again.
    writeFileSync(file, 'sk_test_new');
    clock += 10_000;
    expect(key()).toBe('sk_test_new');
    change();
    clock += 10_000;
    expect(key()).toBe('sk_test_new');
    expect(news.map((n) => n.kind)).toEqual(['unreadable', 'changed', 'unreadable']);
  });
});

describe('stripeKeyFromFile: STRIPE_API_KEY_FILE read again', () => {
  const said: { level: string; msg: string }[] = [];
  const log = { info: (_: object, msg: string) => void said.push({ level: 'info', msg }), warn: (_: object, msg: string) => void said.push({ level: 'warn', msg }) };
  beforeEach(() => void (said.length = 0));

  it.each([
    ['something else than a key', 'STRIPE_API_KEY=sk_test_new', /STRIPE_API_KEY_FILE does not hold a Stripe secret or restricted key/],
    ['a live key where a test one was', 'sk_live_new', /STRIPE_API_KEY_FILE holds a live key where this process started with a test one: restart to change modes/],
  ])('keeps the key in use when the file holds %s', (_, content, message) => {
    const key = stripeKeyFromFile(file, 'sk_test_old', log, { recheckMs: 10_000, now: () => clock });
    writeFileSync(file, content);
    clock += 10_000;
    expect(key()).toBe('sk_test_old');
    expect(said).toEqual([{ level: 'warn', msg: expect.stringMatching(message) }]);
    writeFileSync(file, 'sk_test_new');
    clock += 10_000;
    expect(key()).toBe('sk_test_new');
    expect(said[1]).toEqual({ level: 'info', msg: 'Stripe API key: a new key read from STRIPE_API_KEY_FILE is in use' });
    // The key is never said.
    expect(JSON.stringify(said)).not.toMatch(/sk_(test|live)_new/);
  });

  it('is what the configuration keeps of STRIPE_API_KEY_FILE (and only of it)', () => {
    const c = loadConfig({ STRIPE_API_KEY_FILE: ` ${file} ` });
    expect(c.stripe.apiKey).toBe('sk_test_old');
    expect(c.stripe.apiKeyFile).toBe(file);
    expect(loadConfig({ STRIPE_API_KEY: 'sk_test_env' }).stripe.apiKeyFile).toBeUndefined();
  });
});

describe('temporalApiKey: each connection reads TEMPORAL_API_KEY_FILE first', () => {
  it('a connection made after the key was rolled (a reconnection) offers the new key at once, not the one read at start', () => {
    writeFileSync(file, 'temporal-key-at-start\n');
    const config = loadConfig({ TEMPORAL_API_KEY_FILE: file, TEMPORAL_ADDRESS: 'acme.a1b2c.tmprl.cloud:7233' });
    expect(config.temporal.apiKey).toBe('temporal-key-at-start');
    // Rolled, the old key revoked; then the worker reconnects (renewed TLS files, or Temporal away).
    writeFileSync(file, 'temporal-key-rolled\n');
    expect(temporalApiKey(config.temporal)!()).toBe('temporal-key-rolled');
    // A key given directly is the key.
    expect(temporalApiKey(loadConfig({ TEMPORAL_API_KEY: 'given', TEMPORAL_ADDRESS: 'a:7233' }).temporal)!()).toBe('given');
  });
});
