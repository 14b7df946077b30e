/**
 * `npm run stripe -- <command>`: drives the local Stripe-compatible server that `npm start` runs
 * when no STRIPE_API_KEY is set (found through .data/endpoints.json, or LOCAL_STRIPE_URL). Nothing
 * here can reach the real Stripe: the control API answers loopback clients of the local server only.
 */
import { loadConfig, type Config } from '../config.js';
import { loadDotEnv, defaultDataDir, readRunningStack } from '../embedded/local-files.js';
import type { FaultState, RecordedMeterEvent } from '../embedded/stripe/types.js';

const HELP = `npm run stripe -- <command>     (the local Stripe of a running \`npm start\`)

  status                          where it is, its customers, meters, recorded events and faults
  customers                       list the customers
  customers add <cus_id>...       create customers with these ids (those that exist are left as they are)
  meters                          list the meters (event name → id)
  meters add <event_name>         create an active meter
  events [--customer <cus_id>] [--last <n>]
                                  the meter events it recorded (newest last; default the last 20)
  outage <seconds>                refuse every connection for that long (0 ends it)
  fail <count> <status>           answer the next <count> meter-event calls with <status> (429, 500, …)
  latency <ms>                    answer every meter-event call that late
  heal                            no outage, no latency, no queued failures: Stripe answers normally

Its state (customers, meters, recorded events) is kept in .data/stripe-local.json across restarts.`;

async function main(argv: string[]): Promise<number> {
  loadDotEnv();
  const [command, ...rest] = argv;
  if (!command || command === 'help' || command === '--help' || command === '-h') {
    console.log(HELP);
    return command ? 0 : 2;
  }
  const base = localStripeUrl(loadConfig());
  if (!base) {
    console.error('no local Stripe is running: `npm start` runs one when STRIPE_API_KEY is not set (or set LOCAL_STRIPE_URL)');
    return 1;
  }
  const control = async <T>(route: string, body?: unknown): Promise<T> => {
    const res = await fetch(`${base}/_local/${route}`, body === undefined ? {} : { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) });
    const json = (await res.json()) as T & { error?: string };
    if (!res.ok) throw new Error(json.error ?? `HTTP ${res.status}`);
    return json;
  };
  // Any test key is accepted by the local server unless it was started with one of its own.
  const get = (route: string) => fetch(`${base}/v1/${route}`, { headers: { authorization: 'Bearer sk_test_local' } });
  const api = async <T>(route: string): Promise<T> => (await (await get(route)).json()) as T;

  switch (command) {
    case 'status': {
      const [customers, meters, events, faults] = await Promise.all([
        // Through the API, which an outage refuses like any other client's call.
        api<{ data: { id: string }[] }>('customers?limit=100').catch(() => undefined),
        control<{ id: string; eventName: string }[]>('meters'),
        control<RecordedMeterEvent[]>('events'),
        control<FaultState>('faults'),
      ]);
      console.log(`local Stripe at ${base}: ${customers ? customers.data.length : '?'} customers, ${meters.length} meters, ${events.length} meter events recorded`);
      const inForce = describeFaults(faults);
      console.log(inForce.length > 0 ? `faults: ${inForce.join('; ')} (\`npm run stripe -- heal\` ends them all)` : 'faults: none, it answers normally');
      return 0;
    }
    case 'customers': {
      if (rest[0] === 'add') {
        const ids = rest.slice(1);
        if (ids.length === 0) return usage('customers add needs at least one customer id (cus_…)');
        for (const id of ids) {
          if (!/^cus_[A-Za-z0-9_]+$/.test(id)) return usage(`not a customer id: ${JSON.stringify(id)} (cus_ followed by letters, digits or _)`);
          // Adding is idempotent: ask first, so the answer says which of the two happened.
          const found = await get(`customers/${encodeURIComponent(id)}`);
          await found.arrayBuffer();
          const existed = found.ok;
          if (!existed) await control('customers', { id });
          console.log(existed ? `customer ${id} already exists: nothing added` : `customer ${id} added`);
        }
        return 0;
      }
      if (rest.length > 0) return usage(`unknown: customers ${rest.join(' ')}`);
      const customers = await api<{ data: { id: string }[] }>('customers?limit=100');
      for (const c of customers.data) console.log(c.id);
      return 0;
    }
    case 'meters': {
      if (rest[0] === 'add') {
        const name = rest[1];
        if (!name || rest.length > 2) return usage('meters add needs one event name');
        const { id } = await control<{ id: string }>('meters', { eventName: name });
        console.log(`meter ${id} counts events named ${name}`);
        return 0;
      }
      if (rest.length > 0) return usage(`unknown: meters ${rest.join(' ')}`);
      for (const m of await control<{ id: string; eventName: string }[]>('meters')) console.log(`${m.eventName}\t${m.id}`);
      return 0;
    }
    case 'events': {
      let customer: string | undefined;
      let last = 20;
      for (let i = 0; i < rest.length; i++) {
        if (rest[i] === '--customer' && rest[i + 1]) customer = rest[++i];
        else if (rest[i] === '--last' && /^\d+$/.test(rest[i + 1] ?? '')) last = Number(rest[++i]);
        else return usage(`unknown option: ${rest[i]}`);
      }
      const events = (await control<RecordedMeterEvent[]>('events')).filter((e) => !customer || e.customer === customer);
      for (const e of events.slice(-last)) {
        const flags = [e.cancelled && 'cancelled', e.asyncError && `rejected: ${e.asyncError.code}`].filter(Boolean).join(', ');
        console.log(`${new Date(e.timestamp * 1000).toISOString()}  ${e.customer}  ${e.eventName}  ${e.value}  ${e.identifier}${flags ? `  (${flags})` : ''}`);
      }
      console.log(`${events.length} event(s)${customer ? ` for ${customer}` : ''}`);
      return 0;
    }
    case 'outage': {
      const seconds = Number(rest[0]);
      if (rest.length !== 1 || !Number.isFinite(seconds) || seconds < 0) return usage('outage needs a number of seconds');
      await control('faults', { refuseForSeconds: seconds });
      console.log(seconds > 0 ? `local Stripe refuses every connection for ${seconds} s` : 'outage over');
      return 0;
    }
    case 'fail': {
      const [count, status] = rest.map(Number);
      if (rest.length !== 2 || !Number.isInteger(count) || !Number.isInteger(status) || status! < 400 || status! > 599) return usage('fail needs a count and an HTTP error status, e.g. fail 5 503');
      await control('faults', { failNext: { count, status, ...(status === 429 ? { retryAfterSeconds: 1 } : {}) } });
      console.log(`the next ${count} meter-event calls answer ${status}`);
      return 0;
    }
    case 'latency': {
      const ms = Number(rest[0]);
      if (rest.length !== 1 || !Number.isInteger(ms) || ms < 0) return usage('latency needs milliseconds');
      await control('faults', { latencyMs: ms });
      console.log(`meter-event calls answered after ${ms} ms`);
      return 0;
    }
    case 'heal': {
      const before = describeFaults(await control<FaultState>('faults'));
      await control('heal', {});
      console.log(`healed: no outage, no latency, no queued failures${before.length > 0 ? ` (ended: ${before.join('; ')})` : ' (there were none)'}`);
      return 0;
    }
    default:
      return usage(`unknown command: ${command}`);
  }
}

/** Each fault in force or queued, as a phrase. */
function describeFaults(f: FaultState): string[] {
  const calls = (n: number) => `${n} meter-event call${n === 1 ? '' : 's'}`;
  return [
    f.refusingForMs > 0 && `every connection refused for ${(f.refusingForMs / 1000).toFixed(1)} s more`,
    f.latencyMs > 0 && `every meter-event call answered ${f.latencyMs} ms late`,
    ...f.failNext.map((q) => `the next ${calls(q.count)} answer ${q.status}`),
    f.dropAfterRecord > 0 && `the next ${calls(f.dropAfterRecord)} recorded, then their connection dropped`,
    f.garbleNext > 0 && `the next ${calls(f.garbleNext)} answered with a malformed body`,
    ...f.asyncErrorNext.map((q) => `the next ${q.count} accepted event(s) reported failed later (${q.code})`),
    ...f.refusedCustomers.map((r) => `every v1 meter-event call for ${r.customer} answers ${r.status}`),
  ].filter((s): s is string => typeof s === 'string');
}

function usage(message: string): number {
  console.error(`${message}\n\n${HELP}`);
  return 2;
}

function localStripeUrl(config: Pick<Config, 'localStripeUrl' | 'dataDir'>): string | undefined {
  return config.localStripeUrl ?? readRunningStack(defaultDataDir(config.dataDir))?.localStripe;
}

try {
  process.exitCode = await main(process.argv.slice(2));
} catch (err) {
  console.error(`npm run stripe: ${err instanceof Error ? err.message : String(err)}`);
  process.exitCode = 1;
}
