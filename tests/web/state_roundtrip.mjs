// gradbuilder-train.mjs's state API with onnxruntime-node, on artifacts with data.safetensors:
// two steps, saveState, a second Trainer loadState's it, both take a third step (equal losses);
// a state of another shape is refused; evalStep's outputs are written for Python to compare.
//
//   node tests/web/state_roundtrip.mjs DIR OUT.json
import { readFile, writeFile } from "node:fs/promises";
import { join } from "node:path";
import * as ort from "onnxruntime-node";
import { Trainer, parseSafetensors, toSafetensors } from "../../gradbuilder/web/gradbuilder-train.mjs";

const [dir, out] = process.argv.slice(2);
const data = parseSafetensors(new Uint8Array(await readFile(join(dir, "data.safetensors"))));
const rows = (t, start, n) => {
  const per = t.dims.slice(1).reduce((a, b) => a * b, 1);
  return new ort.Tensor(t.dtype, t.data.slice(start * per, (start + n) * per), [n, ...t.dims.slice(1)]);
};
const batch = (i) => Object.fromEntries(Object.entries(data).map(([k, t]) => [k, rows(t, 8 * i, 8)]));

const a = await Trainer.create(ort, dir);
await a.trainStep(batch(0));
await a.trainStep(batch(1));
const saved = await a.saveState();
const b = await Trainer.create(ort, dir);
b.loadState(saved);
const [la, lb] = [(await a.trainStep(batch(2))).loss, (await b.trainStep(batch(2))).loss];

const state = parseSafetensors(saved);
const first = a.manifest.state[0].input;
state[first] = { ...state[first], dims: [...state[first].dims, 1] };
let refused = "";
try {
  b.loadState(toSafetensors(state));
} catch (e) {
  refused = String(e.message);
}
const evaluated = await a.evalStep(batch(3));
await writeFile(out, JSON.stringify({
  losses: [la, lb], refused, step: a.step,
  eval: Object.fromEntries(Object.entries(evaluated).map(([k, t]) => [k, { dims: t.dims, data: Array.from(t.data) }])),
}));
await writeFile(join(dir, "after.safetensors"), await a.saveState());
