/** `billing-outbox customers`: which Stripe customer each tenant is billed as. */
import { MAX_TENANT_ID_LENGTH } from '../../outbox/validate.js';
import { listMappings, mapTenant, stripeCustomerProblem } from '../../ops/customers.js';
import { mappingProblem } from '../../outbox/customers.js';
import { createStripeClient, requireStripeKey } from '../../stripe/client.js';
import { noPositionals, parse } from '../args.js';
import { actorOf, EXIT_FAILED, EXIT_OK, CommandLineError, writeJson, type CliContext } from '../context.js';
import { formatTable } from '../format.js';
import { schemaFor } from '../../outbox/sql/schema.js';

export const CUSTOMERS_HELP = `Usage: billing-outbox customers set <tenant> <stripe_customer_id> [--by NAME] [--no-stripe-check] [--json]
       billing-outbox customers list [--json]

set    maps a tenant (1-${MAX_TENANT_ID_LENGTH} characters) to a Stripe customer id (cus_…), creating or
       replacing the mapping; recorded in operator_actions. Usage already queued is sent to the
       customer mapped when it is delivered. Stripe is asked first whether it has the customer
       (Stripe takes usage for an unknown one and refuses it later, reporting only a sample): no
       such customer, or a deleted one, and nothing is mapped (exit 1).
       --no-stripe-check maps it without asking (Stripe unreachable, a key that may not read customers)
       --json prints {tenantId, stripeCustomerId, previousStripeCustomerId, created, sharedWith}
list   every mapping; --json prints {customers: [{tenantId, stripeCustomerId, createdAt, updatedAt}]}
`;

export async function customersCommand(args: string[], ctx: CliContext): Promise<number> {
  const [sub, ...rest] = args;
  if (sub === undefined || sub === '--help' || sub === '-h' || sub === 'help') {
    if (sub === undefined) throw new CommandLineError('customers needs a subcommand: set or list', CUSTOMERS_HELP);
    ctx.out.write(CUSTOMERS_HELP);
    return EXIT_OK;
  }
  if (sub === 'set') return setCustomer(rest, ctx);
  if (sub === 'list') return listCustomers(rest, ctx);
  throw new CommandLineError(`unknown customers subcommand: ${sub}`, CUSTOMERS_HELP);
}

async function setCustomer(args: string[], ctx: CliContext): Promise<number> {
  const { values, positionals } = parse(args, { by: { type: 'string' }, json: { type: 'boolean' }, 'no-stripe-check': { type: 'boolean' } }, CUSTOMERS_HELP);
  if (values.help) {
    ctx.out.write(CUSTOMERS_HELP);
    return EXIT_OK;
  }
  if (positionals.length !== 2) throw new CommandLineError('customers set needs <tenant> <stripe_customer_id>', CUSTOMERS_HELP);
  const [tenant, customer] = positionals as [string, string];
  const problem = mappingProblem(tenant, customer);
  if (problem) throw new CommandLineError(problem, CUSTOMERS_HELP);
  const actor = actorOf(values.by, ctx, CUSTOMERS_HELP);
  if (values['no-stripe-check'] !== true) {
    requireStripeKey(ctx.config.stripe, '`customers set` (it asks Stripe whether the customer exists; --no-stripe-check maps without asking)');
    const refusal = await stripeCustomerProblem(createStripeClient(ctx.config.stripe), customer);
    if (refusal) {
      ctx.err.write(`billing-outbox: not mapped: ${refusal}\n`);
      return EXIT_FAILED;
    }
  }

  const result = await mapTenant(await ctx.db(), schemaFor(ctx.config.databaseSchema), tenant, customer, actor);
  const previous = result.previousStripeCustomerId;
  if (values.json) {
    writeJson(ctx.out, result);
  } else if (result.created) {
    ctx.out.write(`tenant ${tenant} is billed as ${customer}\n`);
  } else if (previous === customer) {
    ctx.out.write(`tenant ${tenant} was already billed as ${customer}\n`);
  } else {
    ctx.out.write(`tenant ${tenant} is now billed as ${customer} (was ${previous})\n`);
  }
  if (!values.json && result.sharedWith.length > 0) {
    ctx.err.write(`warning: ${customer} is also the Stripe customer of ${result.sharedWith.join(', ')}: their usage is billed together, and in v1 sent one call at a time, oldest first (one tenant's backlog delays the other's new events)\n`);
  }
  return EXIT_OK;
}

async function listCustomers(args: string[], ctx: CliContext): Promise<number> {
  const { values, positionals } = parse(args, { json: { type: 'boolean' } }, CUSTOMERS_HELP);
  if (values.help) {
    ctx.out.write(CUSTOMERS_HELP);
    return EXIT_OK;
  }
  noPositionals(positionals, CUSTOMERS_HELP);
  const customers = await listMappings(await ctx.db(), schemaFor(ctx.config.databaseSchema));
  if (values.json) {
    writeJson(ctx.out, { customers });
    return EXIT_OK;
  }
  if (customers.length === 0) {
    ctx.out.write('no customers mapped yet: billing-outbox customers set <tenant> <cus_…>\n');
    return EXIT_OK;
  }
  ctx.out.write(
    formatTable(
      [{ header: 'TENANT', max: 60 }, { header: 'STRIPE CUSTOMER' }, { header: 'UPDATED' }],
      customers.map((c) => [c.tenantId, c.stripeCustomerId, c.updatedAt]),
    ),
  );
  ctx.out.write(`${customers.length} customer${customers.length === 1 ? '' : 's'}\n`);
  return EXIT_OK;
}
