// The official `ollama` npm package against LMSP Tray's Ollama API (run by tests/test_ollama_js.py):
// OLLAMA_HOST is where, LMSP_TOKEN the paired token (the npm package sends OLLAMA_API_KEY to
// ollama.com only: a token for another host goes in `headers`). Prints what it got as JSON.
import { Ollama } from "ollama";

const ollama = new Ollama({
  host: process.env.OLLAMA_HOST,
  headers: { Authorization: `Bearer ${process.env.LMSP_TOKEN}` },
});
const model = process.env.MODEL;
const listed = await ollama.list();
const shown = await ollama.show({ model });
const parts = [];
for await (const part of await ollama.chat({ model, messages: [{ role: "user", content: "Count" }], stream: true })) {
  parts.push(part);
}
const made = await ollama.generate({ model, prompt: "Count", stream: false });
const running = await ollama.ps();
let missing = null;
try {
  await ollama.chat({ model: "nothing:7b", messages: [{ role: "user", content: "hi" }] });
} catch (error) {
  missing = { name: error.name, status: error.status_code, message: error.error };
}
console.log(JSON.stringify({
  models: listed.models.map((m) => m.model),
  capabilities: shown.capabilities,
  chat: parts.map((p) => p.message.content).join(""),
  last: parts[parts.length - 1],
  generate: made.response,
  running: running.models.map((m) => m.model),
  missing,
}));
