// An MCP client on the official TypeScript MCP SDK, over Streamable HTTP: it settles an
// order against a ledger server. It lists the server's tools, looks the order up, refunds
// what is still owed (with a progress callback), reads the refund policy, and ends its
// session. deja records it without a change to its code: point MCP_URL at `deja proxy
// --mcp SERVER_URL` (the proxy's /mcp) instead of at the server.
//
//   MCP_URL=http://127.0.0.1:8787/mcp node agent.mjs [--order A-1] [--dump FILE]
//
// --dump FILE writes every answer the SDK handed the agent, one JSON line each, so that
// a recording and its replay can be compared byte for byte. DEJA_RUN, when set, names
// the run (the proxy's x-deja-run header). Exit status: 0 done, 2 an MCP error.

import { writeFileSync } from "node:fs";
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";
import { LoggingMessageNotificationSchema } from "@modelcontextprotocol/sdk/types.js";

function option(name, fallback) {
  const at = process.argv.indexOf(name);
  return at >= 0 && at + 1 < process.argv.length ? process.argv[at + 1] : fallback;
}

const url = process.env.MCP_URL ?? "http://127.0.0.1:8787/mcp";
const order = option("--order", "A-1");
const dump = option("--dump", null);
const answers = [];

function seen(what, answer) {
  answers.push({ what, answer });
  return answer;
}

// What the ledger's lookup says, as numbers: "order A-1: 40.00 EUR paid, 0.00 EUR refunded".
function owed(text) {
  const found = /([\d.]+) EUR paid, ([\d.]+) EUR refunded/.exec(text);
  return found ? Math.round((Number(found[1]) - Number(found[2])) * 100) / 100 : 0;
}

async function settle(client) {
  const { tools } = seen("tools/list", await client.listTools());
  console.log(`tools: ${tools.map((tool) => tool.name).join(", ")}`);

  const looked = seen("lookup", await client.callTool({ name: "lookup", arguments: { order } }));
  const text = looked.content[0].text;
  console.log(`lookup: ${text}`);

  const amount = owed(text);
  if (amount > 0) {
    const onprogress = (p) => console.log(`progress: ${p.progress}/${p.total} ${p.message ?? ""}`);
    const refund = seen("refund", await client.callTool(
      { name: "refund", arguments: { order, amount } }, undefined, { onprogress }));
    console.log(`refund${refund.isError ? " refused" : ""}: ${refund.content[0].text}`);
  } else {
    console.log("nothing to refund");
  }

  const policy = seen("policy", await client.readResource({ uri: "ledger://policy" }));
  console.log(`policy: ${policy.contents[0].text}`);
}

const headers = process.env.DEJA_RUN ? { "x-deja-run": process.env.DEJA_RUN } : {};
const transport = new StreamableHTTPClientTransport(new URL(url), { requestInit: { headers } });
const client = new Client({ name: "deja-mcp-node-agent", version: "0.0.0" });
client.setNotificationHandler(LoggingMessageNotificationSchema, (note) => {
  console.log(`log: ${note.params.data}`);
});

let status = 0;
try {
  await client.connect(transport);
  await settle(client);
  await transport.terminateSession();
} catch (error) {
  console.error(`MCP error: ${error.message}`);
  status = 2;
} finally {
  await client.close();
}
if (dump) {
  writeFileSync(dump, answers.map((line) => JSON.stringify(line)).join("\n") + "\n");
}
process.exit(status);
