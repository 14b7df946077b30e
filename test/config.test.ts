import { readFileSync } from 'node:fs';
import path from 'node:path';
import { describe, expect, it } from 'vitest';
import { CONFIG_VARIABLES, ConfigError, loadConfig, longestAttemptsMs, misspelledVariables, misspelledVariableWarnings } from '../src/config.js';
import { requireStripeKey } from '../src/stripe/client.js';

function problems(env: Record<string, string>): string[] {
  try {
    loadConfig(env);
  } catch (err) {
    if (err instanceof ConfigError) return err.problems;
    throw err;
  }
  return [];
}

describe('configuration', () => {
  it('has working defaults when nothing is set', () => {
    const c = loadConfig({});
    expect(c.temporal).toEqual({ address: undefined, namespace: 'default', taskQueue: 'billing-outbox' });
    expect(c.stripe).toMatchObject({ apiBase: 'https://api.stripe.com', isRealStripe: true, meterEventName: 'api_requests' });
    expect(c.retry).toEqual({ initialIntervalMs: 1000, backoffCoefficient: 2, maximumIntervalMs: 300_000, maximumAttempts: 12, attemptTimeoutMs: 140_000, heartbeatTimeoutMs: 10_000, maxRateLimitedMs: 3_600_000, deadLetterOpenMs: 7 * 86_400_000 });
    expect(c.lanes).toEqual({ maxInFlight: 4 });
    expect(c.timings).toMatchObject({ callTimeoutMs: 20_000, leaseMs: 25_000, leaseWaitMs: 10_000, handOffMs: 5_000, unansweredHoldMs: 30_000, heartbeatTimeoutMs: 10_000 });
    expect(c.relay.batchSize).toBeGreaterThan(0);
  });

  it('reads every variable it knows, each one documented in the README and .env.example', () => {
    // A valid value other than the default, for each variable.
    const samples: Record<string, string> = {
      NODE_ENV: 'production',
      DATABASE_URL: 'postgres://u:p@db:5432/x',
      DATABASE_SCHEMA: 'billing_east',
      TEMPORAL_ADDRESS: 'temporal:7233',
      TEMPORAL_NAMESPACE: 'billing',
      TEMPORAL_TASK_QUEUE: 'billing-2',
      TEMPORAL_TLS: 'true',
      // Any existing files will do: the config only checks that they are there.
      TEMPORAL_TLS_CA_FILE: path.join(import.meta.dirname, '..', 'package.json'),
      TEMPORAL_TLS_CERT_FILE: path.join(import.meta.dirname, '..', 'README.md'),
      TEMPORAL_TLS_KEY_FILE: path.join(import.meta.dirname, '..', 'tsconfig.json'),
      TEMPORAL_TLS_SERVER_NAME: 'temporal.internal',
      TEMPORAL_API_KEY: 'cloud-api-key',
      STRIPE_API_KEY: 'sk_test_abc123',
      STRIPE_API_BASE: 'http://127.0.0.1:12111/',
      STRIPE_METER_EVENT_NAME: 'tokens',
      STRIPE_TIMEOUT_MS: '5000',
      STRIPE_UNANSWERED_HOLD_MS: '1000',
      STRIPE_WEBHOOK_SECRET: 'whsec_abc',
      STRIPE_RATE_LIMIT_PER_SECOND: '50',
      STRIPE_METER_API: 'v2',
      STRIPE_IDENTIFIER_NAMESPACE: 'east',
      TEMPORAL_UI_URL: 'http://ui.internal:8233',
      RETRY_INITIAL_INTERVAL_MS: '2000',
      RETRY_BACKOFF_COEFFICIENT: '1.5',
      RETRY_MAXIMUM_INTERVAL_MS: '60000',
      RETRY_MAXIMUM_ATTEMPTS: '5',
      RETRY_MAX_RATE_LIMITED_MS: '60000',
      RETRY_MAX_OUTAGE_MS: '3600000',
      DEAD_LETTER_OPEN_DAYS: '2',
      RELAY_BATCH_SIZE: '50',
      RELAY_COUNT: '3',
      RELAY_CLAIM_TIMEOUT_MS: '30000',
      RELAY_POLL_INTERVAL_MS: '500',
      LANE_MAX_IN_FLIGHT: '2',
      LOCAL_STRIPE_URL: 'http://127.0.0.1:12111/',
      WORKER_MAX_CONCURRENT_DELIVERIES: '100',
      STARTUP_WAIT_MS: '5000',
      API_HOST: '0.0.0.0',
      API_PORT: '9090',
      API_BODY_LIMIT_BYTES: '1024',
      API_REQUEST_TIMEOUT_MS: '2000',
      API_KEEP_ALIVE_TIMEOUT_MS: '1000',
      API_TOKENS: JSON.stringify([{ name: 'app', token: 'x'.repeat(32), tenants: ['*'], scopes: ['usage:write'] }]),
      WORKER_METRICS_PORT: '9464',
      OUTBOX_RETENTION_DAYS: '60',
      OUTBOX_PRUNE_INTERVAL_MS: '60000',
      RECONCILE_SCHEDULE: 'off',
      RECONCILE_INTERVAL_MS: '900000',
      RECONCILE_LAG_MS: '7200000',
      DATA_DIR: '/var/lib/billing-outbox',
      TEMPORAL_CLI_PATH: '/usr/local/bin/temporal',
      LOG_LEVEL: 'debug',
      OTEL_EXPORTER_OTLP_ENDPOINT: 'http://collector:4318',
      OTEL_SERVICE_NAME: 'billing-east',
    };
    expect(Object.keys(samples).sort()).toEqual([...CONFIG_VARIABLES].sort());
    const defaults = loadConfig({});
    const readme = readFileSync(path.join(import.meta.dirname, '..', 'README.md'), 'utf8');
    const example = readFileSync(path.join(import.meta.dirname, '..', '.env.example'), 'utf8');
    // Production needs a Stripe key; the comparison keeps everything else equal.
    // A client certificate comes with its key: each is compared with the other alone being invalid.
    const needs: Record<string, Record<string, string>> = {
      NODE_ENV: { STRIPE_API_KEY: 'sk_test_abc123' },
      TEMPORAL_TLS_CERT_FILE: { TEMPORAL_TLS_KEY_FILE: samples.TEMPORAL_TLS_KEY_FILE! },
      TEMPORAL_TLS_KEY_FILE: { TEMPORAL_TLS_CERT_FILE: samples.TEMPORAL_TLS_CERT_FILE! },
    };
    const pair = new Set(['TEMPORAL_TLS_CERT_FILE', 'TEMPORAL_TLS_KEY_FILE']);
    for (const [name, value] of Object.entries(samples)) {
      const base = needs[name] ?? {};
      expect(loadConfig({ ...base, [name]: value }), `${name} is not read`).not.toEqual(name in needs && !pair.has(name) ? loadConfig(base) : defaults);
      expect(readme, `${name} is not in the README`).toContain(`\`${name}\``);
      expect(example, `${name} is not in .env.example`).toMatch(new RegExp(`^#? ?${name}=`, 'm'));
    }
    const c = loadConfig(samples);
    expect(c.stripe).toMatchObject({ apiBase: 'http://127.0.0.1:12111', isRealStripe: false, apiKey: 'sk_test_abc123' });
    expect(c.retry.backoffCoefficient).toBe(1.5);
    expect(c.relay.count).toBe(3);
    expect(c.temporal.tls).toEqual({ caFile: samples.TEMPORAL_TLS_CA_FILE, certFile: samples.TEMPORAL_TLS_CERT_FILE, keyFile: samples.TEMPORAL_TLS_KEY_FILE, serverName: 'temporal.internal' });
    expect(c.api.tokens[0]!.name).toBe('app');
  });

  it('reports one clear line per bad variable, all at once', () => {
    const p = problems({
      RELAY_BATCH_SIZE: 'lots',
      RETRY_MAXIMUM_ATTEMPTS: '0',
      TEMPORAL_ADDRESS: 'no port here',
      STRIPE_API_BASE: 'ftp://x',
      DATABASE_URL: 'mysql://x',
    });
    expect(p).toHaveLength(5);
    expect(p.find((l) => l.startsWith('RELAY_BATCH_SIZE:'))).toMatch(/whole number/);
    expect(p.find((l) => l.startsWith('RETRY_MAXIMUM_ATTEMPTS:'))).toMatch(/at least 1/);
    expect(p.find((l) => l.startsWith('TEMPORAL_ADDRESS:'))).toMatch(/host:port/);
    expect(p.find((l) => l.startsWith('STRIPE_API_BASE:'))).toMatch(/http/);
    expect(p.find((l) => l.startsWith('DATABASE_URL:'))).toMatch(/postgres/);
  });

  it("times a run's attempts for the longest STRIPE_TIMEOUT_MS, not this worker's: raised later, the events in flight are not timed out by Temporal while their calls go on", () => {
    const quick = loadConfig({ STRIPE_TIMEOUT_MS: '1000' });
    const slowest = loadConfig({ STRIPE_TIMEOUT_MS: '120000' });
    expect(quick.retry.attemptTimeoutMs).toBe(slowest.retry.attemptTimeoutMs);
    // The lease wait, the longest call, and the database work around it.
    expect(slowest.retry.attemptTimeoutMs).toBeGreaterThanOrEqual(slowest.timings.leaseMs + 10_000 + 5_000);
    expect(quick.timings.attemptMs).toBe(21_000);
  });

  it("refuses retries that could outlast the 23 h resend window (an event would die of the window, not of its own error); the defaults take 21.5 min", () => {
    expect(longestAttemptsMs({ initialIntervalMs: 1_000, backoffCoefficient: 2, maximumIntervalMs: 300_000, maximumAttempts: 12 }, 40_000)).toBe(1_292_000);
    expect(longestAttemptsMs({ initialIntervalMs: 1_000, backoffCoefficient: 2, maximumIntervalMs: 300_000, maximumAttempts: 1 }, 40_000)).toBe(40_000);
    // "Retry for longer": 500 attempts 5 minutes apart, each up to 40 s: some 46 h.
    expect(problems({ RETRY_MAXIMUM_ATTEMPTS: '500' })).toEqual([expect.stringMatching(/^RETRY_MAXIMUM_ATTEMPTS: 500 attempts, .* can take 46\.4 h, after the 7 h of RETRY_MAX_OUTAGE_MS and RETRY_MAX_RATE_LIMITED_MS: past the 23 h/)]);
    // The longest outage's wait, then the default hour of 429s, leaves room for the default attempts, not for 60 of them.
    expect(loadConfig({ RETRY_MAX_OUTAGE_MS: '72000000' }).timings.maxOutageMs).toBe(72_000_000);
    expect(problems({ RETRY_MAX_OUTAGE_MS: '72000000', RETRY_MAXIMUM_ATTEMPTS: '60' })).toEqual([expect.stringMatching(/^RETRY_MAXIMUM_ATTEMPTS: 60 attempts/)]);
    // Nor for 3 h of 429s after it: both come before the attempts.
    expect(problems({ RETRY_MAX_OUTAGE_MS: '72000000', RETRY_MAX_RATE_LIMITED_MS: '10800000' })).toEqual([expect.stringMatching(/^RETRY_MAXIMUM_ATTEMPTS: 12 attempts, .* after the 23 h of RETRY_MAX_OUTAGE_MS and RETRY_MAX_RATE_LIMITED_MS/)]);
    // A 429 stretch longer than 20 h is refused as such.
    expect(problems({ RETRY_MAX_RATE_LIMITED_MS: '86400000' })).toEqual([expect.stringMatching(/^RETRY_MAX_RATE_LIMITED_MS: must be at most 72000000/)]);
  });

  it('STRIPE_METER_EVENT_NAME: held to the rules of an event name sent with a usage, or the process does not start', () => {
    // Copied from a document with a no-break space, or written with a combining accent: each would
    // otherwise start and refuse every usage that names no event with a 400.
    expect(problems({ STRIPE_METER_EVENT_NAME: 'api\u00a0requests' })).toEqual([expect.stringMatching(/^STRIPE_METER_EVENT_NAME: .*U\+00A0/)]);
    expect(problems({ STRIPE_METER_EVENT_NAME: 'cafe\u0301' })).toEqual([expect.stringMatching(/^STRIPE_METER_EVENT_NAME: .*NFC/)]);
    expect(problems({ STRIPE_METER_EVENT_NAME: 'x'.repeat(101) })).toEqual([expect.stringMatching(/at most 100/)]);
    expect(loadConfig({ STRIPE_METER_EVENT_NAME: ' tokens\n' }).stripe.meterEventName).toBe('tokens');
  });

  it('OUTBOX_RETENTION_DAYS: at least 36, past Stripe\'s 35-day window (pruning sooner would blind reconcile and cancel); STRIPE_RATE_LIMIT_PER_SECOND: 900 with a live key, 20 otherwise', () => {
    expect(problems({ OUTBOX_RETENTION_DAYS: '35' })).toEqual([expect.stringMatching(/^OUTBOX_RETENTION_DAYS: must be at least 36/)]);
    expect(loadConfig({ OUTBOX_RETENTION_DAYS: '36' }).retention.olderThanMs).toBe(36 * 86_400_000);
    expect(loadConfig({ NODE_ENV: 'production', STRIPE_API_KEY: 'sk_live_abc123' }).stripe.rateLimitPerSecond).toBe(900);
    expect(loadConfig({ NODE_ENV: 'production', STRIPE_API_KEY: 'rk_live_abc123' }).stripe.rateLimitPerSecond).toBe(900);
    expect(loadConfig({ STRIPE_API_KEY: 'sk_test_abc123' }).stripe.rateLimitPerSecond).toBe(20);
    expect(loadConfig({ STRIPE_API_KEY: 'sk_live_abc123', NODE_ENV: 'production', STRIPE_RATE_LIMIT_PER_SECOND: '50' }).stripe.rateLimitPerSecond).toBe(50);
  });

  it('LANE_MAX_IN_FLIGHT: by default one call\'s worth for v1 (4) and one stream request\'s for v2 (100); a value set wins in either', () => {
    expect(loadConfig({}).lanes.maxInFlight).toBe(4);
    expect(loadConfig({ STRIPE_METER_API: 'v2' }).lanes.maxInFlight).toBe(100);
    expect(loadConfig({ STRIPE_METER_API: 'v2', LANE_MAX_IN_FLIGHT: '10' }).lanes.maxInFlight).toBe(10);
    expect(loadConfig({ LANE_MAX_IN_FLIGHT: '10' }).lanes.maxInFlight).toBe(10);
  });

  it('STRIPE_IDENTIFIER_NAMESPACE: empty by default (identifiers unchanged), short and safe characters only', () => {
    expect(loadConfig({}).stripe.identifierNamespace).toBe('');
    expect(loadConfig({ STRIPE_IDENTIFIER_NAMESPACE: 'eu-west_2' }).stripe.identifierNamespace).toBe('eu-west_2');
    for (const bad of ['a/b', 'a:b', 'x'.repeat(25), 'café', 'a b']) {
      expect(problems({ STRIPE_IDENTIFIER_NAMESPACE: bad })[0], bad).toMatch(/^STRIPE_IDENTIFIER_NAMESPACE: must be at most 24 letters, digits/);
    }
  });

  it('DATABASE_SCHEMA: billing_outbox by default; a plain lowercase identifier that fits the names derived from it', () => {
    expect(loadConfig({}).databaseSchema).toBe('billing_outbox');
    expect(loadConfig({ DATABASE_SCHEMA: 'billing_2' }).databaseSchema).toBe('billing_2');
    for (const bad of ['Billing', 'public"; DROP TABLE x; --', '2nd', 'pg_billing', 'a-b', 'x'.repeat(41)]) {
      expect(problems({ DATABASE_SCHEMA: bad }), bad).toEqual([expect.stringMatching(/^DATABASE_SCHEMA: must be a plain lowercase identifier/)]);
    }
  });

  it('never echoes a secret value in its messages', () => {
    const err = (() => {
      try {
        loadConfig({ STRIPE_API_KEY: 'pk_live_SECRETSECRET', DATABASE_URL: 'redis://user:hunter2@x' });
      } catch (e) {
        return e as Error;
      }
    })();
    expect(err).toBeInstanceOf(ConfigError);
    expect(err!.message).not.toContain('SECRETSECRET');
    expect(err!.message).not.toContain('hunter2');
  });

  it("takes an application's own NODE_ENV and LOG_LEVEL spellings: staging is production, dev is not, INFO is info; anything else is refused, not guessed", () => {
    for (const env of ['staging', 'prod', 'Production']) {
      expect(problems({ NODE_ENV: env }), env).toEqual([]);
      expect(loadConfig({ NODE_ENV: env }).production, env).toBe(true);
    }
    for (const env of ['development', 'dev', 'local', 'test', 'Test']) expect(loadConfig({ NODE_ENV: env }).production, env).toBe(false);
    // Guessed either way, an unknown value would switch production's refusals on or off unasked.
    expect(problems({ NODE_ENV: 'qa-2' })).toEqual([expect.stringMatching(/^NODE_ENV: /)]);
    expect(loadConfig({ LOG_LEVEL: 'INFO' }).logLevel).toBe('info');
    expect(loadConfig({ LOG_LEVEL: ' Warn ' }).logLevel).toBe('warn');
    expect(problems({ LOG_LEVEL: 'verbose' })).toEqual([expect.stringMatching(/^LOG_LEVEL: /)]);
  });

  it('leaves STRIPE_API_KEY to what calls Stripe: migrate and the operator commands run without it in production', () => {
    expect(problems({ NODE_ENV: 'production' })).toEqual([]);
    const config = loadConfig({ NODE_ENV: 'production' });
    expect(() => requireStripeKey(config.stripe, 'the worker')).toThrow(/^Invalid configuration:\n {2}- STRIPE_API_KEY: is not set, and the worker calls Stripe with it/);
    expect(() => requireStripeKey(loadConfig({ NODE_ENV: 'production', STRIPE_API_KEY: 'sk_live_abc' }).stripe, 'the worker')).not.toThrow();
    // A Stripe-compatible server takes the local test key.
    expect(() => requireStripeKey(loadConfig({ STRIPE_API_BASE: 'http://127.0.0.1:12111' }).stripe, 'the worker')).not.toThrow();
  });

  it('takes Stripe itself however its URL is written (a trailing slash, :443): a live key goes there, and it is Stripe for every check', () => {
    for (const base of ['https://api.stripe.com/', 'https://api.stripe.com:443']) {
      const c = loadConfig({ STRIPE_API_KEY: 'sk_live_abc', STRIPE_API_BASE: base });
      expect(c.stripe).toMatchObject({ apiBase: 'https://api.stripe.com', isRealStripe: true });
    }
  });

  it('names a DATABASE_URL the driver could not parse (a password with an unencoded #), without echoing it', () => {
    const [line] = problems({ DATABASE_URL: 'postgres://app:pa#ss@db:5432/app' });
    expect(line).toMatch(/^DATABASE_URL: is not a valid URL: percent-encode/);
    expect(line).not.toContain('pa#ss');
    expect(loadConfig({ DATABASE_URL: 'postgres://app:pa%23ss@db:5432/app' }).databaseUrl).toBe('postgres://app:pa%23ss@db:5432/app');
    // A %XX that is not UTF-8: node-postgres's decoding would throw URIError.
    expect(problems({ DATABASE_URL: 'postgres://u:p%E9z@localhost/db' })[0]).toMatch(/^DATABASE_URL: is not a valid URL/);
    expect(problems({ DATABASE_URL: 'postgres://u:p@h%E9/db' })[0]).toMatch(/^DATABASE_URL: is not a valid URL/);
    // What node-postgres takes stays taken: a socket directory, an @ in the password, a space.
    for (const url of ['postgres://app@/app?host=/var/run/postgresql', 'postgres:///app', 'postgres://app:p@ss@db/app', 'postgres://app:p ss@db/app']) {
      expect(loadConfig({ DATABASE_URL: url }).databaseUrl, url).toBe(url);
    }
  });

  it('names a variable that looks like a misspelling of one it reads, and not the application\'s own', () => {
    const env = {
      DATABASE_SCHEME: 'billing',
      stripe_api_key: 'sk_test_x',
      STRIPE_IDENTIFIER_NAMESPCE: 'eu',
      DATABASE_SCHEMA_FILE: '/run/secrets/schema',
      STRIPE_PUBLISHABLE_KEY: 'pk_test_x',
      DATABASE_POOL_SIZE: '20',
      PATH: '/usr/bin',
    };
    expect(misspelledVariables(env)).toEqual([
      { name: 'DATABASE_SCHEME', meant: 'DATABASE_SCHEMA' },
      { name: 'stripe_api_key', meant: 'STRIPE_API_KEY' },
      { name: 'STRIPE_IDENTIFIER_NAMESPCE', meant: 'STRIPE_IDENTIFIER_NAMESPACE' },
    ]);
    // The application's own (another first word), or near one of ours that is set itself: not ours to name.
    expect(misspelledVariables({ APP_PORT: '3000', APP_HOST: 'x', MODE_ENV: 'x', API_TOKEN: 'x', API_TOKENS: 'ingest:abc', API_PORT: '8080' })).toEqual([]);
    expect(misspelledVariableWarnings({ DATABASE_SCHEME: 'billing' })).toEqual([
      'DATABASE_SCHEME is set but is not a billing-outbox variable: did you mean DATABASE_SCHEMA? (DATABASE_SCHEMA keeps its default)',
    ]);
  });

  it('refuses to send a live key anywhere but Stripe', () => {
    expect(problems({ STRIPE_API_KEY: 'sk_live_abc', STRIPE_API_BASE: 'http://127.0.0.1:12111' })[0]).toMatch(/live key/);
  });

  it('rejects malformed API tokens', () => {
    expect(problems({ API_TOKENS: '{nope' })[0]).toMatch(/^API_TOKENS: .*not valid JSON/);
    expect(problems({ API_TOKENS: JSON.stringify([{ name: 'a', token: 'short', tenants: ['*'], scopes: ['usage:write'] }]) })[0]).toMatch(/24 characters/);
    const dup = { name: 'a', token: 'y'.repeat(30), tenants: ['*'], scopes: ['usage:write'] };
    expect(problems({ API_TOKENS: JSON.stringify([dup, dup]) })[0]).toMatch(/used twice/);
    // A scope no route requires would make a token every request of which is refused (403).
    expect(problems({ API_TOKENS: JSON.stringify([{ ...dup, scopes: ['usage:read'] }]) })[0]).toMatch(/^API_TOKENS: .*usage:write.*metrics:read/);
  });

  it('rejects API tokens that could never be used as given: a space or non-ASCII in the value, one value twice, a tenant no usage can name', () => {
    const token = (over: Record<string, unknown>) => ({ name: 'a', token: 'z'.repeat(30), tenants: ['*'], scopes: ['usage:write'], ...over });
    expect(problems({ API_TOKENS: JSON.stringify([token({ token: ` ${'z'.repeat(30)}` })]) })[0]).toMatch(/visible ASCII/);
    expect(problems({ API_TOKENS: JSON.stringify([token({ token: `${'ä'.repeat(30)}` })]) })[0]).toMatch(/visible ASCII/);
    const twice = problems({ API_TOKENS: JSON.stringify([token({ name: 'writer' }), token({ name: 'metrics', scopes: ['metrics:read'] })]) });
    expect(twice).toEqual(['API_TOKENS: tokens "writer" and "metrics" have the same value']);
    // The value itself is never in a message.
    expect(twice.join()).not.toContain('z'.repeat(30));
    expect(problems({ API_TOKENS: JSON.stringify([token({ tenants: ['acme '] })]) })[0]).toMatch(/^API_TOKENS: token "a": tenant "acme " /);
    expect(problems({ API_TOKENS: JSON.stringify([token({ tenants: ['acme\u200b'] })]) })[0]).toMatch(/^API_TOKENS: token "a": tenant /);
    expect(() => loadConfig({ API_TOKENS: JSON.stringify([token({ tenants: ['acme', '*'] })]) })).not.toThrow();
    // .env.example's, uncommented as it is.
    expect(problems({ API_TOKENS: JSON.stringify([token({ name: 'app', token: 'change-me-to-a-long-random-string' })]) })).toEqual([
      'API_TOKENS: token "app" is .env.example\'s placeholder; make one (openssl rand -hex 32)',
    ]);
  });

  it('treats empty strings as unset', () => {
    expect(loadConfig({ RELAY_COUNT: '', STRIPE_API_KEY: '  ' }).relay.count).toBe(2);
  });

  it("takes a Kubernetes service link in a port variable (a Service named api sets API_PORT=tcp://…) as unset, not as a bad value that stops the worker", () => {
    const linked = loadConfig({ API_PORT: 'tcp://10.96.0.12:8080', WORKER_METRICS_PORT: 'tcp://10.96.4.2:9464' });
    expect(linked.api.port).toBe(8080);
    expect(linked).toEqual(loadConfig({}));
    // Set in the pod's own environment, it wins over the link; anything else is still refused.
    expect(loadConfig({ API_PORT: '9090' }).api.port).toBe(9090);
    expect(() => loadConfig({ API_PORT: 'http://10.96.0.12:8080' })).toThrow(/API_PORT: must be a whole number/);
    expect(() => loadConfig({ RELAY_COUNT: 'tcp://10.96.0.12:2' })).toThrow(/RELAY_COUNT: must be a whole number/);
  });
});
