/**
 * `npm run mutants [-- --quick] [--only id,id] [--no-baseline] [--json FILE] [--check]`: breaks each
 * guarantee of mutants/map.ts on purpose, one at a time, in a scratch copy of the working tree, and
 * runs only the test that must notice (`--check`: only anchor the map and say where each text is). A mutant the test still passes on *survived*: the guarantee
 * has no test that can fail. Exits 1 on any survivor, 2 when the map no longer matches the code.
 *
 * First the baseline: each named test must pass on the unbroken copy, or "caught" would mean nothing.
 * The working tree itself is never touched (the copy is deleted at the end). A mutant is anchored by
 * its text alone, found once anywhere in the product code (see `anchor`).
 *
 * One PostgreSQL and one Temporal dev server serve every run (DATABASE_URL and TEMPORAL_ADDRESS, as
 * the suite's global setup reads them, unless they are set already): each test makes its own
 * databases and task queues, as in the whole suite, and starting both per mutant cost more than
 * most of the tests themselves.
 */
import { spawn } from 'node:child_process';
import { chmodSync, cpSync, mkdirSync, mkdtempSync, readFileSync, rmSync, symlinkSync, writeFileSync, existsSync } from 'node:fs';
import { execFileSync } from 'node:child_process';
import os from 'node:os';
import path from 'node:path';
import { parseArgs } from 'node:util';
import { startEmbeddedPostgres } from '../src/embedded/postgres.js';
import { startTemporalDevServer } from '../src/embedded/temporal.js';
import { MUTANTS, type Mutant } from './map.js';

const ROOT = path.resolve(import.meta.dirname, '..');

const { values } = parseArgs({
  options: {
    quick: { type: 'boolean', default: false },
    only: { type: 'string' },
    'no-baseline': { type: 'boolean', default: false },
    json: { type: 'string' },
    check: { type: 'boolean', default: false },
  },
  strict: true,
});

type Verdict = 'caught' | 'survived' | 'baseline failed';
interface Result {
  id: string;
  /** Where its text was found. */
  file: string;
  guarantee: string;
  test: string;
  verdict: Verdict;
  seconds: number;
}

function selected(): Mutant[] {
  let list = MUTANTS;
  if (values.quick) list = list.filter((m) => m.quick);
  if (values.only) {
    const ids = values.only.split(',');
    const unknown = ids.filter((id) => !MUTANTS.some((m) => m.id === id));
    if (unknown.length) fail(`unknown mutant(s): ${unknown.join(', ')}`);
    list = list.filter((m) => ids.includes(m.id));
  }
  return list;
}

function fail(message: string): never {
  console.error(`mutants: ${message}`);
  process.exit(2);
}

/** Where product code lives: a mutant's text is looked for in every file under these. */
const PRODUCT_ROOTS = ['src', 'activities', 'workflows', 'migrations'];

function productFiles(): string[] {
  // A set: during a merge, git lists an unmerged file once per stage.
  const listed = execFileSync('git', ['ls-files', '--cached', '--others', '--exclude-standard', '-z', '--', ...PRODUCT_ROOTS], { cwd: ROOT, encoding: 'utf8' }).split('\0');
  return [...new Set(listed)].filter((f) => f && existsSync(path.join(ROOT, f)));
}

/**
 * Anchors each mutant: its text must occur exactly once in the whole product tree (not in one named
 * file, so moving code between modules keeps the mutant), the replacement must differ, and the test
 * it names must exist with a test whose name contains its pattern. Returns the file each text is in.
 * Any miss stops the run with exit 2: a mutant that changes nothing, or whose test is gone, would
 * report a guarantee as tested when nothing was.
 */
function anchor(list: Mutant[]): Map<string, string> {
  const files = productFiles().map((f) => ({ f, text: readFileSync(path.join(ROOT, f), 'utf8') }));
  const where = new Map<string, string>();
  for (const m of list) {
    const hits = files.flatMap(({ f, text }) => Array(text.split(m.find).length - 1).fill(f) as string[]);
    if (hits.length !== 1) {
      fail(`${m.id}: its text occurs ${hits.length} times in the product tree${hits.length ? ` (${[...new Set(hits)].join(', ')})` : ''}: the code moved on, update mutants/map.ts`);
    }
    if (m.find === m.replace) fail(`${m.id}: its replacement changes nothing`);
    const testPath = path.join(ROOT, m.test);
    if (!existsSync(testPath)) fail(`${m.id}: its test file ${m.test} does not exist`);
    if (m.name && !readFileSync(testPath, 'utf8').includes(m.name)) fail(`${m.id}: no test in ${m.test} is named with "${m.name}"`);
    where.set(m.id, hits[0]!);
  }
  return where;
}

/** The working tree's tracked and new files (not ignored ones), with node_modules and .tools linked. */
function scratchCopy(): string {
  const dir = mkdtempSync(path.join(os.tmpdir(), 'billing-outbox-mutants-'));
  const files = execFileSync('git', ['ls-files', '--cached', '--others', '--exclude-standard', '-z'], { cwd: ROOT, encoding: 'utf8' })
    .split('\0')
    .filter((f) => f && existsSync(path.join(ROOT, f)));
  for (const f of files) {
    mkdirSync(path.dirname(path.join(dir, f)), { recursive: true });
    cpSync(path.join(ROOT, f), path.join(dir, f));
  }
  for (const link of ['node_modules', '.tools']) {
    if (existsSync(path.join(ROOT, link))) symlinkSync(path.join(ROOT, link), path.join(dir, link));
  }
  mkdirSync(path.join(dir, 'logs'));
  return dir;
}

/** Runs one test (file and name pattern) in `dir`; true when it passed. Its output goes to `log`. */
function runTest(dir: string, test: string, name: string | undefined, log: string, services: Record<string, string>): Promise<boolean> {
  const args = ['run', test, ...(name ? ['-t', name] : [])];
  return new Promise((resolve) => {
    const child = spawn(path.join(dir, 'node_modules', '.bin', 'vitest'), args, {
      cwd: dir,
      env: { ...process.env, ...services, CI: 'true' },
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    const out: Buffer[] = [];
    child.stdout.on('data', (b: Buffer) => out.push(b));
    child.stderr.on('data', (b: Buffer) => out.push(b));
    child.on('close', (code) => {
      writeFileSync(log, Buffer.concat(out));
      resolve(code === 0);
    });
  });
}

/** The PostgreSQL and Temporal every run shares: the environment's own if set, else embedded ones in `dir`. */
async function startServices(dir: string): Promise<{ services: Record<string, string>; stop: () => Promise<void> }> {
  const services: Record<string, string> = {};
  const stops: (() => Promise<void>)[] = [];
  const data = path.join(dir, 'services');
  mkdirSync(data);
  // Run as root, PostgreSQL runs as a `postgres` system user that must be able to enter the folder.
  chmodSync(dir, 0o755);
  chmodSync(data, 0o755);
  if (!process.env.DATABASE_URL) {
    const pg = await startEmbeddedPostgres({ dataDir: path.join(data, 'pg'), database: 'postgres', persistent: false });
    stops.push(pg.stop);
    services.DATABASE_URL = pg.url;
  }
  if (!process.env.TEMPORAL_ADDRESS) {
    const temporal = await startTemporalDevServer({ dbFile: path.join(data, 'temporal.db'), taskQueueFairness: true });
    stops.push(temporal.stop);
    services.TEMPORAL_ADDRESS = temporal.address;
  }
  return { services, stop: async () => { for (const s of stops.reverse()) await s(); } };
}

async function main(): Promise<void> {
  const list = selected();
  // The whole map is anchored on every run, the quick one in CI too: a stale mutant outside the
  // subset must stop the run as well.
  const where = anchor(MUTANTS);
  if (values.check) {
    console.log(`mutants: all ${MUTANTS.length} anchored`);
    for (const m of MUTANTS) console.log(`  ${m.id.padEnd(38)} ${where.get(m.id)}`);
    return;
  }
  const dir = scratchCopy();
  console.log(`mutants: ${list.length} in ${dir}`);
  const results: Result[] = [];
  const baseline = new Map<string, boolean>();
  const { services, stop } = await startServices(dir);
  try {
    if (!values['no-baseline']) {
      for (const target of new Set(list.map((m) => JSON.stringify([m.test, m.name ?? null])))) {
        const [test, name] = JSON.parse(target) as [string, string | null];
        const ok = await runTest(dir, test, name ?? undefined, path.join(dir, 'logs', `baseline-${baseline.size}.log`), services);
        console.log(`  baseline ${ok ? 'passes' : 'FAILS '}  ${test}${name ? ` -t "${name}"` : ''}`);
        baseline.set(target, ok);
      }
    }
    for (const m of list) {
      const started = Date.now();
      const target = JSON.stringify([m.test, m.name ?? null]);
      let verdict: Verdict;
      if (baseline.get(target) === false) {
        verdict = 'baseline failed';
      } else {
        const file = path.join(dir, where.get(m.id)!);
        const original = readFileSync(file, 'utf8');
        writeFileSync(file, original.replace(m.find, m.replace));
        try {
          const passed = await runTest(dir, m.test, m.name, path.join(dir, 'logs', `${m.id}.log`), services);
          verdict = passed ? 'survived' : 'caught';
        } finally {
          writeFileSync(file, original);
        }
      }
      const r = { id: m.id, file: where.get(m.id)!, guarantee: m.guarantee, test: `${m.test}${m.name ? ` -t "${m.name}"` : ''}`, verdict, seconds: Math.round((Date.now() - started) / 1000) };
      results.push(r);
      console.log(`  ${verdict.padEnd(15)} ${m.id} (${r.seconds} s)`);
      if (verdict !== 'caught') console.log(`    its log: ${path.join(dir, 'logs', `${m.id}.log`)}`);
    }
  } finally {
    await stop();
    if (results.every((r) => r.verdict === 'caught')) rmSync(dir, { recursive: true, force: true });
  }

  console.log('\n| mutant | guarantee it breaks | test that must fail | result |\n|---|---|---|---|');
  for (const r of results) console.log(`| \`${r.id}\` | ${r.guarantee} | \`${r.test}\` | ${r.verdict} |`);
  const caught = results.filter((r) => r.verdict === 'caught').length;
  console.log(`\n${caught} of ${results.length} caught`);
  if (values.json) writeFileSync(values.json, `${JSON.stringify({ at: new Date().toISOString(), results }, null, 2)}\n`);
  if (caught !== results.length) process.exit(1);
}

await main();
