/**
 * `npm run mutants [-- --quick] [--only id,id] [--no-baseline] [--json FILE]`: breaks each
 * guarantee of mutants/map.ts on purpose, one at a time, in a scratch copy of the working tree, and
 * runs only the test that must notice. A mutant the test still passes on *survived*: the guarantee
 * has no test that can fail. Exits 1 on any survivor, 2 when the map no longer matches the code.
 *
 * First the baseline: each named test must pass on the unbroken copy, or "caught" would mean nothing.
 * The working tree itself is never touched (the copy is deleted at the end).
 */
import { spawn } from 'node:child_process';
import { cpSync, mkdirSync, mkdtempSync, readFileSync, rmSync, symlinkSync, writeFileSync, existsSync } from 'node:fs';
import { execFileSync } from 'node:child_process';
import os from 'node:os';
import path from 'node:path';
import { parseArgs } from 'node:util';
import { MUTANTS, type Mutant } from './map.js';

const ROOT = path.resolve(import.meta.dirname, '..');

const { values } = parseArgs({
  options: {
    quick: { type: 'boolean', default: false },
    only: { type: 'string' },
    'no-baseline': { type: 'boolean', default: false },
    json: { type: 'string' },
  },
  strict: true,
});

type Verdict = 'caught' | 'survived' | 'baseline failed';
interface Result {
  id: string;
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

/** Every mutant's text occurs exactly once in its file, and the replacement differs. */
function checkMap(list: Mutant[]): void {
  for (const m of list) {
    const text = readFileSync(path.join(ROOT, m.file), 'utf8');
    const count = text.split(m.find).length - 1;
    if (count !== 1) fail(`${m.id}: its text occurs ${count} times in ${m.file} (the code moved on: update mutants/map.ts)`);
    if (m.find === m.replace) fail(`${m.id}: its replacement changes nothing`);
  }
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
function runTest(dir: string, test: string, name: string | undefined, log: string): Promise<boolean> {
  const args = ['run', test, ...(name ? ['-t', name] : [])];
  return new Promise((resolve) => {
    const child = spawn(path.join(dir, 'node_modules', '.bin', 'vitest'), args, {
      cwd: dir,
      env: { ...process.env, CI: 'true' },
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

async function main(): Promise<void> {
  const list = selected();
  checkMap(list);
  const dir = scratchCopy();
  console.log(`mutants: ${list.length} in ${dir}`);
  const results: Result[] = [];
  const baseline = new Map<string, boolean>();
  try {
    if (!values['no-baseline']) {
      for (const target of new Set(list.map((m) => JSON.stringify([m.test, m.name ?? null])))) {
        const [test, name] = JSON.parse(target) as [string, string | null];
        const ok = await runTest(dir, test, name ?? undefined, path.join(dir, 'logs', `baseline-${baseline.size}.log`));
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
        const file = path.join(dir, m.file);
        const original = readFileSync(file, 'utf8');
        writeFileSync(file, original.replace(m.find, m.replace));
        try {
          const passed = await runTest(dir, m.test, m.name, path.join(dir, 'logs', `${m.id}.log`));
          verdict = passed ? 'survived' : 'caught';
        } finally {
          writeFileSync(file, original);
        }
      }
      const r = { id: m.id, guarantee: m.guarantee, test: `${m.test}${m.name ? ` -t "${m.name}"` : ''}`, verdict, seconds: Math.round((Date.now() - started) / 1000) };
      results.push(r);
      console.log(`  ${verdict.padEnd(15)} ${m.id} (${r.seconds} s)`);
      if (verdict !== 'caught') console.log(`    its log: ${path.join(dir, 'logs', `${m.id}.log`)}`);
    }
  } finally {
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
