/** `billing-outbox migrate` (`npm run migrate`): apply pending migrations to DATABASE_URL. */
import { ConfigError } from '../../config.js';
import { migrate, redactUrl } from '../../db.js';
import { noPositionals, parse } from '../args.js';
import { EXIT_OK, writeJson, type CliContext } from '../context.js';

export const MIGRATE_HELP = `Usage: billing-outbox migrate [--json]

Applies the migrations not yet applied to DATABASE_URL (in the schema DATABASE_SCHEMA, default
billing_outbox, created if missing), each in its own transaction (or, for an
index built CONCURRENTLY, statement by statement), in order. Safe to run from several processes at
once, and while the application writes: they take turns, and the later ones find nothing to do.
Workers and the API also migrate when they start; run it on its own to upgrade before them.
--json prints {applied: [names]}.

Exit codes: 0 applied (or nothing to apply), 1 a migration failed, 2 a usage or configuration error.
`;

export async function migrateCommand(args: string[], ctx: CliContext): Promise<number> {
  const { values, positionals } = parse(args, { json: { type: 'boolean' } }, MIGRATE_HELP);
  if (values.help) {
    ctx.out.write(MIGRATE_HELP);
    return EXIT_OK;
  }
  noPositionals(positionals, MIGRATE_HELP);
  const url = ctx.config.databaseUrl;
  if (!url) throw new ConfigError(['DATABASE_URL: is not set: it names the PostgreSQL database to migrate (postgres://user:password@host:5432/db)']);
  const schema = ctx.config.databaseSchema;
  const applied = await migrate(url, { schema, onWait: (message) => ctx.err.write(`billing-outbox: ${message}\n`) });
  if (values.json) writeJson(ctx.out, { applied, schema });
  else ctx.out.write(applied.length ? `applied ${applied.join(', ')} to ${redactUrl(url)}, schema ${schema}\n` : `${redactUrl(url)}, schema ${schema}, is up to date\n`);
  return EXIT_OK;
}
