/**
 * The idempotency key of a usage: the outbox row's unique key, the usage workflow's id and Stripe's
 * meter-event `identifier`, all at once. It is derived from (tenant, usage id), so one tenant's ids
 * never meet another's, and it always fits Stripe's 100-character `identifier`.
 *
 * - `u:<tenant>:<usage id>` when that fits in 100 bytes of UTF-8 (readable in the Web UI and the
 *   CLI). In the tenant, `%` and `:` are percent-encoded, so the first `:` after the prefix always
 *   ends the tenant: two different (tenant, usage id) pairs never give the same key.
 * - `h:<sha-256 of tenant, NUL, usage id, in hex>` otherwise (66 characters). Tenants and ids never
 *   contain NUL (src/outbox/validate.ts), so the hashed text is unambiguous too.
 *
 * Bytes rather than characters are counted: Stripe says "100 characters" without saying how it
 * counts them, and a byte never undercounts.
 */
import { createHash } from 'node:crypto';
import { MAX_IDENTIFIER_LENGTH } from '../stripe/rules.js';

const encodeTenant = (tenantId: string) => tenantId.replace(/%/g, '%25').replace(/:/g, '%3A');

export function idempotencyKeyFor(tenantId: string, usageId: string): string {
  const readable = `u:${encodeTenant(tenantId)}:${usageId}`;
  if (Buffer.byteLength(readable, 'utf8') <= MAX_IDENTIFIER_LENGTH) return readable;
  return `h:${createHash('sha256').update(`${tenantId}\u0000${usageId}`, 'utf8').digest('hex')}`;
}
