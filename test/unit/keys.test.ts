/** Idempotency keys, pure: readable when they fit, hashed when not, never two pairs on one key. */
import { execFileSync } from 'node:child_process';
import { createHash } from 'node:crypto';
import { describe, expect, it } from 'vitest';
import { idempotencyKeyFor, stripeIdentifierFor } from '../../src/outbox/keys.js';
import { shellWord } from '../../workflows/shared.js';

describe('idempotencyKeyFor', () => {
  it('is readable when it fits: u:<tenant>:<usage id>', () => {
    expect(idempotencyKeyFor('acme', 'first-1')).toBe('u:acme:first-1');
  });

  it('percent-encodes % and : in the tenant, so the first : after the prefix ends the tenant', () => {
    expect(idempotencyKeyFor('a:b', 'c')).toBe('u:a%3Ab:c');
    expect(idempotencyKeyFor('a%3Ab', 'c')).toBe('u:a%253Ab:c');
    expect(idempotencyKeyFor('a', 'b:c')).toBe('u:a:b:c');
    // The pairs that would collide without the encoding.
    expect(idempotencyKeyFor('a:b', 'c')).not.toBe(idempotencyKeyFor('a', 'b:c'));
    expect(idempotencyKeyFor('a%3Ab', 'c')).not.toBe(idempotencyKeyFor('a:b', 'c'));
  });

  it('counts UTF-8 bytes: exactly 100 stays readable, 101 is hashed', () => {
    const fits = 'x'.repeat(100 - 'u:t:'.length);
    expect(idempotencyKeyFor('t', fits)).toBe(`u:t:${fits}`);
    expect(idempotencyKeyFor('t', `${fits}y`)).toBe(`h:${createHash('sha256').update(`t\u0000${fits}y`).digest('hex')}`);
    // 48 two-byte characters: 96 bytes plus 'u:t:' is 100.
    expect(idempotencyKeyFor('t', 'é'.repeat(48))).toBe(`u:t:${'é'.repeat(48)}`);
    expect(idempotencyKeyFor('t', 'é'.repeat(49))).toMatch(/^h:[0-9a-f]{64}$/);
  });

  it('hashes tenant and usage id apart, so long pairs that concatenate alike differ', () => {
    const long = 'z'.repeat(120);
    expect(idempotencyKeyFor(`a${long}`, 'b')).not.toBe(idempotencyKeyFor('a', `${long}b`));
    expect(idempotencyKeyFor('t', long)).toHaveLength(66);
    expect(idempotencyKeyFor('t', long)).toBe(idempotencyKeyFor('t', long));
  });
});

describe('stripeIdentifierFor', () => {
  const key = 'u:acme:req-1';
  it('is the key itself at revision 0 without a namespace (every identifier sent so far)', () => {
    expect(stripeIdentifierFor(key, 0, '')).toBe(key);
  });

  it('prefixes the revision and the namespace: r<n>:<key>, <ns>/<key>, <ns>/r<n>:<key>', () => {
    expect(stripeIdentifierFor(key, 1, '')).toBe(`r1:${key}`);
    expect(stripeIdentifierFor(key, 12, '')).toBe(`r12:${key}`);
    expect(stripeIdentifierFor(key, 0, 'east')).toBe(`east/${key}`);
    expect(stripeIdentifierFor(key, 2, 'east')).toBe(`east/r2:${key}`);
  });

  it('never gives another event\'s key or another deployment\'s identifier', () => {
    // A suffix would: usage id `req-1#r1` is a key of its own.
    expect(stripeIdentifierFor(key, 1, '')).not.toBe(idempotencyKeyFor('acme', 'req-1#r1'));
    // Tenant `u`, usage id `u:acme:req-1` has the key `u:u:acme:req-1`; namespace `u` gives `u/…`.
    expect(stripeIdentifierFor(key, 0, 'u')).not.toBe(idempotencyKeyFor('u', key));
    expect(stripeIdentifierFor(key, 0, 'r1')).not.toBe(stripeIdentifierFor(key, 1, ''));
    const all = new Set<string>();
    for (const ns of ['', 'a', 'b', 'u', 'r1', 'h']) for (const rev of [0, 1, 2]) all.add(stripeIdentifierFor(key, rev, ns));
    expect(all.size).toBe(18);
  });

  it('hashes what follows the namespace when the whole would pass 100 bytes, keeping the namespace', () => {
    const long = idempotencyKeyFor('t', 'x'.repeat(96)); // exactly 100 bytes
    expect(long).toHaveLength(100);
    expect(stripeIdentifierFor(long, 0, '')).toBe(long);
    expect(stripeIdentifierFor(long, 1, '')).toBe(`h:${createHash('sha256').update(`r1:${long}`).digest('hex')}`);
    expect(stripeIdentifierFor(long, 0, 'east')).toBe(`east/h:${createHash('sha256').update(long).digest('hex')}`);
    expect(stripeIdentifierFor(long, 3, 'x'.repeat(24)).length).toBeLessThanOrEqual(100);
  });

  it('refuses a bad revision or namespace', () => {
    expect(() => stripeIdentifierFor(key, -1, '')).toThrow(RangeError);
    expect(() => stripeIdentifierFor(key, 1.5, '')).toThrow(RangeError);
    expect(() => stripeIdentifierFor(key, 0, 'a/b')).toThrow(RangeError);
    expect(() => stripeIdentifierFor(key, 0, 'x'.repeat(25))).toThrow(RangeError);
  });
});

describe('shellWord: the keys in the commands we print for an operator to paste', () => {
  it('leaves a plain key as it is and quotes anything a shell would read', () => {
    expect(shellWord('u:acme:7fa3b500-ab50-4778')).toBe('u:acme:7fa3b500-ab50-4778');
    expect(shellWord("u:acme:o'brien")).toBe(`'u:acme:o'\\''brien'`);
    expect(shellWord('u:acme:x;rm -rf ~')).toBe(`'u:acme:x;rm -rf ~'`);
    expect(shellWord('u:acme:$(curl evil)')).toBe(`'u:acme:$(curl evil)'`);
    expect(shellWord('u:acme:`id`')).toBe("'u:acme:`id`'");
    // What a shell makes of it is the key again.
    for (const key of ["u:acme:o'brien", 'u:acme:$(id);`id`|&>', "u:t:'''"]) {
      expect(execFileSync('bash', ['-c', `printf %s ${shellWord(key)}`], { encoding: 'utf8' }), key).toBe(key);
    }
  });
});
