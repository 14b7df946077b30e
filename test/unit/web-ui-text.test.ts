/**
 * What the Temporal Web UI renders as Markdown from text of a tenant's making (its id, a usage id,
 * a meter name, Stripe's answers quoting them): shown as text, never a link, an image, emphasis or
 * a broken table, also when the summary's byte bound cuts it. Rendered with `marked` (CommonMark
 * and GitHub's tables and autolinks).
 */
import { marked } from 'marked';
import { describe, expect, it } from 'vitest';
import type { ReconcileRunResult } from '../../src/ops/reconcile.js';
import { usageSummary } from '../../src/temporal/start-usage.js';
import { reconcileDetails } from '../../workflows/reconcile.js';
import { codeSpan, markdownText } from '../../workflows/shared.js';

const LINK = /<a |<img|<strong>|<em>|<script/;
const html = (markdown: string) => marked.parse(markdown, { async: false });
const occurredAt = new Date('2026-12-03T10:00:00.000Z');

describe('markdownText and codeSpan', () => {
  it('leave plain words as they are', () => {
    expect(markdownText('api_requests')).toBe('api_requests');
    expect(markdownText('t-42')).toBe('t-42');
    expect(codeSpan('u:acme:1')).toBe('`u:acme:1`');
  });

  it('show links, images, emphasis, HTML and autolinks as text', () => {
    for (const value of ['[Pay](https://evil.example)', '![x](https://evil.example/x.png)', '**now**', '<img src=x>', 'www.evil.example', 'ops@evil.example', 'https://evil.example', 'x` [a](b) `', '``']) {
      expect(html(markdownText(value)), value).not.toMatch(LINK);
      expect(html(codeSpan(value)), value).not.toMatch(LINK);
    }
  });
});

describe('usageSummary', () => {
  it("shows a tenant id and a meter name of the tenant's making as text, however the bound cuts them", () => {
    const tenant = `[Pay here](https://evil.example)${'租'.repeat(90)}`;
    for (const eventName of ['api_requests', `**x**${'e'.repeat(95)}`]) {
      const summary = usageSummary({ idempotency_key: 'k', tenant_id: tenant, quantity: '3', event_name: eventName, occurred_at: occurredAt });
      expect(html(summary)).not.toMatch(LINK);
      expect(html(summary)).toContain('[Pay here](https://evil.example)');
    }
    expect(usageSummary({ idempotency_key: 'k', tenant_id: 'acme', quantity: '3', event_name: 'api_requests', occurred_at: occurredAt })).toBe('acme: 3 × api_requests at 2026-12-03T10:00:00.000Z');
  });
});

describe('reconcileDetails', () => {
  it("keeps a drifting pair's tenant ids, meter and Stripe's message in their cells, as text", () => {
    const result: ReconcileRunResult = {
      from: '2026-12-03T00:00:00.000Z',
      to: '2026-12-03T01:00:00.000Z',
      match: false,
      pairs: 1,
      windows: 1,
      matching: 0,
      differing: 1,
      ours: 5,
      stripe: 3,
      drift: { stripeMore: 0, stripeLess: 2 },
      stripeOnly: { windows: 0, quantity: 0 },
      unsettledRows: 0,
      drifting: [
        {
          stripeCustomerId: 'cus_1',
          tenantIds: ['a|b', '[Pay](https://evil.example)'],
          tenantsOmitted: 0,
          eventName: 'api_requests',
          ours: 5,
          stripe: 3,
          stripeMore: 0,
          stripeLess: 2,
          windows: ['2026-12-03T00:00:00.000Z'],
          problem: 'Stripe refused the summaries for customer cus_1: <b>no</b>',
        },
      ],
      driftingOmitted: 0,
      driftingCustomers: 1,
    };
    const rendered = html(reconcileDetails(result));
    expect(rendered).not.toMatch(/<a |<b>/);
    // One row of eight cells: the `|` in a tenant id did not make a ninth.
    const row = rendered.split('<tbody>')[1]!.split('</tr>')[0]!;
    expect(row.match(/<td/g)).toHaveLength(8);
    expect(row).toContain('a|b');
  });
});
