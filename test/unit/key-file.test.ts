import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { afterEach, beforeEach, describe, expect, it } from 'vitest';
import { loadConfig } from '../../src/config.js';
import { keyFromFile, type KeyFileNews } from '../../src/stripe/key-file.js';

describe('keyFromFile: a rolled Stripe key is read again from its file', () => {
  let dir: string;
  let file: string;
  let clock: number;
  let news: KeyFileNews[];
  const reader = (firstKey = 'sk_test_old') => keyFromFile(file, firstKey, { recheckMs: 10_000, now: () => clock, onNews: (n) => news.push(n) });

  beforeEach(() => {
    dir = mkdtempSync(path.join(tmpdir(), 'key-file-'));
    file = path.join(dir, 'stripe');
    writeFileSync(file, 'sk_test_old\n');
    clock = 1_000_000;
    news = [];
  });
  afterEach(() => rmSync(dir, { recursive: true, force: true }));

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
    ['the file is gone', () => rmSync(file), /^cannot be read \(ENOENT\)$/],
    ['the file is empty', () => writeFileSync(file, '\n'), /^is empty$/],
    ['the file holds something else', () => writeFileSync(file, 'STRIPE_API_KEY=sk_test_new\n'), /^does not hold a Stripe secret/],
    ['a live key replaces a test one', () => writeFileSync(file, 'sk_live_new\n'), /^holds a live key where this process started with a test one: restart/],
  ])('keeps the key in use when %s, and says so once', (_, change, reason) => {
    const key = reader();
    change();
    for (let i = 0; i < 3; i++) {
      clock += 10_000;
      expect(key()).toBe('sk_test_old');
    }
    expect(news).toEqual([{ kind: 'unreadable', reason: expect.stringMatching(reason) }]);
    // Fixed: the new key is taken, and a later problem is reported again.
    writeFileSync(file, 'sk_test_new');
    clock += 10_000;
    expect(key()).toBe('sk_test_new');
    change();
    clock += 10_000;
    expect(key()).toBe('sk_test_new');
    expect(news.map((n) => n.kind)).toEqual(['unreadable', 'changed', 'unreadable']);
  });

  it('is what the configuration keeps of STRIPE_API_KEY_FILE (and only of it)', () => {
    const c = loadConfig({ STRIPE_API_KEY_FILE: ` ${file} ` });
    expect(c.stripe.apiKey).toBe('sk_test_old');
    expect(c.stripe.apiKeyFile).toBe(file);
    expect(loadConfig({ STRIPE_API_KEY: 'sk_test_env' }).stripe.apiKeyFile).toBeUndefined();
  });
});
