/**
 * The search attributes billing-outbox sets on its workflows (workflows/shared.ts) must exist in the
 * namespace, as Keyword. Without them Temporal refuses every usage start for good (each event dead
 * at once, `temporal_start_refused`) and fails every task of a workflow that updates one. A worker
 * checks when it starts and refuses to run, naming what is missing and how to create it. A server
 * that will not list them (an API key without that permission) is not a reason to stop: a warning.
 */
import type { OperatorService } from '@temporalio/client';
import type { Logger } from '../log.js';
import { SEARCH_ATTRIBUTES } from '../../workflows/shared.js';
import { grpcCode } from './start-usage.js';

/** temporal.api.enums.v1.IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD, as the server lists it. */
const KEYWORD = 2;
/** gRPC codes of a server that will not say: PERMISSION_DENIED, UNIMPLEMENTED. */
const WILL_NOT_SAY = new Set([7, 12]);

export async function checkSearchAttributes(connection: { operatorService: OperatorService }, namespace: string, log?: Pick<Logger, 'warn'>): Promise<void> {
  let custom: Record<string, number>;
  try {
    custom = (await connection.operatorService.listSearchAttributes({ namespace })).customAttributes ?? {};
  } catch (err) {
    const code = grpcCode(err);
    if (code === undefined || !WILL_NOT_SAY.has(code)) throw err;
    log?.warn({ namespace, error: String(err) }, `could not list the namespace's search attributes; make sure ${SEARCH_ATTRIBUTES.map((k) => k.name).join(', ')} exist as Keyword`);
    return;
  }
  const wrong = SEARCH_ATTRIBUTES.filter((k) => custom[k.name] !== KEYWORD);
  if (wrong.length === 0) return;
  const said = wrong.map((k) => (k.name in custom ? `${k.name} (not Keyword)` : k.name)).join(', ');
  const create = wrong.map((k) => `temporal operator search-attribute create --namespace ${namespace} --name ${k.name} --type Keyword`).join(' && ');
  throw new Error(
    `Temporal namespace "${namespace}" lacks the search attributes billing-outbox sets on its workflows: ${said}. ` +
      `Every usage workflow start would be refused. Create them once: ${create} ` +
      `(Temporal Cloud: tcld namespace search-attributes add, or the Cloud UI).`,
  );
}
