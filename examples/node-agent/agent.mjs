// A small streaming tool-use agent on the official Anthropic TypeScript SDK.
//
//   node agent.mjs [--json] [--dump FILE] [PROMPT...]
//
// The SDK reads ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY from the environment.
// DEJA_RUN, when set, is sent as the `x-deja-run` header on every request.
//
//   --json       use client.messages.create (no streaming) instead of messages.stream
//   --dump FILE  append one JSON line per HTTP response the SDK received:
//                {"attempt", "retry_count", "status", "body_b64"} (plus "error" if the
//                body broke off), where body_b64 holds the body's bytes as fetch gave them
//
// Prints the final text on stdout. On an API or connection error it prints
// `error: <status> <message>` on stderr (status is `stream` for an error event in a
// stream, `connection` when no response came) and exits 2; with --dump it also prints
// `attempts: N`, the HTTP attempts of the failing call.

import { appendFileSync } from 'node:fs';
import Anthropic from '@anthropic-ai/sdk';

const MODEL = 'claude-sonnet-4-6';
const MAX_TURNS = 10;
const DEFAULT_PROMPT = "What's the weather in Paris, in Fahrenheit?";

// -- tools: deterministic and local ----------------------------------------------------

const WEATHER = {
  paris: { celsius: 18, sky: 'light rain' },
  oslo: { celsius: -3, sky: 'snow' },
  cairo: { celsius: 31, sky: 'sunny' },
};

const TOOLS = [
  {
    name: 'get_weather',
    description: 'The current weather in a city, with the temperature in Celsius.',
    input_schema: {
      type: 'object',
      properties: { city: { type: 'string', description: 'City name, e.g. Paris' } },
      required: ['city'],
    },
  },
  {
    name: 'convert',
    description: 'Convert a temperature from Celsius to Fahrenheit.',
    input_schema: {
      type: 'object',
      properties: { celsius: { type: 'number' } },
      required: ['celsius'],
    },
  },
];

function getWeather({ city }) {
  const known = WEATHER[String(city).toLowerCase()] ?? { celsius: 21, sky: 'sunny' };
  return `${city}: ${known.celsius}°C, ${known.sky}`;
}

function convert({ celsius }) {
  const fahrenheit = (Number(celsius) * 9) / 5 + 32;
  return `${celsius}°C is ${fahrenheit.toFixed(1)}°F`;
}

const HANDLERS = { get_weather: getWeather, convert };

function runTool(block) {
  const handler = HANDLERS[block.name];
  if (!handler) {
    return { type: 'tool_result', tool_use_id: block.id, content: `unknown tool ${block.name}`, is_error: true };
  }
  return { type: 'tool_result', tool_use_id: block.id, content: handler(block.input ?? {}) };
}

// -- command line ----------------------------------------------------------------------

function parseArgs(argv) {
  const opts = { json: false, dump: null, prompt: [] };
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    if (arg === '--json') opts.json = true;
    else if (arg === '--dump') {
      opts.dump = argv[++i];
      if (!opts.dump) usage('--dump needs a FILE');
    } else if (arg.startsWith('--dump=')) opts.dump = arg.slice('--dump='.length);
    else if (arg === '--') {
      opts.prompt.push(...argv.slice(i + 1));
      break;
    } else if (arg.startsWith('--')) usage(`unknown option ${arg}`);
    else opts.prompt.push(arg);
  }
  return { ...opts, prompt: opts.prompt.join(' ') || DEFAULT_PROMPT };
}

function usage(problem) {
  process.stderr.write(`agent.mjs: ${problem}\nusage: node agent.mjs [--json] [--dump FILE] [PROMPT...]\n`);
  process.exit(64);
}

// -- a fetch that keeps a copy of every response body ----------------------------------

function dumpingFetch(file, stats) {
  const pending = [];
  let attempt = 0;

  const record = (line) => appendFileSync(file, JSON.stringify(line) + '\n');

  async function fetchAndDump(url, init) {
    attempt += 1;
    const here = { attempt, retry_count: retryCount(init?.headers) };
    stats.callAttempts = here.retry_count === 0 ? 1 : stats.callAttempts + 1;
    let response;
    try {
      response = await fetch(url, init);
    } catch (err) {
      record({ ...here, status: null, body_b64: '', error: String(err?.cause ?? err) });
      throw err;
    }
    if (!response.body) {
      record({ ...here, status: response.status, body_b64: '' });
      return response;
    }
    // One branch goes back to the SDK; the other is read to its end here, even when the
    // SDK cancels its own branch (as it does for a response it is about to retry).
    const [forSdk, forDump] = response.body.tee();
    pending.push(readAll(forDump).then(({ bytes, error }) =>
      record({ ...here, status: response.status, body_b64: bytes.toString('base64'), ...(error && { error }) }),
    ));
    return new Response(forSdk, {
      status: response.status,
      statusText: response.statusText,
      headers: response.headers,
    });
  }

  fetchAndDump.flush = () => Promise.allSettled(pending);
  return fetchAndDump;
}

function retryCount(headers) {
  const value = new Headers(headers ?? {}).get('x-stainless-retry-count');
  return value === null ? null : Number(value);
}

async function readAll(stream) {
  const chunks = [];
  try {
    for await (const chunk of stream) chunks.push(Buffer.from(chunk));
    return { bytes: Buffer.concat(chunks) };
  } catch (err) {
    return { bytes: Buffer.concat(chunks), error: String(err?.cause ?? err) };
  }
}

// -- the agent loop --------------------------------------------------------------------

async function ask(client, messages, json) {
  const params = { model: MODEL, max_tokens: 1024, tools: TOOLS, messages };
  if (json) return client.messages.create(params);
  const stream = client.messages.stream(params);
  return stream.finalMessage();
}

async function runAgent(client, prompt, json) {
  const messages = [{ role: 'user', content: prompt }];
  for (let turn = 0; turn < MAX_TURNS; turn++) {
    const message = await ask(client, messages, json);
    messages.push({ role: 'assistant', content: message.content });
    if (message.stop_reason !== 'tool_use') {
      return message.content.filter((block) => block.type === 'text').map((block) => block.text).join('');
    }
    const results = message.content.filter((block) => block.type === 'tool_use').map(runTool);
    messages.push({ role: 'user', content: results });
  }
  throw new Error(`no final answer after ${MAX_TURNS} turns`);
}

function describe(err) {
  const status = err.status ?? (err instanceof Anthropic.APIConnectionError ? 'connection' : 'stream');
  const message = err.apiMessage ?? err.message;
  return `error: ${status} ${message}`;
}

async function main() {
  const opts = parseArgs(process.argv.slice(2));
  const stats = { callAttempts: 0 };
  const fetchAndDump = opts.dump ? dumpingFetch(opts.dump, stats) : null;
  const client = new Anthropic({
    ...(process.env.DEJA_RUN && { defaultHeaders: { 'x-deja-run': process.env.DEJA_RUN } }),
    ...(fetchAndDump && { fetch: fetchAndDump }),
  });

  let code = 0;
  try {
    const text = await runAgent(client, opts.prompt, opts.json);
    process.stdout.write(text + '\n');
  } catch (err) {
    if (!(err instanceof Anthropic.APIError)) throw err;
    process.stderr.write(describe(err) + '\n');
    if (opts.dump) process.stderr.write(`attempts: ${stats.callAttempts}\n`);
    code = 2;
  } finally {
    await fetchAndDump?.flush();
  }
  process.exitCode = code;
}

await main();
