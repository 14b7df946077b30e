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

/**
 * STRIPE_IDENTIFIER_NAMESPACE: letters, digits, `-` and `_`, at most 24 characters. Never `:` or
 * `/`, which is what keeps a namespaced identifier apart from every other (see below).
 */
export const IDENTIFIER_NAMESPACE = /^[A-Za-z0-9_-]{1,24}$/;

/**
 * The identifier Stripe gets for an event: the one place it is built (the delivery's first attempt
 * stores it on the row through src/outbox/sql/delivery.ts, a rebill through src/ops/rebill.ts;
 * error reports, reconcile and cancel read it back from the row).
 *
 * - revision 0, no namespace: the idempotency key itself.
 * - revision n > 0 (the event was rebilled n times after Stripe rejected it): `r<n>:<key>`. A
 *   prefix, not a suffix: keys start with `u:` or `h:`, never `r`, so a revised
 *   identifier is never another event's key (a suffix such as `#r1` is: usage id `x#r1`).
 * - a namespace (one per deployment sharing a Stripe account): `<namespace>/<the above>`. A
 *   namespace holds neither `:` nor `/`, and every identifier without one has a `:` before any
 *   `/`, so namespaced identifiers never meet another deployment's, namespaced or not.
 * - over 100 bytes of UTF-8 (as for keys): the part after the namespace becomes `h:<sha-256 of it,
 *   in hex>`, so the namespace stays readable and the whole fits (24 + 1 + 66 characters).
 */
export function stripeIdentifierFor(key: string, revision: number, namespace: string): string {
  if (!Number.isSafeInteger(revision) || revision < 0) throw new RangeError(`identifier revision must be a whole number ≥ 0, not ${revision}`);
  if (namespace !== '' && !IDENTIFIER_NAMESPACE.test(namespace)) throw new RangeError('identifier namespace must be 1 to 24 letters, digits, - or _');
  const body = revision === 0 ? key : `r${revision}:${key}`;
  const prefix = namespace === '' ? '' : `${namespace}/`;
  if (Buffer.byteLength(prefix + body, 'utf8') <= MAX_IDENTIFIER_LENGTH) return prefix + body;
  return `${prefix}h:${createHash('sha256').update(body, 'utf8').digest('hex')}`;
}
