/** `billing-outbox import <file>`: record existing usage from a file, through the outbox (src/ops/import.ts). */
import { createReadStream } from 'node:fs';
import { stat } from 'node:fs/promises';
import { extname } from 'node:path';
import { createInterface } from 'node:readline';
import { DEFAULT_IMPORT_BATCH_SIZE, IMPORT_FORMATS, importUsage, MAX_IMPORT_BATCH_SIZE, type ImportFormat, type ImportSummary } from '../../ops/import.js';
import { intOption, parse } from '../args.js';
import { actorOf, CommandLineError, EXIT_FAILED, EXIT_OK, type CliContext } from '../context.js';
import { startOperatorAction, finishOperatorAction } from '../../outbox/sql/operator.js';
import { schemaFor } from '../../outbox/sql/schema.js';
import { scrub } from '../../log.js';
import { ProgressBar } from '../format.js';

export const IMPORT_HELP = `Usage: billing-outbox import <file> [--format csv|jsonl] [--dry-run] [--batch-size N] [--by NAME]

Records usage that exists elsewhere (a migration, a batch job's records) through the outbox, as
POST /v1/usage and recordUsage do: the same checks, the same keys, so importing a file again adds
nothing. Lines use the API's body fields: tenant_id, usage_id, quantity, event_name, occurred_at.
  jsonl  one JSON object a line
  csv    a header row naming those fields, then one usage a row ("quoted, fields" as in RFC 4180)
The format follows the extension (.csv; .jsonl, .ndjson) unless --format says. A missing
event_name is STRIPE_METER_EVENT_NAME's; a missing occurred_at is the import's time.

Each batch of N usages (default ${DEFAULT_IMPORT_BATCH_SIZE}) commits in its own transaction; an interrupted import
is finished by running it again. A line is refused, with its number and reason on stderr, when a
field is bad, its occurred_at is older than 35 days (unless it was recorded before) or more than 64
minutes ahead, its tenant
has no billing customer (customers set), or its usage_id was recorded with other values.
--dry-run runs each batch and rolls it back: the summary a run would give, nothing written (but a
usage that is twice in the file counts as to be recorded twice: no batch sees another's rows).

Prints a summary (recorded, already recorded, refused); a progress bar on stderr on a terminal.
Exit code 1 if any line was refused (the others are recorded all the same). An import (not a dry
run) is recorded in operator_actions with its file and counts, by --by NAME (default: the OS user).
`;

function formatOf(file: string, given: string | undefined): ImportFormat {
  if (given !== undefined) {
    if (!(IMPORT_FORMATS as readonly string[]).includes(given)) throw new CommandLineError(`--format must be ${IMPORT_FORMATS.join(' or ')}`, IMPORT_HELP);
    return given as ImportFormat;
  }
  const ext = extname(file).toLowerCase();
  if (ext === '.csv') return 'csv';
  if (ext === '.jsonl' || ext === '.ndjson') return 'jsonl';
  throw new CommandLineError(`cannot tell the format of ${JSON.stringify(file)} from its extension; pass --format csv or --format jsonl`, IMPORT_HELP);
}

const counts = (s: ImportSummary) => `${s.recorded} ${s.dryRun ? 'would be recorded' : 'recorded'}, ${s.alreadyRecorded} already recorded, ${s.refused} refused`;

export async function importCommand(args: string[], ctx: CliContext): Promise<number> {
  const { values, positionals } = parse(args, { format: { type: 'string' }, 'dry-run': { type: 'boolean' }, 'batch-size': { type: 'string' }, by: { type: 'string' } }, IMPORT_HELP);
  if (values.help) {
    ctx.out.write(IMPORT_HELP);
    return EXIT_OK;
  }
  if (positionals.length !== 1) throw new CommandLineError(positionals.length === 0 ? 'which file? billing-outbox import <file>' : `unexpected argument: ${positionals[1]}`, IMPORT_HELP);
  const file = positionals[0]!;
  const format = formatOf(file, values.format);
  const batchSize = intOption(values['batch-size'], 'batch-size', 1, MAX_IMPORT_BATCH_SIZE, DEFAULT_IMPORT_BATCH_SIZE, IMPORT_HELP);
  const actor = actorOf(values.by, ctx, IMPORT_HELP);
  const dryRun = values['dry-run'] === true;
  const size = (await stat(file)).size;
  const db = await ctx.db();
  const schema = schemaFor(ctx.config.databaseSchema);
  // What was done, in operator_actions: written before the first batch (`started`), so that an
  // import stopped half-way (Ctrl-C, a crash) leaves a row; completed with the counts, or how far it
  // got before it failed. (Before the file is opened: readline's lines from before its reader's
  // first iteration would be lost.)
  const audit = dryRun ? undefined : await startOperatorAction(db, schema, { actor, action: 'import', key: null, tenantId: null, forced: false, detail: `${file}: started` });

  // Read as consumed: readline pauses the file while a batch commits, so a file of any length
  // holds a batch in memory, never the file.
  const input = createReadStream(file);
  const lines = createInterface({ input, crlfDelay: Infinity });
  // The bar counts bytes: the number of lines is not known before the end.
  const bar = ctx.err.isTTY ? new ProgressBar(ctx.err, size) : undefined;
  const say = (line: string) => (bar ? bar.printAbove(line) : ctx.err.write(`${line}\n`));
  let progress: ImportSummary | undefined;
  const record = (outcome: string, detail: string) => (audit === undefined ? Promise.resolve() : finishOperatorAction(db, schema, audit, outcome, `${file}: ${detail}`));
  try {
    const summary = await importUsage(db, lines, {
      format,
      batchSize,
      dryRun,
      schema: ctx.config.databaseSchema,
      defaultEventName: ctx.config.stripe.meterEventName,
      ...(ctx.now ? { now: ctx.now } : {}),
      onRefusal: (r) => say(`line ${r.line}: ${r.code}: ${r.reason}`),
      onProgress: (s) => {
        progress = s;
        bar?.update(input.bytesRead, `${s.read} lines: ${counts(s)}`);
      },
    });
    await record(summary.refused > 0 ? 'partial' : 'recorded', `${summary.read} line(s); ${counts(summary)}`);
    bar?.finish(size, `${summary.read} lines: ${counts(summary)}`);
    ctx.out.write(`${summary.dryRun ? 'dry run, nothing written: ' : ''}${file}: ${summary.read} line(s); ${counts(summary)}\n`);
    return summary.refused > 0 ? EXIT_FAILED : EXIT_OK;
  } catch (err) {
    await record('failed', `${progress ? `${progress.read} line(s) read; ${counts(progress)}` : 'no batch committed'}; then: ${scrub((err as Error).message)}`).catch(() => undefined);
    throw err;
  } finally {
    lines.close();
    input.destroy();
  }
}
