// A small tool-use agent on the Vercel AI SDK (`ai` with `@ai-sdk/anthropic`).
//
//   node agent.mjs [--json] [PROMPT...]
//
// @ai-sdk/anthropic reads ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY from the environment
// and posts to `${ANTHROPIC_BASE_URL}/messages`: its default base URL ends in /v1
// (https://api.anthropic.com/v1). Pointed at deja proxy's bare URL
// (http://127.0.0.1:8787) it posts to /messages, which the proxy takes as /v1/messages.
// DEJA_RUN, when set, is sent as the `x-deja-run` header on every request.
//
//   --json  use generateText (one JSON response per step) instead of streamText (SSE)
//
// The SDK runs the tool loop itself (stopWhen: up to MAX_STEPS model calls). Prints the
// final text on stdout. On an API or connection error it prints `error: <status>
// <message>` on stderr (status is `connection` when no response came) and exits 2.

import { anthropic } from '@ai-sdk/anthropic';
import { APICallError, generateText, jsonSchema, stepCountIs, streamText, tool } from 'ai';

const MODEL = 'claude-sonnet-4-6';
const MAX_STEPS = 10;
const DEFAULT_PROMPT = "What's the weather in Paris, in Fahrenheit?";

// -- tools: deterministic and local (the same two as examples/node-agent) ---------------

const WEATHER = {
  paris: { celsius: 18, sky: 'light rain' },
  oslo: { celsius: -3, sky: 'snow' },
  cairo: { celsius: 31, sky: 'sunny' },
};

const tools = {
  get_weather: tool({
    description: 'The current weather in a city, with the temperature in Celsius.',
    inputSchema: jsonSchema({
      type: 'object',
      properties: { city: { type: 'string', description: 'City name, e.g. Paris' } },
      required: ['city'],
    }),
    execute: async ({ city }) => {
      const known = WEATHER[String(city).toLowerCase()] ?? { celsius: 21, sky: 'sunny' };
      return `${city}: ${known.celsius}°C, ${known.sky}`;
    },
  }),
  convert: tool({
    description: 'Convert a temperature from Celsius to Fahrenheit.',
    inputSchema: jsonSchema({
      type: 'object',
      properties: { celsius: { type: 'number' } },
      required: ['celsius'],
    }),
    execute: async ({ celsius }) => {
      const fahrenheit = (Number(celsius) * 9) / 5 + 32;
      return `${celsius}°C is ${fahrenheit.toFixed(1)}°F`;
    },
  }),
};

// -- command line ----------------------------------------------------------------------

function parseArgs(argv) {
  const opts = { json: false, prompt: [] };
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    if (arg === '--json') opts.json = true;
    else if (arg === '--') {
      opts.prompt.push(...argv.slice(i + 1));
      break;
    } else if (arg.startsWith('--')) usage(`unknown option ${arg}`);
    else opts.prompt.push(arg);
  }
  return { ...opts, prompt: opts.prompt.join(' ') || DEFAULT_PROMPT };
}

function usage(problem) {
  process.stderr.write(`agent.mjs: ${problem}\nusage: node agent.mjs [--json] [PROMPT...]\n`);
  process.exit(64);
}

// -- the agent -------------------------------------------------------------------------

async function runAgent(prompt, json) {
  const params = {
    model: anthropic(MODEL),
    maxOutputTokens: 1024,
    tools,
    stopWhen: stepCountIs(MAX_STEPS),
    maxRetries: 0, // a replay's refusal is final: report it at once
    prompt,
    ...(process.env.DEJA_RUN && { headers: { 'x-deja-run': process.env.DEJA_RUN } }),
  };
  if (json) return (await generateText(params)).text;
  let failure = null;
  const result = streamText({ ...params, onError: ({ error }) => { failure = error; } });
  let text;
  try {
    text = await result.text;
  } catch (err) {
    throw failure ?? err; // the stream's own error, not the SDK's "no output generated"
  }
  if (failure) throw failure;
  return text;
}

function describe(err) {
  const cause = err?.lastError ?? err; // a RetryError wraps the attempts' errors
  if (APICallError.isInstance(cause)) {
    const status = cause.statusCode ?? 'connection';
    let message = cause.message;
    try {
      message = JSON.parse(cause.responseBody).error.message;
    } catch {} // no JSON error body: the SDK's own message
    return `error: ${status} ${message}`;
  }
  return null;
}

async function main() {
  const opts = parseArgs(process.argv.slice(2));
  try {
    process.stdout.write((await runAgent(opts.prompt, opts.json)) + '\n');
  } catch (err) {
    const said = describe(err);
    if (said === null) throw err;
    process.stderr.write(said + '\n');
    process.exitCode = 2;
  }
}

await main();
