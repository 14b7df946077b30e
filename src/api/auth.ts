/**
 * Bearer-token authentication and per-route scopes.
 *
 * Tokens are compared as SHA-256 digests with timingSafeEqual, against every configured token on
 * every request, so neither the position of the first differing byte nor which token matched shows
 * in the response time. Only the token's name is ever logged.
 */
import { createHash, timingSafeEqual } from 'node:crypto';
import type { FastifyRequest } from 'fastify';
import type { ApiScope, ApiToken } from '../config.js';
import { ALL_TENANTS } from '../outbox/validate.js';
import { ApiError } from './errors.js';

const digest = (value: string) => createHash('sha256').update(value, 'utf8').digest();

export class TokenVerifier {
  private readonly entries: { digest: Buffer; token: ApiToken }[];

  constructor(tokens: readonly ApiToken[]) {
    this.entries = tokens.map((token) => ({ digest: digest(token.token), token }));
  }

  /** The configured token equal to `presented`, if any. */
  verify(presented: string): ApiToken | undefined {
    const candidate = digest(presented);
    let found: ApiToken | undefined;
    for (const entry of this.entries) {
      if (timingSafeEqual(entry.digest, candidate) && !found) found = entry.token;
    }
    return found;
  }
}

const BEARER = /^Bearer[ \t]+(\S+)[ \t]*$/i;
const REALM = 'Bearer realm="billing-outbox"';

/** Resolves the caller's token from the Authorization header, or throws a 401. */
export function authenticate(verifier: TokenVerifier, request: FastifyRequest): ApiToken {
  const header = request.headers.authorization;
  if (!header) throw new ApiError(401, 'unauthorized', 'send Authorization: Bearer <token>', undefined, { 'www-authenticate': REALM });
  const match = BEARER.exec(header);
  const token = match ? verifier.verify(match[1]!) : undefined;
  if (!token) {
    throw new ApiError(401, 'unauthorized', 'the bearer token is not valid', undefined, {
      'www-authenticate': `${REALM}, error="invalid_token"`,
    });
  }
  return token;
}

export function requireScope(token: ApiToken, scope: ApiScope): void {
  if (!token.scopes.includes(scope)) {
    throw new ApiError(403, 'insufficient_scope', `token "${token.name}" lacks the ${scope} scope`, undefined, {
      'www-authenticate': `${REALM}, error="insufficient_scope", scope="${scope}"`,
    });
  }
}

export function requireTenant(token: ApiToken, tenantId: string): void {
  if (!token.tenants.includes(ALL_TENANTS) && !token.tenants.includes(tenantId)) {
    throw new ApiError(403, 'tenant_forbidden', `token "${token.name}" may not record usage for this tenant`);
  }
}
