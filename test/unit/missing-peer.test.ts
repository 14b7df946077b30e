import { expect, it } from 'vitest';
import { missingPeerMessage } from '../../src/optional-peers.js';

it('says to install billing-outbox-worker when it is missing, and what left its peers out when it is there', () => {
  expect(missingPeerMessage('billing-outbox/worker', '@temporalio/client', false)).toBe(
    "billing-outbox/worker needs the package @temporalio/client, which is not installed: npm install billing-outbox-worker (it brings the dependencies of billing-outbox's worker, HTTP API and command)",
  );
  const installed = missingPeerMessage('this command', 'zod', true);
  // Not "npm install billing-outbox-worker" again: that is done, and would loop.
  expect(installed).not.toMatch(/: npm install billing-outbox-worker/);
  expect(installed).toMatch(/^this command needs the package zod, which is not installed although billing-outbox-worker is: its peer dependencies were left out \(npm's --legacy-peer-deps/);
  expect(installed).toContain('npm install zod');
});
