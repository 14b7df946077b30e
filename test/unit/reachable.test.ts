/**
 * What a starting process takes for a service that is away (waited for) and what for a mistake
 * (fails at once), on the errors the SDKs and pg really raise, wrapped as they wrap them.
 */
import { ServiceError } from '@temporalio/client';
import { describe, expect, it } from 'vitest';
import { postgresUnreachable, temporalUnreachable } from '../../src/reachable.js';

/** As connectTemporal reports a failed connection: ours around the SDK's. */
function ours(cause: Error): Error {
  return new Error(`cannot connect to Temporal at 127.0.0.1:7233 without TLS: ${cause.message}; if the server speaks TLS, set TEMPORAL_TLS=true`, { cause });
}

describe('temporalUnreachable', () => {
  it.each([
    ['the worker connection refused (Rust core)', new Error('tonic::transport::Error(Transport, ConnectError("tcp connect error", 127.0.0.1:7233, Os { code: 111, kind: ConnectionRefused }))')],
    ['the client connection cut, wrapped by the SDK and by us', ours(new ServiceError('Failed to connect to Temporal server', { cause: Object.assign(new Error('14 UNAVAILABLE: Connection dropped'), { code: 14 }) }))],
    ["the client's connection deadline", ours(new Error('Failed to connect before the deadline'))],
    ['a server just started whose frontend is not healthy yet (Rust core)', ours(new Error('Failed to call GetSystemInfo: code: \'The service is currently unavailable\', message: "Frontend is not healthy yet", details: [], metadata: MetadataMap { headers: {} }'))],
    ["Worker.create's namespace check after the SDK's retries", new Error('Namespace default was not found or otherwise could not be described: Status { code: Unavailable, message: "tcp connect error" }')],
  ])('away, waited for: %s', (_, err) => {
    expect(temporalUnreachable(err)).toBe(true);
  });

  it.each([
    ['a certificate the client does not trust', ours(new Error('tonic::transport::Error(Transport, hyper_util::client::legacy::Error(Connect, Custom { kind: InvalidData, error: InvalidCertificate(UnknownIssuer) }))'))],
    ['a refused API key', ours(new ServiceError('Failed to connect to Temporal server', { cause: Object.assign(new Error('7 PERMISSION_DENIED: Request unauthorized.'), { code: 7 }) }))],
    ['a namespace that does not exist', new Error('Namespace nope was not found or otherwise could not be described: Status { code: NotFound, message: "Namespace nope is not found." }')],
  ])('a mistake, not waited for: %s', (_, err) => {
    expect(temporalUnreachable(err)).toBe(false);
  });

  it('the wrapped cause decides: the outer messages alone say nothing of a cut connection', () => {
    const cut = ours(new ServiceError('Failed to connect to Temporal server', { cause: new Error('14 UNAVAILABLE: Connection dropped') }));
    expect(cut.message).not.toMatch(/UNAVAILABLE/);
    expect(temporalUnreachable(cut)).toBe(true);
  });
});

describe('postgresUnreachable', () => {
  it.each([
    ['connection refused', Object.assign(new Error('connect ECONNREFUSED 127.0.0.1:5432'), { code: 'ECONNREFUSED' }), true],
    ['starting up', Object.assign(new Error('the database system is starting up'), { code: '57P03' }), true],
    ['closed by the server', new Error('Connection terminated unexpectedly'), true],
    ['a database that does not exist', Object.assign(new Error('database "x" does not exist'), { code: '3D000' }), false],
    ['a refused password', Object.assign(new Error('password authentication failed for user "u"'), { code: '28P01' }), false],
  ])('%s', (_, err, away) => {
    expect(postgresUnreachable(err)).toBe(away);
  });
});
