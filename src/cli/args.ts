/**
 * Command-line parsing on `node:util` parseArgs: its errors (unknown option, missing value) become
 * usage errors carrying the command's help text.
 */
import { parseArgs, type ParseArgsConfig } from 'node:util';
import { CommandLineError } from './context.js';

type Options = NonNullable<ParseArgsConfig['options']>;

// Spelled out: the declaration emit cannot name the parseArgs types that the inferred type uses.
type Parsed<O extends Options> = ReturnType<typeof parseArgs<{ args: string[]; options: O & { help: { type: 'boolean'; short: 'h' } }; allowPositionals: true; strict: true }>>;

export function parse<O extends Options>(args: string[], options: O, help: string): Parsed<O> {
  try {
    return parseArgs({ args, options: { ...options, help: { type: 'boolean', short: 'h' } }, allowPositionals: true, strict: true });
  } catch (err) {
    throw new CommandLineError((err as Error).message, help);
  }
}

/** A whole number option within [min, max]; `fallback` when absent. */
export function intOption(value: string | undefined, name: string, min: number, max: number, fallback: number, help: string): number {
  if (value === undefined) return fallback;
  if (!/^\d+$/.test(value) || Number(value) < min || Number(value) > max) {
    throw new CommandLineError(`--${name} must be a whole number from ${min} to ${max}`, help);
  }
  return Number(value);
}

export function noPositionals(positionals: string[], help: string): void {
  if (positionals.length > 0) throw new CommandLineError(`unexpected argument: ${positionals[0]}`, help);
}
