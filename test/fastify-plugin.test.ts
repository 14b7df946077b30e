/**
 * billing-outbox/fastify on an application's own Fastify server, as an application registers it:
 * under a prefix, next to the application's own routes, parser and error handler, on the
 * application's own pool. The ingestion route answers as the standalone API does; nothing of the
 * application's changes.
 */
import { randomBytes, randomUUID } from 'node:crypto';
import Fastify, { type FastifyInstance } from 'fastify';
import pg from 'pg';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { ApiToken } from '../src/config.js';
import billingOutbox from '../src/fastify.js';
import { LocalStripe } from '../src/embedded/stripe/server.js';
import { cleanUpAway, failingOver } from './away.js';
import { idempotencyKeyFor, useDatabase } from './hooks.js';

const t = useDatabase({ customers: { acme: 'cus_acme' } });
const writer: ApiToken = { name: 'app-writer', token: `tok_${randomBytes(24).toString('hex')}`, tenants: ['*'], scopes: ['usage:write'] };
let pool: pg.Pool;
let app: FastifyInstance;

/** The application: its own routes (one coercing a number, one throwing), its own error handler and request decorator. */
async function applicationServer(): Promise<FastifyInstance> {
  const server = Fastify();
  server.setErrorHandler((err: Error, _request, reply) => reply.code(418).send({ app: 'handled', message: err.message }));
  server.get('/orders/:id', { schema: { params: { type: 'object', properties: { id: { type: 'integer' } } } } }, async (request) => ({ id: (request.params as { id: number }).id }));
  server.post('/notes', async (request) => ({ got: request.body }));
  // A lenient parser of the application's own, for a vendor JSON type: duplicate keys, 1e3.
  server.addContentTypeParser('application/vnd.api+json', { parseAs: 'string' }, (_request, body, done) => done(null, JSON.parse(body as string)));
  // Its own `apiToken` on every request (a common name), shaped like ours: the plugin never takes
  // it for a token of its own (a request without one of ours is refused below).
  server.decorateRequest('apiToken', null);
  server.addHook('onRequest', async (request) => {
    (request as unknown as { apiToken: ApiToken }).apiToken = { name: 'app-session', token: 'app', tenants: ['*'], scopes: ['usage:write'] };
  });
  server.get('/boom', async () => {
    throw new Error('the application failed');
  });
  await server.register(billingOutbox, { prefix: '/billing', pool, tokens: [writer] });
  await server.ready();
  return server;
}

beforeAll(async () => {
  pool = new pg.Pool({ connectionString: t.db.url, max: 4 });
  app = await applicationServer();
});

afterAll(async () => {
  await app?.close();
  await pool?.end();
});

const usage = (extra: Record<string, unknown> = {}) => ({ tenant_id: 'acme', usage_id: randomUUID(), quantity: 3, ...extra });
const post = (body: unknown, headers: Record<string, string> = { authorization: `Bearer ${writer.token}` }) =>
  app.inject({ method: 'POST', url: '/billing/v1/usage', headers, payload: body as object });

describe('the Fastify plugin', () => {
  it('records usage under its prefix with a token (201, then 200 for the same usage_id), on the application pool', async () => {
    const body = usage();
    const first = await post(body);
    expect(first.statusCode).toBe(201);
    expect(first.json()).toMatchObject({ idempotency_key: idempotencyKeyFor('acme', body.usage_id), status: 'pending', quantity: 3, created: true });
    expect(first.headers['x-request-id']).toBeDefined();
    const again = await post(body);
    expect(again.statusCode).toBe(200);
    expect(again.json()).toMatchObject({ created: false });
    expect((await t.row(idempotencyKeyFor('acme', body.usage_id)))?.quantity).toBe(3);
    // The application's pool still reads bigint its own way.
    expect((await pool.query<{ big: unknown }>('SELECT 9007199254740993::bigint AS big')).rows[0]!.big).toBe('9007199254740993');
  });

  it('refuses without a token, with a wrong one, and a body the standalone API refuses, with the same answers', async () => {
    const none = await post(usage(), {});
    expect(none.statusCode).toBe(401);
    expect(none.json()).toMatchObject({ error: { code: 'unauthorized' } });
    expect(none.headers['www-authenticate']).toContain('Bearer');
    expect((await post(usage(), { authorization: 'Bearer not-a-token-of-ours-at-all-xx' })).statusCode).toBe(401);

    const coerced = await post(usage({ quantity: '5' }));
    expect(coerced.statusCode).toBe(400);
    expect(coerced.json()).toMatchObject({ error: { code: 'invalid_request', fields: [{ field: 'quantity' }] } });
    const unknownField = await post(usage({ ocurred_at: '2026-01-01T00:00:00Z' }));
    expect(unknownField.statusCode).toBe(400);
    const text = await app.inject({ method: 'POST', url: '/billing/v1/usage', headers: { authorization: `Bearer ${writer.token}`, 'content-type': 'text/plain' }, payload: 'hello' });
    expect(text.statusCode).toBe(415);
    expect(text.json()).toMatchObject({ error: { code: 'unsupported_media_type' } });
    // The application's own parsers do not reach the route: this body would be recorded as usage "b", quantity 1000.
    const lenient = await app.inject({
      method: 'POST',
      url: '/billing/v1/usage',
      headers: { authorization: `Bearer ${writer.token}`, 'content-type': 'application/vnd.api+json' },
      payload: '{"tenant_id":"acme","usage_id":"a","usage_id":"b","quantity":1e3}',
    });
    expect(lenient.statusCode).toBe(415);
    expect(await t.row(idempotencyKeyFor('acme', 'b'))).toBeUndefined();
  });

  it("leaves the application's routes, parsers, validator and error handler as they were", async () => {
    // The application's Ajv still coerces ("7" → 7), its routes need no token.
    const order = await app.inject({ method: 'GET', url: '/orders/7' });
    expect(order.statusCode).toBe(200);
    expect(order.json()).toEqual({ id: 7 });
    // Its text/plain parser is still there (the plugin removed it from its own route only).
    const note = await app.inject({ method: 'POST', url: '/notes', headers: { 'content-type': 'text/plain' }, payload: 'plain' });
    expect(note.json()).toEqual({ got: 'plain' });
    const vendor = await app.inject({ method: 'POST', url: '/notes', headers: { 'content-type': 'application/vnd.api+json' }, payload: '{"a":1,"a":2}' });
    expect(vendor.json()).toEqual({ got: { a: 2 } });
    // Its error handler still answers for its routes.
    const boom = await app.inject({ method: 'GET', url: '/boom' });
    expect(boom.statusCode).toBe(418);
    expect(boom.json()).toEqual({ app: 'handled', message: 'the application failed' });
    // Nothing outside the prefix is the plugin's.
    expect((await app.inject({ method: 'POST', url: '/v1/usage', payload: usage() })).statusCode).toBe(404);
  });

  it("keeps the status the application's own hooks give a request on its route (a load shedder's 503 with Retry-After), not a 500", async () => {
    const server = Fastify();
    server.addHook('onRequest', async (request, reply) => {
      if (!request.url.startsWith('/billing/')) return;
      reply.header('retry-after', '10');
      throw Object.assign(new Error('Service Unavailable'), { statusCode: 503, code: 'FST_UNDER_PRESSURE' });
    });
    await server.register(billingOutbox, { prefix: '/billing', pool, tokens: [writer] });
    try {
      const res = await server.inject({ method: 'POST', url: '/billing/v1/usage', headers: { authorization: `Bearer ${writer.token}` }, payload: usage() });
      expect(res.statusCode).toBe(503);
      expect(res.headers['retry-after']).toBe('10');
      expect(res.json()).toMatchObject({ error: { code: 'unavailable' } });
    } finally {
      await server.close();
    }
  });

  it('refuses bad options at registration, naming each', async () => {
    const server = Fastify();
    const message = await Promise.resolve(server.register(billingOutbox, { pool, tokens: [{ ...writer, token: 'short' }], bodyLimitBytes: 1 })).then(
      () => 'registered',
      (err: Error) => err.message,
    );
    expect(message).toContain('tokens: each token must be at least 24 characters');
    expect(message).toContain('bodyLimitBytes: must be at least 256');
    await server.close();
  });

  it('refuses the stripe option without a key for Stripe itself (every meter read would be refused, and every meter let in)', async () => {
    const server = Fastify();
    // As `stripe: { apiKey: process.env.STRIPE_SECRET }` with the variable unset.
    const message = await Promise.resolve(server.register(billingOutbox, { pool, tokens: [writer], stripe: { apiKey: undefined as unknown as string } })).then(
      () => 'registered',
      (err: Error) => err.message,
    );
    expect(message).toMatch(/stripe\.apiKey: is not set, and the meter check at the door \(`stripe`\) calls Stripe with it \(or set stripe\.apiBase/);
    await server.close();
  });
});

it("on a silent connection of the application's pool (a failover), the route answers 503 within seconds instead of hanging, then takes the usage over a new one", async () => {
  const proxy = await failingOver(t.db.url);
  const appPool = new pg.Pool({ connectionString: proxy.url, max: 4, connectionTimeoutMillis: 3_000 });
  const server = Fastify();
  await server.register(billingOutbox, { prefix: '/billing', pool: appPool, tokens: [writer] });
  await server.ready();
  const postTo = (body: unknown) => server.inject({ method: 'POST', url: '/billing/v1/usage', headers: { authorization: `Bearer ${writer.token}` }, payload: body as object });
  try {
    // Three connections open, idle, then silent: the next requests get them first.
    await Promise.all([1, 2, 3].map(() => postTo(usage())));
    // The new server slow to answer as well: a connection opened in its first 7 s never is, and
    // gives up after the pool's connectionTimeoutMillis (without one it would wait for good).
    proxy.failOver({ newSilentForMs: 7_000 });
    expect(proxy.silenced()).toBeGreaterThan(0);
    const body = usage();
    // As a client does: 503 means try again with the same usage_id.
    const statuses: number[] = [];
    for (;;) {
      const res = await postTo(body);
      statuses.push(res.statusCode);
      if (res.statusCode !== 503) break;
    }
    expect(statuses[0]).toBe(503);
    expect(statuses.at(-1)).toBe(201);
    expect((await t.row(idempotencyKeyFor('acme', body.usage_id)))?.quantity).toBe(3);
  } finally {
    await server.close();
    await appPool.end();
    await cleanUpAway();
  }
}, 120_000);

it("with the stripe option, refuses usage for a meter Stripe does not have at the door (422 unknown_meter), writing nothing", async () => {
  const stripe = await LocalStripe.start({ meters: ['api_requests'], customers: ['cus_acme'] });
  const server = Fastify();
  try {
    await server.register(billingOutbox, { prefix: '/billing', pool, tokens: [writer], stripe: { apiKey: 'sk_test_plugin_meters', apiBase: stripe.url } });
    await server.ready();
    const send = (body: unknown) => server.inject({ method: 'POST', url: '/billing/v1/usage', headers: { authorization: `Bearer ${writer.token}` }, payload: body as object });
    const misspelt = usage({ event_name: 'api_request' });
    const refused = await send(misspelt);
    expect(refused.statusCode).toBe(422);
    expect(refused.json()).toMatchObject({ error: { code: 'unknown_meter' } });
    expect(await t.row(idempotencyKeyFor('acme', misspelt.usage_id))).toBeUndefined();
    expect((await send(usage({ event_name: 'api_requests' }))).statusCode).toBe(201);
  } finally {
    await server.close();
    await stripe.close();
  }
});

it("warns, once at registration, when the application's pool opens connections without a time limit, and when nobody hears its errors", async () => {
  const warnings = async (options: pg.PoolConfig, about = 'connectionTimeoutMillis', heard = true) => {
    const lines: string[] = [];
    const appPool = new pg.Pool({ connectionString: t.db.url, ...options });
    if (heard) appPool.on('error', () => undefined);
    const server = Fastify({ logger: { level: 'warn', stream: { write: (line: string) => void lines.push(line) } } });
    await server.register(billingOutbox, { prefix: '/billing', pool: appPool, tokens: [writer] });
    await server.ready();
    await server.close();
    await appPool.end();
    return lines.filter((l) => l.includes(about));
  };
  expect(await warnings({})).toHaveLength(1);
  expect(await warnings({ connectionTimeoutMillis: 10_000 })).toEqual([]);
  // An idle connection's error, re-emitted by a pool nobody listens to, would end the process.
  expect(await warnings({ connectionTimeoutMillis: 10_000 }, "no 'error' listener", false)).toHaveLength(1);
  expect(await warnings({ connectionTimeoutMillis: 10_000 }, "no 'error' listener")).toEqual([]);
});
