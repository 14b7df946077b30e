/**
 * The HTTP ingestion API on a real database (and the shared Temporal dev server for /health),
 * through `app.inject()`: status codes, error bodies, auth, and what reaches the logs.
 */
import { randomBytes, randomUUID } from 'node:crypto';
import net, { type AddressInfo } from 'node:net';
import type { LightMyRequestResponse } from 'fastify';
import { afterAll, beforeAll, describe, expect, it, vi } from 'vitest';
import { buildApi, temporalHealthConnection, type Api } from '../src/api/index.js';
import { HEALTH_FRESH_MS } from '../src/api/health.js';
import type { ApiToken, Config } from '../src/config.js';
import { BEGIN_SHORT, createPool } from '../src/db.js';
import { createLogger } from '../src/log.js';
import type Stripe from 'stripe';
import { createStripeClient } from '../src/stripe/client.js';
import { LocalStripe } from '../src/embedded/stripe/server.js';
import { MeterCatalog } from '../src/stripe/meters.js';
import { idempotencyKeyFor, testConfig, transactionsBegun, useDatabase, waitFor } from './hooks.js';

const secret = (label: string) => `${label}_${randomBytes(24).toString('hex')}`;
const writer: ApiToken = { name: 'writer', token: secret('tok_writer'), tenants: ['*'], scopes: ['usage:write'] };
const acmeOnly: ApiToken = { name: 'acme-only', token: secret('tok_acme'), tenants: ['acme'], scopes: ['usage:write'] };
const reader: ApiToken = { name: 'metrics-reader', token: secret('tok_metrics'), tenants: ['*'], scopes: ['metrics:read'] };
const TOKENS = [writer, acmeOnly, reader];

const t = useDatabase({ customers: { acme: 'cus_acme', globex: 'cus_globex' } });
let config: Config;
let temporal: ReturnType<typeof temporalHealthConnection>;
let app: Api;
const logLines: string[] = [];
const log = createLogger('debug', { write: (line: string) => void logLines.push(line) });
const extraApps: Api[] = [];

beforeAll(async () => {
  config = testConfig({ API_TOKENS: JSON.stringify(TOKENS), API_BODY_LIMIT_BYTES: '1024', STRIPE_METER_EVENT_NAME: 'api_requests' });
  temporal = temporalHealthConnection(config.temporal);
  app = buildApi({ config, db: t.pool, log, temporal });
  await app.ready();
});

afterAll(async () => {
  for (const a of extraApps) await a.close();
  await app?.close();
  await temporal?.close();
});

const auth = (t: ApiToken | string) => ({ authorization: `Bearer ${typeof t === 'string' ? t : t.token}` });

function post(body: unknown, token: ApiToken | string | null = writer, headers: Record<string, string> = {}, target: Api = app) {
  return target.inject({
    method: 'POST',
    url: '/v1/usage',
    headers: { ...(token === null ? {} : auth(token)), ...headers },
    ...(typeof body === 'string' ? { payload: body } : { payload: body as object }),
  });
}

async function rowCounts(): Promise<{ usage: number; outbox: number }> {
  const { rows } = await t.pool.query<{ usage: number; outbox: number }>(
    'SELECT (SELECT count(*)::int FROM usage_logs) AS usage, (SELECT count(*)::int FROM outbox) AS outbox',
  );
  return rows[0]!;
}

/** Runs `fn` and checks that it wrote nothing. */
async function writesNothing(fn: () => Promise<void>): Promise<void> {
  const before = await rowCounts();
  await fn();
  expect(await rowCounts()).toEqual(before);
}

const usage = (over: Record<string, unknown> = {}) => ({ tenant_id: 'acme', usage_id: `req-${randomUUID()}`, quantity: 3, ...over });
const errorOf = (res: LightMyRequestResponse) => (res.json() as { error: { code: string; message: string; fields?: { field: string; message: string }[] } }).error;

describe('POST /v1/usage', () => {
  it('records a new usage (201), and the same request again is a 200 with the same entry', async () => {
    // An hour ago, to the millisecond.
    const occurredAt = new Date(Math.floor(Date.now() / 3_600_000) * 3_600_000 - 3_600_000 + 250).toISOString();
    const body = usage({ quantity: 7, occurred_at: occurredAt });
    const first = await post(body);
    expect(first.statusCode).toBe(201);
    const created = first.json();
    expect(created).toEqual({
      idempotency_key: idempotencyKeyFor('acme', body.usage_id),
      status: 'pending',
      tenant_id: 'acme',
      usage_id: body.usage_id,
      quantity: 7,
      event_name: 'api_requests',
      occurred_at: occurredAt,
      created: true,
    });

    const before = await rowCounts();
    const again = await post(body);
    expect(again.statusCode).toBe(200);
    expect(again.json()).toEqual({ ...created, created: false });
    expect(await rowCounts()).toEqual(before);

    const { rows } = await t.pool.query('SELECT tenant_id, quantity, event_name FROM outbox WHERE idempotency_key = $1', [created.idempotency_key]);
    expect(rows).toEqual([{ tenant_id: 'acme', quantity: 7, event_name: 'api_requests' }]);
  });

  it("records each usage in a short transaction: one whose connection goes silent before COMMIT is ended by PostgreSQL, its key's lock with it", async () => {
    // What each transaction on the API's pool begins with (db-failover.test.ts: what BEGIN_SHORT does).
    const pool = createPool(t.db.url, 2);
    const begun = transactionsBegun(pool);
    const api = buildApi({ config, db: pool, log, temporal });
    extraApps.push(api);
    try {
      expect((await post(usage(), writer, {}, api)).statusCode).toBe(201);
      expect(begun).toEqual([BEGIN_SHORT]);
    } finally {
      await pool.end();
    }
  });

  it("serves tenants in turn when requests outnumber connections: one tenant's flood waits behind itself, and no request waits past the bound", async () => {
    // One connection, held by the test: every request queues for it.
    const pool = createPool(t.db.url, 1);
    const api = buildApi({ config, db: pool, log, temporal, turnWaitMs: 3_000 });
    extraApps.push(api);
    const held = await pool.connect();
    try {
      const answered: string[] = [];
      const send = (tenant: string, i: number) => post(usage({ tenant_id: tenant, usage_id: `turn-${tenant}-${i}-${randomUUID()}` }), writer, {}, api).then((res) => {
        answered.push(`${tenant}:${res.statusCode}`);
        return res;
      });
      const flood = Array.from({ length: 30 }, (_, i) => send('acme', i));
      await new Promise((resolve) => setTimeout(resolve, 100));
      const other = send('globex', 0);
      await new Promise((resolve) => setTimeout(resolve, 100));
      held.release();
      expect((await other).statusCode).toBe(201);
      // globex's one request went after at most two of acme's (the one holding the turn, the one
      // whose turn came first), not after all thirty.
      expect(answered.indexOf('globex:201')).toBeLessThanOrEqual(2);
      expect((await Promise.all(flood)).map((r) => r.statusCode)).toEqual(Array(30).fill(201));

      // Held past the bound: requests waiting for the connection and for their turn behind it are
      // answered 503 (retry), not left hanging, and the next one after is served.
      const again = await pool.connect();
      const late = await Promise.all([usage({ tenant_id: 'globex' }), usage(), usage()].map((body) => post(body, writer, {}, api)));
      again.release();
      expect(late.map((r) => r.statusCode)).toEqual([503, 503, 503]);
      expect(late[1]!.headers['retry-after']).toBe('1');
      expect(errorOf(late[2]!)).toMatchObject({ code: 'busy' });
      expect((await post(usage(), writer, {}, api)).statusCode).toBe(201);
    } finally {
      await pool.end();
    }
  });

  it('answers a retry of a usage recorded in time as recorded (200) after it has grown too old for Stripe', async () => {
    const body = usage({ occurred_at: new Date(Date.now() - (35 * 86_400_000 + 1_800_000)).toISOString() });
    vi.useFakeTimers({ toFake: ['Date'], now: Date.now() - 2 * 3_600_000 });
    const first = await post(body).finally(() => vi.useRealTimers());
    expect(first.statusCode, first.body).toBe(201);
    const again = await post(body);
    expect(again.statusCode, again.body).toBe(200);
    expect(again.json()).toMatchObject({ created: false, usage_id: body.usage_id });
    const fresh = await post({ ...body, usage_id: `req-${randomUUID()}` });
    expect(fresh.statusCode).toBe(400);
    expect(errorOf(fresh).fields).toEqual([{ field: 'occurred_at', message: expect.stringContaining('must be less than 34 days 23 hours old') }]);
  });

  it('takes event_name from the request, and occurred_at defaults to now', async () => {
    const res = await post(usage({ event_name: 'tokens', tenant_id: 'globex' }));
    expect(res.statusCode).toBe(201);
    const body = res.json();
    expect(body).toMatchObject({ event_name: 'tokens', tenant_id: 'globex', created: true });
    expect(Math.abs(Date.parse(body.occurred_at) - Date.now())).toBeLessThan(60_000);
  });

  it('refuses the same usage_id with different values (409) and keeps the first', async () => {
    const body = usage({ quantity: 2 });
    expect((await post(body)).statusCode).toBe(201);
    await writesNothing(async () => {
      const res = await post({ ...body, quantity: 3 });
      expect(res.statusCode).toBe(409);
      // What differs, so that the caller can tell a changed request from a reused id.
      expect(errorOf(res)).toMatchObject({ code: 'usage_conflict', message: expect.stringContaining(': quantity (recorded 2, given 3)') });
    });
    const { rows } = await t.pool.query('SELECT quantity FROM outbox WHERE idempotency_key = $1', [idempotencyKeyFor('acme', body.usage_id)]);
    expect(rows).toEqual([{ quantity: 2 }]);
  });

  const badFields: [string, Record<string, unknown>, string, RegExp][] = [
    ['missing tenant_id', { tenant_id: undefined }, 'tenant_id', /required/],
    ['quantity 0', { quantity: 0 }, 'quantity', /at least 1/],
    ['quantity 1.5', { quantity: 1.5 }, 'quantity', /integer/],
    ['quantity "5"', { quantity: '5' }, 'quantity', /integer/],
    ['quantity 10^16', { quantity: 1e16 }, 'quantity', /at most 999999999999999/],
    ['negative quantity', { quantity: -4 }, 'quantity', /at least 1/],
    ['usage_id too long', { usage_id: 'u'.repeat(91) }, 'usage_id', /at most 90 characters/],
    ['empty usage_id', { usage_id: '' }, 'usage_id', /empty/],
    ['occurred_at not a date', { occurred_at: 'yesterday' }, 'occurred_at', /RFC 3339/],
    ['occurred_at without a time zone', { occurred_at: '2025-06-01T10:00:00' }, 'occurred_at', /RFC 3339/],
    ['occurred_at on a day that does not exist', { occurred_at: '2025-02-30T10:00:00Z' }, 'occurred_at', /RFC 3339/],
    ['occurred_at on a leap second', { occurred_at: '2016-12-31T23:59:60Z' }, 'occurred_at', /RFC 3339/],
    ['occurred_at as a number', { occurred_at: 1748772000 }, 'occurred_at', /string/],
    ['an extra property', { ocurred_at: '2025-06-01T10:00:00Z' }, 'ocurred_at', /not a known field/],
    ['occurred_at older than Stripe takes (35 days)', { occurred_at: new Date(Date.now() - 36 * 86_400_000).toISOString() }, 'occurred_at', /less than 34 days 23 hours old/],
    ['tenant_id with surrounding spaces', { tenant_id: ' acme ' }, 'tenant_id', /leading or trailing spaces/],
    ['usage_id with a control character', { usage_id: 'a\u0007b' }, 'usage_id', /control/],
    ['usage_id with a lone surrogate (JSON escape)', { usage_id: 'a\ud800b' }, 'usage_id', /surrogate/],
    ['usage_id with a right-to-left override', { usage_id: 'inv\u202egpj.exe' }, 'usage_id', /bidirectional/],
    ['tenant_id with a zero-width space', { tenant_id: 'ac\u200bme' }, 'tenant_id', /invisible/],
    ['quantity 2^63', { quantity: 2 ** 63 }, 'quantity', /at most 999999999999999/],
    ['quantity "NaN"', { quantity: 'NaN' }, 'quantity', /integer/],
    ['quantity null', { quantity: null }, 'quantity', /integer/],
    ['quantity true', { quantity: true }, 'quantity', /integer/],
    ['empty event_name', { event_name: '' }, 'event_name', /empty/],
    ['event_name over 100 characters', { event_name: 'e'.repeat(101) }, 'event_name', /at most 100/],
    ['tenant_id over 200 characters', { tenant_id: 't'.repeat(201) }, 'tenant_id', /at most 200/],
    ['tenant_id a number', { tenant_id: 42 }, 'tenant_id', /string/],
    ['usage_id an array', { usage_id: ['a'] }, 'usage_id', /string/],
    ['usage_id an object', { usage_id: { $ne: null } }, 'usage_id', /string/],
  ];
  for (const [what, change, field, message] of badFields) {
    it(`400 for ${what}, naming the field, writing nothing`, async () => {
      await writesNothing(async () => {
        const res = await post(usage(change));
        expect(res.statusCode, res.body).toBe(400);
        const error = errorOf(res);
        expect(error.code).toBe('invalid_request');
        expect(error.fields).toHaveLength(1);
        expect(error.fields![0]!.field).toBe(field);
        expect(error.fields![0]!.message).toMatch(message);
        expect(error.message).toContain(field);
      });
    });
  }

  it('reports every bad field at once', async () => {
    await writesNothing(async () => {
      const res = await post({ usage_id: 'x', quantity: 0, extra: true });
      expect(res.statusCode).toBe(400);
      expect(errorOf(res).fields!.map((f) => f.field).sort()).toEqual(['extra', 'quantity', 'tenant_id']);
    });
  });

  it('takes SQL and shell meta-characters as data: stored verbatim, nothing else touched', async () => {
    for (const usageId of [`x'); DROP TABLE outbox; --${randomUUID()}`, `$(rm -rf /)\`id\`;|&${randomUUID()}`, `%s%n{0}\\${randomUUID()}`]) {
      const res = await post(usage({ usage_id: usageId }));
      expect(res.statusCode, res.body).toBe(201);
      const { rows } = await t.pool.query('SELECT id FROM usage_logs WHERE tenant_id = $1 AND id = $2', ['acme', usageId]);
      expect(rows).toEqual([{ id: usageId }]);
    }
    const { rows } = await t.pool.query(`SELECT count(*)::int AS n FROM outbox`);
    expect(rows[0].n).toBeGreaterThan(0);
  });

  it('400 for NaN and Infinity written as bare JSON tokens', async () => {
    await writesNothing(async () => {
      for (const token of ['NaN', 'Infinity', '-Infinity']) {
        const res = await post(`{"tenant_id":"acme","usage_id":"req-${randomUUID()}","quantity":${token}}`, writer, { 'content-type': 'application/json' });
        expect(res.statusCode).toBe(400);
        expect(errorOf(res).code).toBe('invalid_json');
      }
    });
  });

  it('400 for a body that is not a JSON object, or not JSON', async () => {
    await writesNothing(async () => {
      const arr = await post('[1,2]', writer, { 'content-type': 'application/json' });
      expect(arr.statusCode).toBe(400);
      expect(errorOf(arr).code).toBe('invalid_request');
      expect(errorOf(arr).message).toBe('(body): must be a JSON object');
      const broken = await post('{"tenant_id": ', writer, { 'content-type': 'application/json' });
      expect(broken.statusCode).toBe(400);
      expect(errorOf(broken).code).toBe('invalid_json');
    });
  });

  it('400 for bytes that are not UTF-8, instead of turning them into U+FFFD (two ids would become one)', async () => {
    const id = `req-${randomUUID()}`;
    // The same id with two different invalid bytes: leniently decoded, both would read "<id>\ufffd".
    for (const bad of [0xff, 0xfe]) {
      await writesNothing(async () => {
        const payload = Buffer.concat([
          Buffer.from(`{"tenant_id":"acme","quantity":1,"usage_id":"${id}`),
          Buffer.from([bad]),
          Buffer.from('"}'),
        ]);
        const res = await app.inject({ method: 'POST', url: '/v1/usage', headers: { ...auth(writer), 'content-type': 'application/json' }, payload });
        expect(res.statusCode).toBe(400);
        expect(errorOf(res)).toMatchObject({ code: 'invalid_encoding', message: 'the body is not valid UTF-8' });
      });
    }
  });

  it('415 for a body declared in another charset, or compressed with a Content-Encoding we do not decode', async () => {
    await writesNothing(async () => {
      const body = JSON.stringify(usage());
      const latin1 = await post(body, writer, { 'content-type': 'application/json; charset=iso-8859-1' });
      expect(latin1.statusCode).toBe(415);
      expect(errorOf(latin1).code).toBe('unsupported_charset');
      const gzip = await post(body, writer, { 'content-type': 'application/json', 'content-encoding': 'gzip' });
      expect(gzip.statusCode).toBe(415);
      expect(errorOf(gzip).code).toBe('unsupported_content_encoding');
    });
    const utf8 = await post(JSON.stringify(usage()), writer, { 'content-type': 'application/json; charset=UTF-8' });
    expect(utf8.statusCode).toBe(201);
  });

  it('400 for a key given twice, instead of the last one silently winning', async () => {
    await writesNothing(async () => {
      const res = await post(`{"tenant_id":"acme","usage_id":"req-${randomUUID()}","quantity":1,"quantity":999}`, writer, {
        'content-type': 'application/json',
      });
      expect(res.statusCode).toBe(400);
      expect(errorOf(res)).toMatchObject({ code: 'duplicate_key', message: expect.stringContaining('"quantity"') });
      // The same key spelt with an escape is the same key.
      const escaped = await post(`{"tenant_id":"acme","usage_id":"x","quantity":1,"\u0071uantity":2}`, writer, { 'content-type': 'application/json' });
      expect(errorOf(escaped).code).toBe('duplicate_key');
    });
  });

  it('scopes usage_id by tenant: another tenant taking an id first neither blocks nor reveals it', async () => {
    const id = `req-${randomUUID()}`;
    const globex = await post({ tenant_id: 'globex', usage_id: id, quantity: 50 });
    expect(globex.statusCode).toBe(201);
    // acme-only's first use of that id is a new usage (not 409, which would say "taken").
    const acme = await post({ tenant_id: 'acme', usage_id: id, quantity: 1 }, acmeOnly);
    expect(acme.statusCode).toBe(201);
    expect(acme.json()).toMatchObject({ idempotency_key: idempotencyKeyFor('acme', id), quantity: 1, created: true });
  });

  it('413 over the configured body limit', async () => {
    await writesNothing(async () => {
      const res = await post(usage({ event_name: 'e'.repeat(2_000) }));
      expect(res.statusCode).toBe(413);
      expect(errorOf(res).code).toBe('payload_too_large');
    });
  });

  it('415 for anything but JSON', async () => {
    await writesNothing(async () => {
      for (const type of ['text/plain', 'application/x-www-form-urlencoded', 'application/xml']) {
        const res = await post('tenant_id=acme&usage_id=x&quantity=1', writer, { 'content-type': type });
        expect(res.statusCode, type).toBe(415);
        expect(errorOf(res).code).toBe('unsupported_media_type');
      }
    });
  });

  it('422 for a tenant without a billing customer', async () => {
    await writesNothing(async () => {
      const res = await post(usage({ tenant_id: 'nobody' }));
      expect(res.statusCode).toBe(422);
      expect(errorOf(res).code).toBe('unknown_tenant');
    });
  });
});

describe('at the door', () => {
  it("refuses usage for a meter Stripe does not have (422), and lets usage in when Stripe cannot be asked", async () => {
    const stripe = await LocalStripe.start({ meters: ['api_requests'] });
    try {
      const withMeters = buildApi({ config, db: t.pool, log, temporal, meters: new MeterCatalog(createStripeClient(testConfig({ STRIPE_API_BASE: stripe.url, STRIPE_API_KEY: 'sk_test_door' }).stripe)) });
      extraApps.push(withMeters);
      // A meter being replaced (deactivated, its successor not made yet): let in, its delivery waits for it.
      stripe.addMeter('being_replaced');
      stripe.deactivateMeter('being_replaced');
      expect((await post(usage({ event_name: 'being_replaced' }), writer, {}, withMeters)).statusCode).toBe(201);
      await writesNothing(async () => {
        const res = await post(usage({ event_name: 'no_such_meter' }), writer, {}, withMeters);
        expect(res.statusCode).toBe(422);
        expect(errorOf(res)).toMatchObject({ code: 'unknown_meter', message: expect.stringContaining('"no_such_meter"') });
        // A name that only looks right (a zero-width space in it) is a bad field, named as such: not
        // a meter to create.
        const hidden = await post(usage({ event_name: 'api_\u200brequests' }), writer, {}, withMeters);
        expect(hidden.statusCode).toBe(400);
        expect(errorOf(hidden)).toMatchObject({ code: 'invalid_request', fields: [{ field: 'event_name' }] });
      });
      expect((await post(usage({ event_name: 'api_requests' }), writer, {}, withMeters)).statusCode).toBe(201);
      // Stripe away: the door cannot check, and does not lose usage for it (the worker checks again).
      // (A second later: the list read for the requests above no longer answers for a new name.)
      await new Promise((resolve) => setTimeout(resolve, 1_100));
      await stripe.close();
      const res = await post(usage({ event_name: 'not_checked_now' }), writer, {}, withMeters);
      expect(res.statusCode).toBe(201);
    } finally {
      await stripe.close();
    }
  });

  it('through a Stripe outage, usage for a meter the door knows is answered without waiting for the meter list, however old its last read', async () => {
    const stripe = await LocalStripe.start({ meters: ['api_requests'] });
    try {
      const client = createStripeClient(testConfig({ STRIPE_API_BASE: stripe.url, STRIPE_API_KEY: 'sk_test_door' }).stripe);
      // Stripe answers the first read of the meter list, then stops answering (the door's own wait would be 1 s).
      let reads = 0;
      const hanging = { [Symbol.asyncIterator]: () => ({ next: () => new Promise<never>(() => undefined) }) };
      const list = ((...args: Parameters<typeof client.billing.meters.list>) => (++reads === 1 ? client.billing.meters.list(...args) : hanging)) as typeof client.billing.meters.list;
      const stalling = { billing: { ...client.billing, meters: Object.assign(Object.create(client.billing.meters) as object, { list }) } } as Pick<Stripe, 'billing'>;
      // Every read already past its age: each request would ask Stripe again if the door waited for it.
      const catalog = new MeterCatalog(stalling, { maxAgeMs: 0, minReloadIntervalMs: 0 });
      const withMeters = buildApi({ config, db: t.pool, log, temporal, meters: catalog });
      extraApps.push(withMeters);
      expect((await post(usage(), writer, {}, withMeters)).statusCode).toBe(201);
      for (let i = 0; i < 5; i++) {
        const began = performance.now();
        expect((await post(usage(), writer, {}, withMeters)).statusCode).toBe(201);
        expect(performance.now() - began).toBeLessThan(800);
      }
      // Asked behind the answers, and still waiting for Stripe.
      expect(reads).toBeGreaterThan(1);
    } finally {
      await stripe.close();
    }
  });

  it('through a Stripe outage that refuses connections, names the door has not read are let in without waiting for the next paced read', async () => {
    const stripe = await LocalStripe.start({ meters: ['api_requests'] });
    // The catalog's own pace: a read a second at most.
    const catalog = new MeterCatalog(createStripeClient(testConfig({ STRIPE_API_BASE: stripe.url, STRIPE_API_KEY: 'sk_test_door' }).stripe));
    const withMeters = buildApi({ config, db: t.pool, log, temporal, meters: catalog });
    extraApps.push(withMeters);
    await stripe.close();
    // The first asks (its read refused at once); the next would wait for the pace's next read, a second.
    expect((await post(usage({ event_name: 'not_read_1' }), writer, {}, withMeters)).statusCode).toBe(201);
    for (const name of ['not_read_2', 'not_read_3']) {
      const began = performance.now();
      expect((await post(usage({ event_name: name }), writer, {}, withMeters)).statusCode).toBe(201);
      expect(performance.now() - began).toBeLessThan(800);
    }
  });

  it('answers usage already recorded as recorded (200) once its meter is gone, and refuses only new usage for it (422)', async () => {
    // The meter deactivated between a request that timed out after its 201 and the client's retry.
    const stripe = await LocalStripe.start({ meters: ['another_meter'] });
    try {
      const gone = buildApi({ config, db: t.pool, log, temporal, meters: new MeterCatalog(createStripeClient(testConfig({ STRIPE_API_BASE: stripe.url, STRIPE_API_KEY: 'sk_test_door' }).stripe)) });
      extraApps.push(gone);
      const body = usage();
      expect((await post(body, writer)).statusCode).toBe(201);
      const again = await post(body, writer, {}, gone);
      expect(again.statusCode).toBe(200);
      expect(again.json()).toMatchObject({ created: false, usage_id: body.usage_id });
      // The same usage id with other values is still a conflict, not a missing meter.
      expect((await post({ ...body, quantity: 999 }, writer, {}, gone)).statusCode).toBe(409);
      await writesNothing(async () => {
        const res = await post(usage(), writer, {}, gone);
        expect(res.statusCode).toBe(422);
        expect(errorOf(res).code).toBe('unknown_meter');
      });
    } finally {
      await stripe.close();
    }
  });

  it('refuses every request of a burst for a misspelt meter, not only the first (the catalog reads Stripe at its own pace)', async () => {
    const stripe = await LocalStripe.start({ meters: ['api_requests'] });
    try {
      // Reads of the meter list 5 s apart at most: a request that had to wait for the next read
      // would wait past the door's 1 s and be let in unchecked.
      const catalog = new MeterCatalog(createStripeClient(testConfig({ STRIPE_API_BASE: stripe.url, STRIPE_API_KEY: 'sk_test_door' }).stripe), { minReloadIntervalMs: 5_000 });
      const withMeters = buildApi({ config, db: t.pool, log, temporal, meters: catalog });
      extraApps.push(withMeters);
      await writesNothing(async () => {
        const answers = [await post(usage({ event_name: 'tokns' }), writer, {}, withMeters)];
        answers.push(...(await Promise.all(Array.from({ length: 5 }, () => post(usage({ event_name: 'tokns' }), writer, {}, withMeters)))));
        expect(answers.map((r) => r.statusCode)).toEqual([422, 422, 422, 422, 422, 422]);
      });
    } finally {
      await stripe.close();
    }
  });

  it('closes a connection that promises a body and never sends it, and goes on serving', async () => {
    const port = await quickApi();
    const socket = net.connect(port, '127.0.0.1');
    await new Promise((resolve) => socket.once('connect', resolve));
    let answer = '';
    socket.on('data', (b: Buffer) => (answer += b.toString()));
    const closed = new Promise((resolve) => socket.once('close', resolve));
    // Ten bytes of a hundred promised, then nothing.
    socket.write(`POST /v1/usage HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ${writer.token}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"tenant":`);
    await closed;
    expect(answer === '' || /^HTTP\/1\.1 408/.test(answer)).toBe(true);
    const res = await fetch(`http://127.0.0.1:${port}/health`);
    expect(res.status).toBe(200);
  });
  /** An API listening with a request timeout of 500 ms (and `meters`, if given); its port. */
  const quickApi = async (meters?: Parameters<typeof buildApi>[0]['meters']): Promise<number> => {
    const quick = buildApi({ config: { ...config, api: { ...config.api, requestTimeoutMs: 500 } }, db: t.pool, log, temporal, ...(meters ? { meters } : {}) });
    extraApps.push(quick);
    await quick.listen({ host: '127.0.0.1', port: 0 });
    return (quick.server.address() as AddressInfo).port;
  };
  /** quickApi whose meter check number n takes `takesMs(n)`. */
  const apiWithMeterCheck = (takesMs: (check: number) => number): Promise<number> => {
    let checks = 0;
    return quickApi({
      keysFor: async () => {
        await new Promise((r) => setTimeout(r, takesMs(++checks)));
        return { meterId: 'mtr_1', customerKey: 'stripe_customer_id', valueKey: 'value' };
      },
      known: () => 'ask' as const,
    });
  };
  it('answers a usage whose handling outlasts the request timeout (a slow meter check): the whole request arrived in time, so it gets its 201, not a reset', async () => {
    const port = await apiWithMeterCheck(() => 900);
    const body = usage();
    const res = await fetch(`http://127.0.0.1:${port}/v1/usage`, {
      method: 'POST',
      headers: { authorization: `Bearer ${writer.token}`, 'content-type': 'application/json' },
      body: JSON.stringify(body),
    });
    expect(res.status).toBe(201);
    const { rows } = await t.pool.query('SELECT 1 FROM usage_logs WHERE tenant_id = $1 AND id = $2', ['acme', body.usage_id]);
    expect(rows).toHaveLength(1);
  });
  it('answers both of two pipelined usages on one connection, the second handled long after the first was answered', async () => {
    // The first at once; the second past the request timeout, after the first's answer.
    const port = await apiWithMeterCheck((check) => (check === 2 ? 1_500 : 0));
    const socket = net.connect(port, '127.0.0.1');
    socket.on('error', () => undefined);
    await new Promise((resolve) => socket.once('connect', resolve));
    let answer = '';
    socket.on('data', (b: Buffer) => (answer += b.toString()));
    const request = () => {
      const body = JSON.stringify(usage());
      return `POST /v1/usage HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ${writer.token}\r\nContent-Type: application/json\r\nContent-Length: ${Buffer.byteLength(body)}\r\n\r\n${body}`;
    };
    socket.write(request() + request());
    const closed = new Promise((resolve) => socket.once('close', resolve));
    await Promise.race([waitFor('two answers', async () => (answer.match(/HTTP\/1\.1 201/g)?.length ?? 0) >= 2 || undefined, 10_000, 50), closed]);
    socket.destroy();
    expect(answer.match(/HTTP\/1\.1 201/g)).toHaveLength(2);
  });
  it('closes a connection that sends nothing at all within the request timeout', async () => {
    const port = await quickApi();
    const socket = net.connect(port, '127.0.0.1');
    socket.on('error', () => undefined);
    const started = Date.now();
    await new Promise((resolve) => socket.once('connect', resolve));
    // Closed after the 500 ms timeout; waited for up to 10 s, for a machine busy with other tests.
    const closed = await Promise.race([new Promise((resolve) => socket.once('close', () => resolve(true))), new Promise((resolve) => setTimeout(() => resolve(false), 10_000))]);
    socket.destroy();
    expect(closed).toBe(true);
    expect(Date.now() - started).toBeLessThan(10_000);
  });
  it('ends a request whose body trickles in past the request timeout, however steadily it arrives', async () => {
    const limitMs = 1_000;
    const quick = buildApi({ config: { ...config, api: { ...config.api, requestTimeoutMs: limitMs } }, db: t.pool, log, temporal });
    extraApps.push(quick);
    await quick.listen({ host: '127.0.0.1', port: 0 });
    const { port } = quick.server.address() as AddressInfo;
    const socket = net.connect(port, '127.0.0.1');
    await new Promise((resolve) => socket.once('connect', resolve));
    let answer = '';
    socket.on('data', (b: Buffer) => (answer += b.toString()));
    socket.on('error', () => undefined);
    const started = Date.now();
    let closedAfterMs = -1;
    const closed = new Promise<void>((resolve) => socket.once('close', () => ((closedAfterMs = Date.now() - started), resolve())));
    const body = JSON.stringify(usage()).padEnd(200, ' ');
    socket.write(`POST /v1/usage HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ${writer.token}\r\nContent-Type: application/json\r\nContent-Length: ${body.length}\r\n\r\n`);
    // A byte every 100 ms never leaves the socket idle long enough for the idle timeout: only the
    // request timeout can end it. Whole, the body would take 20 s; the trickle stops after 8.
    for (let i = 0; i < body.length && closedAfterMs < 0 && Date.now() - started < 8_000; i++) {
      socket.write(body[i]!);
      await new Promise((resolve) => setTimeout(resolve, 100));
    }
    await closed;
    expect(answer).not.toMatch(/^HTTP\/1\.1 201/);
    // The limit plus one sweep of the server's connections (a tenth of the limit), with room for a slow machine.
    expect(closedAfterMs).toBeGreaterThanOrEqual(limitMs);
    expect(closedAfterMs).toBeLessThan(limitMs * 3);
  });
  it('logs a request the HTTP parser refuses without the bytes it read, even at trace', async () => {
    // Node hands the parser's error the raw bytes it read (`rawPacket`: every header, the token's
    // among them), and Fastify's own handler logs that error at trace.
    const lines: string[] = [];
    const traced = buildApi({ config, db: t.pool, log: createLogger('trace', { write: (line: string) => void lines.push(line) }), temporal });
    extraApps.push(traced);
    await traced.listen({ host: '127.0.0.1', port: 0 });
    const { port } = traced.server.address() as AddressInfo;
    const socket = net.connect(port, '127.0.0.1');
    socket.on('error', () => undefined);
    socket.write(`POST /v1/usage HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ${writer.token}\r\nBad Header: 1\r\n\r\n`);
    await waitFor('the client error logged', async () => lines.some((l) => l.includes('client error')), 5_000);
    socket.destroy();
    const all = lines.join('\n');
    expect(all).not.toContain(writer.token);
    expect(all).not.toContain([...Buffer.from(writer.token)].join(','));
  });
});

describe('authentication and scopes', () => {
  it('401 without a token, with an unknown one, or with another scheme', async () => {
    await writesNothing(async () => {
      const none = await post(usage(), null);
      expect(none.statusCode).toBe(401);
      expect(none.headers['www-authenticate']).toMatch(/^Bearer /);
      expect(errorOf(none).code).toBe('unauthorized');

      const unknown = await post(usage(), secret('tok_unknown'));
      expect(unknown.statusCode).toBe(401);
      expect(unknown.headers['www-authenticate']).toMatch(/^Bearer .*error="invalid_token"/);

      // A prefix of a real token is not a real token.
      expect((await post(usage(), writer.token.slice(0, -1))).statusCode).toBe(401);
      const basic = await post(usage(), null, { authorization: `Basic ${Buffer.from(`x:${writer.token}`).toString('base64')}` });
      expect(basic.statusCode).toBe(401);
    });
  });

  it('checks the token before reading the body: no 413 or 400 for strangers', async () => {
    const huge = await post(usage({ event_name: 'e'.repeat(5_000) }), null);
    expect(huge.statusCode).toBe(401);
    const bad = await post({ nonsense: true }, secret('tok_unknown'));
    expect(bad.statusCode).toBe(401);
  });

  it('403 for a token without the route scope', async () => {
    await writesNothing(async () => {
      const res = await post(usage(), reader);
      expect(res.statusCode).toBe(403);
      expect(errorOf(res).code).toBe('insufficient_scope');
    });
    const metrics = await app.inject({ method: 'GET', url: '/metrics', headers: auth(writer) });
    expect(metrics.statusCode).toBe(403);
    const allowed = await app.inject({ method: 'GET', url: '/metrics', headers: auth(reader) });
    expect(allowed.statusCode).toBe(200);
    expect(allowed.headers['content-type']).toMatch(/^text\/plain/);
    expect(allowed.body).toContain('billing_outbox_rows{status="pending"}');
    // The API's own registry: no worker counter reading 0 for good (the workers count elsewhere),
    // only what the API counts itself.
    for (const workers of ['billing_outbox_events_sent_total', 'billing_outbox_stripe_errors_total{class="retryable"}', 'billing_outbox_relay_lane_window', 'billing_outbox_reconcile_last_success_timestamp_seconds']) {
      expect(allowed.body).not.toContain(workers);
    }
    expect(allowed.body).toContain('billing_outbox_stripe_errors_total{class="credentials"} 0');
  });

  it('403 for a tenant the token may not write, 201 for one it may', async () => {
    await writesNothing(async () => {
      const res = await post(usage({ tenant_id: 'globex' }), acmeOnly);
      expect(res.statusCode).toBe(403);
      expect(errorOf(res).code).toBe('tenant_forbidden');
      // Unknown tenants are refused by the token before the database is asked.
      expect((await post(usage({ tenant_id: 'nobody' }), acmeOnly)).statusCode).toBe(403);
      // A tenant_id with a hidden character is a bad field (400, named), not another tenant.
      const hidden = await post(usage({ tenant_id: 'acme\u200b' }), acmeOnly);
      expect(hidden.statusCode).toBe(400);
      expect(errorOf(hidden)).toMatchObject({ code: 'invalid_request', fields: [{ field: 'tenant_id' }] });
    });
    expect((await post(usage({ tenant_id: 'acme' }), acmeOnly)).statusCode).toBe(201);
  });

  it('404 for unknown routes, after authentication', async () => {
    expect((await app.inject({ method: 'GET', url: '/v1/nothing' })).statusCode).toBe(401);
    const res = await app.inject({ method: 'GET', url: '/v1/nothing', headers: auth(writer) });
    expect(res.statusCode).toBe(404);
    expect(errorOf(res).code).toBe('not_found');
    // A token pasted into the path comes back in neither the answer nor the log (checked below).
    for (const headers of [auth(writer), {}]) {
      const pasted = await app.inject({ method: 'GET', url: `/v1/${writer.token}?again=${writer.token}`, headers });
      expect(pasted.body).not.toContain(writer.token);
    }
    expect(errorOf(await app.inject({ method: 'GET', url: `/v1/${writer.token}`, headers: auth(writer) })).message).toBe('no route for GET at this path');
  });
});

describe('GET /health', () => {
  it('200 when PostgreSQL and Temporal answer, without a token', async () => {
    const res = await app.inject({ method: 'GET', url: '/health' });
    expect(res.statusCode).toBe(200);
    expect(res.json()).toEqual({ status: 'ok', postgres: 'ok', temporal: 'ok' });
  });

  it('runs one probe at a time, however many ask: a flood of unauthenticated requests queues one statement in the pool usage is written through, not one each', async () => {
    let probes = 0;
    const counting = new Proxy(t.pool, {
      get(target, prop) {
        const value = Reflect.get(target, prop, target) as unknown;
        if (prop !== 'query' || typeof value !== 'function') return typeof value === 'function' ? value.bind(target) : value;
        return (...args: Parameters<typeof target.query>) => {
          const statement = args[0] as string | { text: string };
          if ((typeof statement === 'string' ? statement : statement.text).includes('pg_is_in_recovery')) probes++;
          return (target.query as (...a: unknown[]) => unknown)(...args);
        };
      },
    });
    const shared = buildApi({ config, db: counting, log, temporal, healthTimeoutMs: 2_000 });
    extraApps.push(shared);
    const answers = await Promise.all(Array.from({ length: 200 }, () => shared.inject({ method: 'GET', url: '/health' })));
    expect(answers.map((a) => a.statusCode)).toEqual(answers.map(() => 200));
    expect(probes).toBe(1);
    // Answered again, fresh, once the answer has aged.
    await new Promise((r) => setTimeout(r, HEALTH_FRESH_MS + 50));
    expect((await shared.inject({ method: 'GET', url: '/health' })).statusCode).toBe(200);
    expect(probes).toBe(2);
  });

  it('503 naming PostgreSQL when the database is away; usage is then refused with 503, not 500', async () => {
    const deadPool = createPool('postgresql://nobody:secret@127.0.0.1:1/nothing', 1);
    const dead = buildApi({ config, db: deadPool, log, temporal, healthTimeoutMs: 2_000 });
    extraApps.push(dead);
    dead.addHook('onClose', () => deadPool.end());
    const res = await dead.inject({ method: 'GET', url: '/health' });
    expect(res.statusCode).toBe(503);
    expect(res.json()).toEqual({ status: 'unavailable', postgres: 'error', temporal: 'ok' });

    const write = await post(usage(), writer, {}, dead);
    expect(write.statusCode).toBe(503);
    expect(errorOf(write).code).toBe('unavailable');
  });

  it('503 naming PostgreSQL when it is read-only (a standby after a failover, a full managed disk); usage is refused with 503 to retry, not 500', async () => {
    const url = new URL(t.db.url);
    url.searchParams.set('options', '-c default_transaction_read_only=on');
    const readOnlyPool = createPool(url.toString(), 1);
    const readOnly = buildApi({ config, db: readOnlyPool, log, temporal, healthTimeoutMs: 2_000 });
    extraApps.push(readOnly);
    readOnly.addHook('onClose', () => readOnlyPool.end());
    const res = await readOnly.inject({ method: 'GET', url: '/health' });
    expect(res.statusCode).toBe(503);
    expect(res.json()).toEqual({ status: 'unavailable', postgres: 'error', temporal: 'ok' });

    const write = await post(usage(), writer, {}, readOnly);
    expect(write.statusCode).toBe(503);
    expect(errorOf(write).code).toBe('unavailable');
    expect(write.headers['retry-after']).toBe('5');
  });

  it('200 naming Temporal when it does not answer (usage is still taken: it waits in the outbox), and not_configured without a client', async () => {
    const away = temporalHealthConnection({ ...config.temporal, address: '127.0.0.1:1' });
    const noTemporal = buildApi({ config, db: t.pool, log, temporal: away, healthTimeoutMs: 1_000 });
    extraApps.push(noTemporal);
    noTemporal.addHook('onClose', () => away.close());
    const res = await noTemporal.inject({ method: 'GET', url: '/health' });
    expect(res.statusCode).toBe(200);
    expect(res.json()).toMatchObject({ status: 'ok', postgres: 'ok' });
    expect(['error', 'timeout']).toContain(res.json().temporal);
    expect((await post(usage(), writer, {}, noTemporal)).statusCode).toBe(201);

    const without = buildApi({ config, db: t.pool, log });
    extraApps.push(without);
    const ok = await without.inject({ method: 'GET', url: '/health' });
    expect(ok.statusCode).toBe(200);
    expect(ok.json()).toEqual({ status: 'ok', postgres: 'ok', temporal: 'not_configured' });
  });
});

describe('request ids and logs', () => {
  it('echoes a sane x-request-id and replaces anything else', async () => {
    const mine = await app.inject({ method: 'GET', url: '/health', headers: { 'x-request-id': 'req-abc.123' } });
    expect(mine.headers['x-request-id']).toBe('req-abc.123');
    for (const insane of ['x'.repeat(65), 'has space', 'new\nline"}']) {
      const res = await app.inject({ method: 'GET', url: '/health', headers: { 'x-request-id': insane } });
      expect(res.headers['x-request-id']).toMatch(/^[0-9a-f-]{36}$/);
    }
    const failed = await post(usage(), null, { 'x-request-id': 'denied-1' });
    expect(failed.headers['x-request-id']).toBe('denied-1');
  });

  it('logs the request id, the token name and the idempotency key of each usage request', async () => {
    const body = usage();
    const res = await post(body, writer, { 'x-request-id': 'log-check-1' });
    expect(res.statusCode).toBe(201);
    const linesOf = () => logLines.map((l) => JSON.parse(l) as Record<string, unknown>).filter((l) => l.requestId === 'log-check-1');
    const recorded = linesOf().find((l) => l.msg === 'usage recorded');
    expect(recorded).toMatchObject({ idempotencyKey: idempotencyKeyFor('acme', body.usage_id), tokenName: 'writer', tenantId: 'acme', created: true });
    // Fastify logs completion on the socket's 'finish', which may come after inject() resolves.
    const completed = await waitFor('the request completed line', async () => linesOf().find((l) => l.msg === 'request completed'), 2_000, 10);
    expect(completed).toMatchObject({ idempotencyKey: idempotencyKeyFor('acme', body.usage_id), tokenName: 'writer', statusCode: 201, path: '/v1/usage' });
  });

  it('never writes a token or an Authorization header to the log', async () => {
    // Everything above went through this logger at debug level, tokens good and bad included.
    expect(logLines.length).toBeGreaterThan(50);
    const all = logLines.join('\n');
    for (const t of TOKENS) {
      expect(all).not.toContain(t.token);
      expect(all).not.toContain(t.token.slice(-20));
    }
    expect(all).not.toMatch(/tok_unknown_/);
    expect(all).not.toMatch(/Bearer|Basic /i);
    // If a header object is ever logged, its authorization field is censored.
    log.info({ req: { headers: { authorization: `Bearer ${writer.token}` } } }, 'probe');
    expect(logLines.at(-1)).not.toContain(writer.token);
    expect(logLines.at(-1)).toContain('"authorization":"***"');
  });
});
