/**
 * Fastify's per-request log lines, with plain fields.
 *
 * Fastify's own lines hand pino the request and reply objects for pino's serializers, but
 * src/log.ts's scrubbing formatter JSON-round-trips every line's fields first: the request becomes
 * `{}` and stringifying a reply throws. So every line here is built from plain values, errors
 * included. Only the route is logged (its pattern, not the path sent), never the query string, and
 * never a header.
 */
import type { FastifyReply, FastifyRequest } from 'fastify';
import { LogController } from 'fastify';
import pino from 'pino';

/**
 * An error as plain JSON (type, message, stack, code) that survives the formatter. Logged as
 * `error`, not `err`: pino's err serializer would see the flattened object and call it "Object".
 */
export const plainError = (err: unknown) => (err instanceof Error ? pino.stdSerializers.err(err) : { message: String(err) });

/**
 * The route's own pattern, never the path the client sent: a client that puts a token (or any
 * secret) in the path of a route that does not exist must not see it land in the log.
 */
const pathOf = (request: FastifyRequest) => request.routeOptions.url ?? '(no route)';

export class RequestLogController extends LogController {
  constructor() {
    super({ requestIdLogLabel: 'requestId' });
  }

  override incomingRequest(request: FastifyRequest): void {
    request.log.debug({ method: request.method, path: pathOf(request) }, 'incoming request');
  }

  override requestCompleted(error: Error | null | undefined, request: FastifyRequest, reply: FastifyReply): void {
    const fields = {
      method: request.method,
      path: pathOf(request),
      statusCode: reply.statusCode,
      responseTimeMs: Math.round(reply.elapsedTime * 10) / 10,
    };
    if (error) reply.log.error({ ...fields, error: plainError(error) }, 'request errored');
    // Health probes arrive every few seconds; only their failures are news.
    else if (request.routeOptions.config.public && reply.statusCode < 400) reply.log.debug(fields, 'request completed');
    else reply.log.info(fields, 'request completed');
  }

  override defaultErrorLog(error: Error, request: FastifyRequest, reply: FastifyReply): void {
    const level = reply.statusCode >= 500 ? 'error' : 'info';
    reply.log[level]({ statusCode: reply.statusCode, error: plainError(error) }, error.message);
  }

  override streamError(error: Error, _request: FastifyRequest, reply: FastifyReply): void {
    reply.log.warn({ error: plainError(error) }, 'response stream failed');
  }

  override writeHeadError(error: Error, _request: FastifyRequest, reply: FastifyReply): void {
    reply.log.warn({ error: plainError(error) }, error.message);
  }
}
