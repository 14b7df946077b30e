/**
 * `npx tsx bench/vm-entry.ts`: what one entry into the workflow sandbox costs, with and without a
 * timeout. The Temporal SDK enters its `vm` context several times per activation (initialize,
 * activate, unblock conditions, conclude, dispose), always with `timeout` (its isolate execution
 * timeout, 5 s, not a worker option), and for each such run node starts a watchdog thread and joins
 * it. The CPU profile of `ceiling` shows the result as `runInContext` self time; this is its unit price.
 */
import vm from 'node:vm';

const calls = 20_000;
const context = vm.createContext({}, { microtaskMode: 'afterEvaluate' });
const script = new vm.Script('globalThis.n = (globalThis.n ?? 0) + 1');
for (const round of [1, 2]) {
  for (const [label, opts] of [
    ['with timeout (as the SDK runs it)', { timeout: 5_000 }],
    ['without timeout', {}],
  ] as const) {
    const cpu0 = process.cpuUsage();
    const t0 = performance.now();
    for (let i = 0; i < calls; i++) script.runInContext(context, opts);
    const cpu = process.cpuUsage(cpu0);
    const us = (n: number) => (n / calls).toFixed(1);
    console.log(`round ${round}, ${label}: ${us(cpu.user + cpu.system)} µs CPU, ${us((performance.now() - t0) * 1000)} µs wall per entry`);
  }
}
