/**
 * `npx tsx bench/profile.ts DIR [--top 15]`: the .cpuprofile files a `--cpu-prof DIR` run wrote
 * (one per thread: the main thread and the workflow threads), summed. When the run marked its
 * drain (DIR/windows.jsonl), only samples inside those windows count, so start-up, bundling and
 * warm-up stay out. Prints each package's share of the CPU time sampled (idle left out) and the top
 * functions by self time with their package.
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

async function main(): Promise<void> {
  const { positionals, values } = parseArgs({ allowPositionals: true, options: { top: { type: 'string', default: '15' } } });
  const dir = positionals[0];
  if (!dir) {
    console.error('usage: npx tsx bench/profile.ts DIR [--top N]');
    process.exit(2);
  }
  const files = (await readdir(dir)).filter((f) => f.endsWith('.cpuprofile'));
  const windows = await readFile(path.join(dir, 'windows.jsonl'), 'utf8').then(
    (t) => t.trim().split('\n').map((l) => JSON.parse(l) as { label: string; fromUs: number; toUs: number }),
    () => [],
  );
  const inWindow = (t: number) => windows.length === 0 || windows.some((w) => t >= w.fromUs && t <= w.toUs);
  const selfUs = new Map<string, { us: number; pkg: string }>();
  const byPackage = new Map<string, number>();
  let total = 0;
  let idle = 0;
  for (const file of files) {
    const profile = JSON.parse(await readFile(path.join(dir, file), 'utf8')) as CpuProfile;
    const nodes = new Map(profile.nodes.map((n) => [n.id, n]));
    let t = profile.startTime;
    for (let i = 0; i < profile.samples.length; i++) {
      t += profile.timeDeltas[i]!;
      // A sample stands for the time until the next one.
      const us = profile.timeDeltas[i + 1] ?? 0;
      if (!inWindow(t)) continue;
      const frame = nodes.get(profile.samples[i]!)!.callFrame;
      if (frame.functionName === '(idle)') {
        idle += us;
        continue;
      }
      const pkg = packageOf(frame.url, frame.functionName);
      const where = frame.url ? `${path.basename(frame.url)}:${frame.lineNumber + 1}` : '';
      const key = `${frame.functionName || '(anonymous)'} ${where}`.trim();
      const entry = selfUs.get(key) ?? { us: 0, pkg };
      entry.us += us;
      selfUs.set(key, entry);
      byPackage.set(pkg, (byPackage.get(pkg) ?? 0) + us);
      total += us;
    }
  }
  const share = (us: number) => `${((us / total) * 100).toFixed(1)} %`;
  console.log(`${files.length} profiles; ${windows.length ? `${windows.length} window(s): ${windows.map((w) => `${w.label} ${((w.toUs - w.fromUs) / 1e6).toFixed(1)} s`).join(', ')}` : 'whole run'}`);
  console.log(`busy ${(total / 1e3).toFixed(0)} ms sampled (all threads), idle ${(idle / 1e3).toFixed(0)} ms\n`);
  console.log('by package (self time)');
  for (const [pkg, us] of [...byPackage].sort((a, b) => b[1] - a[1])) console.log(`  ${share(us).padStart(7)}  ${pkg}`);
  console.log(`\ntop ${values.top} functions by self time`);
  for (const [key, { us, pkg }] of [...selfUs].sort((a, b) => b[1].us - a[1].us).slice(0, Number(values.top))) {
    console.log(`  ${share(us).padStart(7)}  ${pkg.padEnd(16)} ${key}`);
  }
}

await main();
