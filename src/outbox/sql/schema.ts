/**
 * The PostgreSQL schema that holds one deployment's tables (`billing_outbox` unless configured), and
 * the names every statement uses in it.
 *
 * Every runtime statement names its tables through a `Schema`, qualified and quoted
 * (`"billing_outbox".outbox`), and never relies on `search_path`: recordUsage runs on the
 * application's own connection, whose search_path is the application's (and may find a table of its
 * own called `outbox` first), and a worker may be given the application's pool. Only the migration
 * runner sets search_path, locally to its own transaction (src/db.ts `migrate`).
 *
 * Two deployments in one database with different schemas share nothing: not a table, not a NOTIFY
 * channel, not a prepared statement name, not the claim's advisory lock.
 */

/** The schema when none is configured (DATABASE_SCHEMA, or the `schema` option). */
export const DEFAULT_SCHEMA = 'billing_outbox';

/**
 * A plain lowercase identifier, short enough for what is derived from it: the NOTIFY channels
 * (`<schema>:outbox`) and the prepared statements' names (`<schema>/mark-sent-and-hand-off`) must fit
 * PostgreSQL's 63 bytes. Lowercase only, so that the name reads the same quoted or not in psql.
 */
const SCHEMA_NAME = /^[a-z_][a-z0-9_]{0,39}$/;

/** Why `name` cannot be a schema name, or undefined when it can (config.ts reports it for DATABASE_SCHEMA). */
export function schemaNameProblem(name: string): string | undefined {
  if (SCHEMA_NAME.test(name) && !name.startsWith('pg_')) return undefined;
  return 'must be a plain lowercase identifier (a–z, 0–9, _; not starting with a digit or pg_), at most 40 characters';
}

export interface Schema {
  /** The schema's name, unquoted. */
  readonly name: string;
  /** The schema's name, quoted for SQL text. */
  readonly quoted: string;
  readonly outbox: string;
  readonly usageLogs: string;
  readonly billingCustomers: string;
  readonly schemaMigrations: string;
  readonly operatorActions: string;
  readonly meterLeases: string;
  readonly meterLeaseWaiters: string;
  readonly stripeErrorReports: string;
  readonly rateLimits: string;
  /** Its one row: which deployment this schema is (the relays' memo). */
  readonly deployment: string;
  /** The schema's lease hand-off function (migrations/001_schema.sql), qualified like the tables. */
  readonly meterLeaseHandOff: string;
  /** New outbox rows committed, or a lane with room again (the schema's insert trigger sends it too). */
  readonly outboxChannel: string;
  /** A (customer, meter) lease handed off. */
  readonly leaseChannel: string;
  /** The relay's claim lock (pg_advisory_xact_lock's two-key form: a constant, then this). */
  readonly claimLockKey: number;
  /** A prepared statement's name: the text differs per schema, so the name must too. */
  statementName(statement: string): string;
}

const schemas = new Map<string, Schema>();

/** The Schema of `name` (validated; built once per name). Throws a plain Error for a bad name. */
export function schemaFor(name: string = DEFAULT_SCHEMA): Schema {
  let schema = schemas.get(name);
  if (schema) return schema;
  const problem = schemaNameProblem(name);
  if (problem) throw new Error(`billing-outbox schema ${JSON.stringify(name)}: ${problem}`);
  const quoted = `"${name}"`;
  const table = (t: string) => `${quoted}.${t}`;
  schema = Object.freeze({
    name,
    quoted,
    outbox: table('outbox'),
    usageLogs: table('usage_logs'),
    billingCustomers: table('billing_customers'),
    schemaMigrations: table('schema_migrations'),
    operatorActions: table('operator_actions'),
    meterLeases: table('meter_leases'),
    meterLeaseWaiters: table('meter_lease_waiters'),
    stripeErrorReports: table('stripe_error_reports'),
    rateLimits: table('rate_limits'),
    deployment: table('deployment'),
    meterLeaseHandOff: table('meter_lease_hand_off'),
    outboxChannel: `${name}:outbox`,
    leaseChannel: `${name}:lease`,
    claimLockKey: lockKey(name),
    statementName: (statement: string) => `${name}/${statement}`,
  });
  schemas.set(name, schema);
  return schema;
}

/** A stable 32-bit signed integer of the name (FNV-1a): the second key of the schema's advisory locks. */
function lockKey(name: string): number {
  let h = 0x811c9dc5;
  for (let i = 0; i < name.length; i++) {
    h ^= name.charCodeAt(i);
    h = Math.imul(h, 0x01000193);
  }
  return h | 0;
}
