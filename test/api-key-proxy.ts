/**
 * Temporal Cloud's API-key check, in front of the shared dev server (which checks none): an HTTP/2
 * server over TLS that passes each gRPC call on to the dev server only when its `authorization`
 * header is `Bearer <an accepted key>`, and answers any other with UNAUTHENTICATED, as Cloud does;
 * and refuses, as Cloud does, a call an API key may not make: gRPC's health check, tied to no namespace.
 * It records the key of every call, so a test sees which key each connection sends.
 */
import http2 from 'node:http2';
import type { AddressInfo } from 'node:net';

export interface ApiKeyProxy {
  address: string;
  /** The keys accepted from now on. */
  accept(keys: string[]): void;
  /** The key each call carried (undefined: none), oldest first, and each call's method path. */
  calls(): { key: string | undefined; path: string }[];
  close(): Promise<void>;
}

const UNAUTHENTICATED = '16';
const PERMISSION_DENIED = '7';

export async function startApiKeyProxy(opts: { upstream: string; key: Buffer; cert: Buffer; accept: string[] }): Promise<ApiKeyProxy> {
  let accepted = new Set(opts.accept);
  const seen: { key: string | undefined; path: string }[] = [];
  const upstream = http2.connect(`http://${opts.upstream}`);
  upstream.on('error', () => undefined);
  const server = http2.createSecureServer({ key: opts.key, cert: opts.cert, allowHTTP1: false });
  const sessions = new Set<http2.ServerHttp2Session>();
  server.on('session', (session) => {
    sessions.add(session);
    session.on('close', () => sessions.delete(session));
  });
  server.on('stream', (stream, headers) => {
    stream.on('error', () => undefined);
    const auth = headers.authorization;
    const key = typeof auth === 'string' && auth.startsWith('Bearer ') ? auth.slice('Bearer '.length) : undefined;
    const path = String(headers[':path']);
    seen.push({ key, path });
    if (key === undefined || !accepted.has(key)) {
      stream.respond({ ':status': 200, 'content-type': 'application/grpc', 'grpc-status': UNAUTHENTICATED, 'grpc-message': 'invalid API key' }, { endStream: true });
      return;
    }
    // An API key is a namespace's: Cloud refuses gRPC's health service, which names none
    // (temporalio/temporal-worker-controller#225).
    if (path.startsWith('/grpc.health.v1.Health/') && headers['temporal-namespace'] === undefined) {
      stream.respond({ ':status': 200, 'content-type': 'application/grpc', 'grpc-status': PERMISSION_DENIED, 'grpc-message': 'Request unauthorized' }, { endStream: true });
      return;
    }
    const forwarded: http2.OutgoingHttpHeaders = {};
    for (const [name, value] of Object.entries(headers)) {
      if (name === ':authority' || name === ':scheme' || name === 'authorization') continue;
      forwarded[name] = value;
    }
    const call = upstream.request(forwarded);
    call.on('error', () => stream.destroy());
    call.on('response', (responseHeaders) => {
      // A status in the headers is a trailers-only answer (an error): nothing follows it.
      if (responseHeaders['grpc-status'] !== undefined) return void stream.respond(responseHeaders, { endStream: true });
      stream.respond(responseHeaders, { waitForTrailers: true });
      call.pipe(stream);
    });
    // gRPC's status travels in trailers, after the body: sent once the body is through.
    call.on('trailers', (trailers) => stream.once('wantTrailers', () => stream.sendTrailers(trailers)));
    stream.pipe(call);
    stream.on('close', () => call.close());
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  return {
    address: `127.0.0.1:${(server.address() as AddressInfo).port}`,
    accept: (keys) => void (accepted = new Set(keys)),
    calls: () => [...seen],
    close: async () => {
      for (const session of sessions) session.destroy();
      upstream.destroy();
      await new Promise((resolve) => server.close(resolve));
    },
  };
}
