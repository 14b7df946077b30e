// What test/global-setup.ts shares with every test file through vitest's provide/inject.
import 'vitest';

declare module 'vitest' {
  export interface ProvidedContext {
    adminDatabaseUrl: string;
    temporalAddress: string;
    workflowBundlePath: string;
  }
}
