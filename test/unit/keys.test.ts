/** Idempotency keys, pure: readable when they fit, hashed when not, never two pairs on one key. */
import { createHash } from 'node:crypto';
import { describe, expect, it } from 'vitest';
import { idempotencyKeyFor } from '../../src/outbox/keys.js';

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
