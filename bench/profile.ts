/**
 * `npx tsx bench/profile.ts DIR [--top 15]`: the .cpuprofile files a `--cpu-prof DIR` run wrote
 * (one per thread: the main thread and the workflow threads), summed. When the run marked what it
 * measured (DIR/windows.jsonl: a drain, each bare shape of `ceiling`), only samples inside those
 * windows count, so start-up, bundling and warm-up stay out. Prints each package's share of the CPU
 * time sampled (idle left out) and the top functions by self time with their package; when windows
 * of several shapes were marked with their events (`ceiling`), also each shape's sampled
 * milliseconds per event by package and by function, side by side, to show where one costs more.
 */
import { readdir, readFile } from 'node:fs/promises';
import path from 'node:path';
import { parseArgs } from 'node:util';

interface ProfileNode {
  id: number;
  callFrame: { functionName: string; url: string; lineNumber: number };
}
interface CpuProfile {
  nodes: ProfileNode[];
  startTime: number;
  endTime: number;
  samples: number[];
  timeDeltas: number[];
}

/** The package a sampled frame belongs to, read from its script's URL. */
export function packageOf(url: string, functionName: string): string {
  if (!url) return functionName.startsWith('(') ? functionName : 'node internals';
  if (url.startsWith('node:') || !url.includes('/')) return 'node internals';
  const m = /node_modules\/((?:@[^/]+\/)?[^/]+)/.exec(url.replace(/\\/g, '/'));
  if (m) {
    const name = m[1]!;
    if (name.startsWith('@temporalio/')) return '@temporalio';
    if (name === 'pg' || name.startsWith('pg-') || name === 'postgres-array' || name === 'postgres-date') return 'pg';
    if (name === 'stripe') return 'stripe';
    if (name === 'tsx' || name === 'esbuild') return 'tsx (loader)';
    return `other: ${name}`;
  }
  // The workflow bundle is webpack's one script: our workflows and @temporalio/workflow together.
  if (/workflow|bundle/i.test(url) && !url.includes('/src/')) return 'workflow bundle';
  return 'ours';
}

interface Window {
  label: string;
  /** Events measured in the window (marked by `ceiling` and `drain`). */
  events?: number;
  fromUs: number;
  toUs: number;
}

/** Sampled self time (µs) of one window, or of all of them. */
interface Tally {
  total: number;
  idle: number;
  byPackage: Map<string, number>;
  byFunction: Map<string, { us: number; pkg: string }>;
}

const newTally = (): Tally => ({ total: 0, idle: 0, byPackage: new Map(), byFunction: new Map() });

async function main(): Promise<void> {
  const { positionals, values } = parseArgs({ allowPositionals: true, options: { top: { type: 'string', default: '15' } } });
  const dir = positionals[0];
  if (!dir) {
    console.error('usage: npx tsx bench/profile.ts DIR [--top N]');
    process.exit(2);
  }
  const top = Number(values.top);
  const files = (await readdir(dir)).filter((f) => f.endsWith('.cpuprofile'));
  const windows = await readFile(path.join(dir, 'windows.jsonl'), 'utf8').then(
    (t) => t.trim().split('\n').map((l) => JSON.parse(l) as Window),
    () => [] as Window[],
  );
  const all = newTally();
  const perWindow = new Map(windows.map((w) => [w, newTally()]));
  for (const file of files) {
    const profile = JSON.parse(await readFile(path.join(dir, file), 'utf8')) as CpuProfile;
    const nodes = new Map(profile.nodes.map((n) => [n.id, n]));
    let t = profile.startTime;
    for (let i = 0; i < profile.samples.length; i++) {
      t += profile.timeDeltas[i]!;
      // A sample stands for the time until the next one.
      const us = profile.timeDeltas[i + 1] ?? 0;
      const window = windows.find((w) => t >= w.fromUs && t <= w.toUs);
      if (windows.length > 0 && !window) continue;
      const frame = nodes.get(profile.samples[i]!)!.callFrame;
      for (const tally of window ? [all, perWindow.get(window)!] : [all]) count(tally, frame, us);
    }
  }
  const share = (us: number) => `${((us / all.total) * 100).toFixed(1)} %`;
  console.log(`${files.length} profiles; ${windows.length ? `${windows.length} window(s): ${windows.map((w) => `${w.label} ${((w.toUs - w.fromUs) / 1e6).toFixed(1)} s`).join(', ')}` : 'whole run'}`);
  console.log(`busy ${(all.total / 1e3).toFixed(0)} ms sampled (all threads), idle ${(all.idle / 1e3).toFixed(0)} ms\n`);
  console.log('by package (self time)');
  for (const [pkg, us] of [...all.byPackage].sort((a, b) => b[1] - a[1])) console.log(`  ${share(us).padStart(7)}  ${pkg}`);
  console.log(`\ntop ${top} functions by self time`);
  for (const [key, { us, pkg }] of [...all.byFunction].sort((a, b) => b[1].us - a[1].us).slice(0, top)) {
    console.log(`  ${share(us).padStart(7)}  ${pkg.padEnd(16)} ${key}`);
  }
  const shapes = windows.filter((w) => w.events);
  if (shapes.length > 1) sideBySide(shapes, perWindow, top);
}

function count(tally: Tally, frame: ProfileNode['callFrame'], us: number): void {
  if (frame.functionName === '(idle)') {
    tally.idle += us;
    return;
  }
  const pkg = packageOf(frame.url, frame.functionName);
  const where = frame.url ? `${path.basename(frame.url)}:${frame.lineNumber + 1}` : '';
  const key = `${frame.functionName || '(anonymous)'} ${where}`.trim();
  const entry = tally.byFunction.get(key) ?? { us: 0, pkg };
  entry.us += us;
  tally.byFunction.set(key, entry);
  tally.byPackage.set(pkg, (tally.byPackage.get(pkg) ?? 0) + us);
  tally.total += us;
}

/** Each marked shape's sampled milliseconds per event, by package and by function, in columns. */
function sideBySide(shapes: Window[], perWindow: Map<Window, Tally>, top: number): void {
  const perEvent = (w: Window, us: number) => us / 1e3 / w.events!;
  const cell = (v: number) => v.toFixed(2).padStart(Math.max(8, ...shapes.map((w) => w.label.length)) + 2);
  const header = shapes.map((w) => w.label.padStart(Math.max(8, ...shapes.map((s) => s.label.length)) + 2)).join('');
  const table = (title: string, rows: [string, number[]][]) => {
    console.log(`\n${title}\n${''.padEnd(44)}${header}`);
    for (const [name, values] of rows) console.log(`  ${name.slice(0, 42).padEnd(42)}${values.map(cell).join('')}`);
  };
  const tallies = shapes.map((w) => perWindow.get(w)!);
  const rows = (keys: Iterable<string>, us: (t: Tally, key: string) => number): [string, number[]][] =>
    [...new Set(keys)]
      .map((key): [string, number[]] => [key, shapes.map((w, i) => perEvent(w, us(tallies[i]!, key)))])
      .sort((a, b) => Math.max(...b[1]) - Math.max(...a[1]));
  table('sampled ms per event (busy, all threads)', [['busy', shapes.map((w, i) => perEvent(w, tallies[i]!.total))]]);
  table(
    'by package, ms per event',
    rows(
      tallies.flatMap((t) => [...t.byPackage.keys()]),
      (t, key) => t.byPackage.get(key) ?? 0,
    ),
  );
  table(
    `top ${top} functions, ms per event`,
    rows(
      tallies.flatMap((t) => [...t.byFunction.keys()]),
      (t, key) => t.byFunction.get(key)?.us ?? 0,
    ).slice(0, top),
  );
}

await main();
