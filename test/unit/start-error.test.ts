/**
 * Which refused starts make the row dead at once (the request itself can never pass) and which
 * are tried again (the deployment may get better): the gRPC status Temporal answers with.
 */
import { ServiceError } from '@temporalio/client';
import { describe, expect, it } from 'vitest';
import { classifyStartError, StartRefusedError } from '../../src/temporal/start-usage.js';

// gRPC status codes (grpc/status.proto).
const status = { NOT_FOUND: 5, INVALID_ARGUMENT: 3, PERMISSION_DENIED: 7, RESOURCE_EXHAUSTED: 8, FAILED_PRECONDITION: 9, OUT_OF_RANGE: 11, UNAVAILABLE: 14 } as const;

/** A failed start as the SDK throws it: a ServiceError around the gRPC error. */
function failedStart(code: number, details: string): Error {
  return new ServiceError('Failed to start Workflow', { cause: Object.assign(new Error(`${code} ${details}`), { code, details }) });
}

describe('classifyStartError', () => {
  it('refuses for good what the request itself is: an id over the limit, a value out of range', () => {
    const refused = classifyStartError(failedStart(status.INVALID_ARGUMENT, 'WorkflowId length exceeds limit.'));
    expect(refused).toBeInstanceOf(StartRefusedError);
    expect(refused).toMatchObject({ grpcStatus: 'INVALID_ARGUMENT', answer: expect.stringContaining('WorkflowId length exceeds limit.') });
    expect(classifyStartError(failedStart(status.OUT_OF_RANGE, 'too large'))).toBeInstanceOf(StartRefusedError);
  });

  it('tries again what the deployment is: a namespace not active here (a failover), unavailable, denied, exhausted', () => {
    for (const [code, details] of [
      [status.FAILED_PRECONDITION, 'Namespace: billing is active in cluster: east, while current cluster west is a standby cluster.'],
      [status.UNAVAILABLE, 'connection refused'],
      [status.PERMISSION_DENIED, 'Request unauthorized.'],
      [status.RESOURCE_EXHAUSTED, 'namespace rate limit exceeded'],
      [status.NOT_FOUND, 'Namespace billing is not found.'],
    ] as const) {
      expect(classifyStartError(failedStart(code, details)), details).not.toBeInstanceOf(StartRefusedError);
    }
  });
});
