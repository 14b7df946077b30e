/**
 * Bulk import: usage that already exists elsewhere (a migration from another billing path, a day of
 * a batch job's records) recorded through the same outbox as recordUsage, with the same validation
 * and the same keys, so importing a file twice adds nothing the second time.
 *
 * - Lines are text in the HTTP API's body fields (tenant_id, usage_id, quantity, event_name,
 *   occurred_at): one JSON object a line (jsonl), or CSV with those names in a header row.
 * - Records (objects rather than text) are recordUsage's own input (UsageInput).
 * - The source is read as it is consumed, `batchSize` usages at a time, each batch in a transaction
 *   of its own: memory stays bounded whatever the source's length, and a crash loses at most the
 *   batch in flight, which a re-run then records.
 * - A line that cannot be recorded is refused with its reason and the rest goes on; the import only
 *   throws for what makes the whole source unreadable (a CSV header it does not understand) or a
 *   database error (the batches committed before it stay committed).
 */
import type pg from 'pg';
import { JsonTextError, parseJsonText } from '../api/strict-json.js';
import type { UsageRequestBody } from '../api/usage.js';
import { DEFAULT_EVENT_NAME, differences, prunedUsageError, sameUsage, toEntry, type RecordUsageOptions } from '../outbox/enqueue.js';
import { InvalidUsageError, UnknownTenantError, UsageConflictError, UsageError } from '../outbox/errors.js';
import { withoutPreparedStatements } from '../outbox/adapters/unprepared.js';
import { idempotencyKeyFor } from '../outbox/keys.js';
import { findRecordedUsages } from '../outbox/sql/enqueue.js';
import { findEntriesByKeys, insertUsages, type ImportedUsage } from '../outbox/sql/import.js';
import { schemaFor, type Schema } from '../outbox/sql/schema.js';
import { DATE_TIME_PROBLEM, parseDateTime, tooOldProblem, validateUsage, type UsageInput } from '../outbox/validate.js';

export const IMPORT_FORMATS = ['jsonl', 'csv'] as const;
export type ImportFormat = (typeof IMPORT_FORMATS)[number];

/** Usages per transaction unless `batchSize` says otherwise (docs/performance.md measured it). */
export const DEFAULT_IMPORT_BATCH_SIZE = 1_000;
export const MAX_IMPORT_BATCH_SIZE = 10_000;
/** Refusals kept in the summary; every one goes to `onRefusal`. */
export const MAX_KEPT_REFUSALS = 100;

/** Why a line was not recorded. */
export interface ImportRefusal {
  /** The line's number in the source (1 is the first line, a CSV header included); for records, their position. */
  line: number;
  /** A UsageError code (`invalid_usage`, `unknown_tenant`, `usage_conflict`), or `malformed_line`. */
  code: string;
  /** The field at fault, named as in the source (tenant_id in a file, tenantId in a record). */
  field?: string | undefined;
  /** What is wrong, for a person. */
  reason: string;
}

export interface ImportSummary {
  /** Lines (or records) read, blank lines and a CSV header not counted. */
  read: number;
  /** Usages recorded by this import (in a dry run: that would be). */
  recorded: number;
  /** Usages already recorded with the same values: nothing added for them. */
  alreadyRecorded: number;
  refused: number;
  /** The first MAX_KEPT_REFUSALS refusals. */
  refusals: ImportRefusal[];
  dryRun: boolean;
}

export interface ImportUsageOptions extends RecordUsageOptions {
  /** How text lines are written (default jsonl). Records need none. */
  format?: ImportFormat | undefined;
  /** Usages per transaction (default DEFAULT_IMPORT_BATCH_SIZE). */
  batchSize?: number | undefined;
  /**
   * Run every batch's statements and roll them back: the summary is what an import would do now,
   * and nothing is committed (the outbox's id sequence still advances, as after any rollback). One
   * difference: a usage twice in the source counts as recorded twice, since no batch sees another's
   * rolled-back rows (one transaction for the whole dry run would, but would hold the application's
   * writes of those usage ids waiting until it ends).
   */
  dryRun?: boolean | undefined;
  /** Each refusal, as soon as it is known. */
  onRefusal?: ((refusal: ImportRefusal) => void) | undefined;
  /** After each batch, with the counts so far. */
  onProgress?: ((summary: ImportSummary) => void) | undefined;
  /** Milliseconds since the epoch, for the 35-day and 5-minute checks (default Date.now). */
  now?: (() => number) | undefined;
  /**
   * False behind a transaction pooler that cannot keep named prepared statements (PgBouncer before
   * 1.21, or `max_prepared_statements = 0`): each statement goes unnamed (withoutPreparedStatements).
   */
  preparedStatements?: boolean | undefined;
}

/** The body's field names, and recordUsage's for each: typed so that a field added to the API's body is a compile error here until mapped. */
const BODY_FIELDS: { readonly [K in keyof Required<UsageRequestBody>]: keyof UsageInput } = {
  tenant_id: 'tenantId',
  usage_id: 'usageId',
  quantity: 'quantity',
  event_name: 'eventName',
  occurred_at: 'occurredAt',
};
const REQUIRED_FIELDS = ['tenant_id', 'usage_id', 'quantity'] as const;
const FIELD_IN_BODY = Object.fromEntries(Object.entries(BODY_FIELDS).map(([body, input]) => [input, body])) as Record<string, string>;

/** A line that is not a usage at all (not JSON, a CSV row with a stray quote): refused with its reason. */
class MalformedLine extends Error {}

/** A field of a line that is present but cannot be one of recordUsage's values. */
function fieldRefusal(field: string, reason: string): never {
  throw new InvalidUsageError(field, reason);
}

function dateTime(value: unknown): Date {
  const date = typeof value === 'string' ? parseDateTime(value) : undefined;
  return date ?? fieldRefusal('occurred_at', DATE_TIME_PROBLEM);
}

/** A line's fields (as the API's body) as recordUsage's input; field problems refused as the API refuses them. */
function bodyToInput(body: Record<string, unknown>): UsageInput {
  // A name of anything but visible ASCII is named as JSON text: it may hold control characters (an
  // escape sequence that rewrites the operator's terminal), and the refusal is printed there.
  for (const field of Object.keys(body)) {
    if (!Object.hasOwn(BODY_FIELDS, field)) fieldRefusal(/^[\x21-\x7e]+$/.test(field) ? field : JSON.stringify(field), 'is not a known field');
  }
  for (const field of REQUIRED_FIELDS) if (body[field] === undefined) fieldRefusal(field, 'is required');
  // Types are not coerced, as in the API: a quoted "5" in JSON is not a quantity.
  if (typeof body.quantity !== 'number' || !Number.isInteger(body.quantity)) fieldRefusal('quantity', 'must be an integer');
  return {
    tenantId: body.tenant_id as string,
    usageId: body.usage_id as string,
    quantity: body.quantity,
    eventName: body.event_name as string | undefined,
    occurredAt: body.occurred_at === undefined ? undefined : dateTime(body.occurred_at),
  };
}

function jsonLine(line: string): UsageInput {
  let body: unknown;
  try {
    // The API's own reading of JSON text: a number not as written (1.0, 1e3) or a key twice is refused.
    body = parseJsonText(line, 'the line');
  } catch (err) {
    if (err instanceof JsonTextError) throw new MalformedLine(err.message);
    throw err;
  }
  if (typeof body !== 'object' || body === null || Array.isArray(body)) throw new MalformedLine('not a JSON object');
  return bodyToInput(body as Record<string, unknown>);
}

/**
 * One CSV row (RFC 4180): fields separated by commas, a field in double quotes may hold commas and
 * doubled quotes (""). A quoted line break is not supported: no field may hold one (validate.ts
 * refuses control characters), so such a row is refused as malformed rather than joined.
 */
export function csvFields(line: string): string[] {
  const fields: string[] = [];
  let i = 0;
  for (;;) {
    if (line[i] === '"') {
      let value = '';
      i++;
      for (;;) {
        const close = line.indexOf('"', i);
        if (close === -1) throw new MalformedLine('a quoted field is not closed on its line');
        value += line.slice(i, close);
        i = close + 1;
        if (line[i] !== '"') break;
        value += '"';
        i++;
      }
      if (i < line.length && line[i] !== ',') throw new MalformedLine(`a closing quote must end its field (column ${fields.length + 1})`);
      fields.push(value);
    } else {
      const comma = line.indexOf(',', i);
      const value = line.slice(i, comma === -1 ? line.length : comma);
      if (value.includes('"')) throw new MalformedLine(`a quote inside an unquoted field (column ${fields.length + 1}); quote the field and double its quotes`);
      fields.push(value);
      i = comma === -1 ? line.length : comma;
    }
    if (i >= line.length) return fields;
    i++; // the comma
  }
}

function csvHeader(line: string): string[] {
  let names: string[];
  try {
    names = csvFields(line);
  } catch (err) {
    throw new UsageError('invalid_header', `the CSV header row is malformed: ${(err as Error).message}`);
  }
  const seen = new Set<string>();
  for (const name of names) {
    if (!Object.hasOwn(BODY_FIELDS, name)) {
      throw new UsageError('invalid_header', `the CSV header names ${JSON.stringify(name)}; its columns are the API's fields: ${Object.keys(BODY_FIELDS).join(', ')}`);
    }
    if (seen.has(name)) throw new UsageError('invalid_header', `the CSV header names ${name} twice`);
    seen.add(name);
  }
  for (const name of REQUIRED_FIELDS) if (!seen.has(name)) throw new UsageError('invalid_header', `the CSV header has no ${name} column`);
  return names;
}

function csvLine(header: readonly string[], line: string): UsageInput {
  const values = csvFields(line);
  if (values.length !== header.length) throw new MalformedLine(`${values.length} fields where the header has ${header.length}`);
  const body: Record<string, unknown> = {};
  header.forEach((name, i) => {
    const value = values[i]!;
    // An empty cell is an absent field: a default event name, the import's time.
    if (value === '') return;
    if (name === 'quantity') {
      if (!/^\d+$/.test(value)) fieldRefusal('quantity', 'must be an integer');
      body[name] = Number(value);
    } else body[name] = value;
  });
  return bodyToInput(body);
}

interface Pending {
  line: number;
  usage: ImportedUsage;
  /** A line of text (its fields named as in the API's body) rather than a record. */
  fromText: boolean;
  /**
   * Why Stripe would no longer take it (tooOldProblem): then it is only looked up, and counts as
   * already recorded if it is there (a re-run of an import that ended part-way), else is refused.
   */
  tooOld: string | undefined;
}

function refusalOf(err: unknown, line: number, fromText: boolean): ImportRefusal {
  if (err instanceof MalformedLine) return { line, code: 'malformed_line', reason: err.message };
  if (err instanceof InvalidUsageError) {
    const field = fromText ? (FIELD_IN_BODY[err.field ?? ''] ?? err.field) : err.field;
    return { line, code: err.code, field, reason: `${field}: ${err.reason}` };
  }
  if (err instanceof UsageError) return { line, code: err.code, field: fromText ? (FIELD_IN_BODY[err.field ?? ''] ?? err.field) : err.field, reason: err.message };
  throw err;
}

/**
 * Records every usage of `source` through the outbox, `batchSize` at a time, each batch in its own
 * transaction on `pool`; returns what happened. See the module's comment for the guarantees.
 *
 *   const lines = readline.createInterface({ input: fs.createReadStream('usage.jsonl'), crlfDelay: Infinity });
 *   const summary = await importUsage(pool, lines, { onRefusal: (r) => console.error(`line ${r.line}: ${r.reason}`) });
 */
export async function importUsage(
  pool: pg.Pool,
  source: AsyncIterable<string | UsageInput> | Iterable<string | UsageInput>,
  options: ImportUsageOptions = {},
): Promise<ImportSummary> {
  const schema = schemaFor(options.schema);
  const defaultEventName = options.defaultEventName ?? DEFAULT_EVENT_NAME;
  const batchSize = options.batchSize ?? DEFAULT_IMPORT_BATCH_SIZE;
  if (!Number.isInteger(batchSize) || batchSize < 1 || batchSize > MAX_IMPORT_BATCH_SIZE) {
    throw new RangeError(`batchSize must be a whole number from 1 to ${MAX_IMPORT_BATCH_SIZE}`);
  }
  const format = options.format ?? 'jsonl';
  if (!IMPORT_FORMATS.includes(format)) throw new RangeError(`format must be one of ${IMPORT_FORMATS.join(', ')}`);
  const now = options.now ?? Date.now;
  const summary: ImportSummary = { read: 0, recorded: 0, alreadyRecorded: 0, refused: 0, refusals: [], dryRun: options.dryRun === true };
  const refuse = (refusal: ImportRefusal) => {
    summary.refused++;
    if (summary.refusals.length < MAX_KEPT_REFUSALS) summary.refusals.push(refusal);
    options.onRefusal?.(refusal);
  };

  // Refused lines wait in the batch with the others, so that refusals come out in the source's order.
  let batch: (Pending | ImportRefusal)[] = [];
  let keys = new Set<string>();
  const flush = async () => {
    if (batch.length === 0) return;
    const usages = batch.filter((slot): slot is Pending => 'usage' in slot);
    const outcomes = usages.length === 0 ? [] : await recordBatch(pool, schema, usages, { dryRun: summary.dryRun, preparedStatements: options.preparedStatements !== false });
    let next = 0;
    for (const slot of batch) {
      if (!('usage' in slot)) {
        refuse(slot);
        continue;
      }
      const outcome = outcomes[next++]!;
      if (outcome === 'recorded') summary.recorded++;
      else if (outcome === 'already') summary.alreadyRecorded++;
      else refuse(refusalOf(outcome, slot.line, slot.fromText));
    }
    batch = [];
    keys = new Set();
    options.onProgress?.(summary);
  };

  let lineNumber = 0;
  let header: string[] | undefined;
  for await (const item of source) {
    lineNumber++;
    const fromText = typeof item === 'string';
    // A UTF-8 byte order mark (spreadsheets write one) is not part of the first field, nor a CR
    // (a file written on Windows, read line by line) of the last. Nothing else is trimmed: a space
    // around an id is refused, as the API refuses it, rather than quietly repaired.
    const text = fromText ? (lineNumber === 1 ? item.replace(/^\uFEFF/, '') : item).replace(/\r$/, '') : '';
    if (fromText && text.trim() === '') continue;
    if (fromText && format === 'csv' && header === undefined) {
      header = csvHeader(text);
      continue;
    }
    summary.read++;
    let slot: Pending | ImportRefusal;
    try {
      const input = !fromText ? item : format === 'csv' ? csvLine(header!, text) : jsonLine(text);
      const usage = validateUsage(input, defaultEventName, now());
      const key = idempotencyKeyFor(usage.tenantId, usage.usageId);
      slot = { line: lineNumber, usage: { ...usage, key }, fromText, tooOld: tooOldProblem(usage.occurredAt, now()) };
    } catch (err) {
      slot = refusalOf(err, lineNumber, fromText);
    }
    if ('usage' in slot) {
      // A usage twice in one batch: the first one's batch commits first, so the second is compared with it.
      if (keys.has(slot.usage.key)) await flush();
      keys.add(slot.usage.key);
    }
    batch.push(slot);
    if (batch.length >= batchSize) await flush();
  }
  await flush();
  return summary;
}

/** A usage's (tenant, usage id), as one string: what tells usages apart. */
const usageRef = (u: { tenantId: string; usageId: string }) => JSON.stringify([u.tenantId, u.usageId]);

/** One batch in one transaction: what became of each usage ('recorded', 'already', or why it was refused). */
async function recordBatch(
  pool: pg.Pool,
  schema: Schema,
  batch: readonly Pending[],
  opts: { dryRun: boolean; preparedStatements: boolean },
): Promise<('recorded' | 'already' | UsageError)[]> {
  const pooled = await pool.connect();
  try {
    const client = opts.preparedStatements ? pooled : withoutPreparedStatements(pooled);
    await pooled.query('BEGIN');
    const sendable = batch.filter((p) => p.tooOld === undefined);
    const inserted = new Map(
      (sendable.length === 0 ? [] : await insertUsages(client, schema, sendable.map((p) => p.usage))).map((outcome, i) => [sendable[i]!, outcome]),
    );
    const existing = batch.filter((p) => inserted.get(p)?.inserted !== true && inserted.get(p)?.tenantKnown !== false).map((p) => p.usage);
    const found = new Map((existing.length === 0 ? [] : await findEntriesByKeys(client, schema, existing)).map((row) => [row.key, row]));
    // No outbox row: delivered and pruned (OUTBOX_RETENTION_DAYS), known by its usage row alone.
    const gone = existing.filter((u) => !found.has(u.key));
    const recorded = new Map((gone.length === 0 ? [] : await findRecordedUsages(client, schema, gone)).map((u) => [usageRef(u), u]));
    await pooled.query(opts.dryRun ? 'ROLLBACK' : 'COMMIT');
    return batch.map((p) => {
      const outcome = inserted.get(p);
      if (outcome?.tenantKnown === false) return new UnknownTenantError(p.usage.tenantId);
      if (outcome?.inserted) return 'recorded';
      const row = found.get(p.usage.key);
      // The same answers as recordUsage gives for the same usage, but one: a line recorded before
      // with the same values counts as already recorded even once its outbox entry is pruned (a
      // file imported again adds nothing and refuses nothing), where recordUsage cannot return
      // the entry and says so.
      if (!row) {
        const before = recorded.get(usageRef(p.usage));
        if (!before && p.tooOld !== undefined) return new InvalidUsageError('occurredAt', p.tooOld);
        return before && differences(before, p.usage).length === 0 ? 'already' : prunedUsageError(p.usage, before);
      }
      const entry = toEntry(row);
      return sameUsage(entry, p.usage) ? 'already' : new UsageConflictError(p.usage.usageId, entry, differences(entry, p.usage));
    });
  } catch (err) {
    await pooled.query('ROLLBACK').catch(() => undefined);
    throw err;
  } finally {
    pooled.release();
  }
}
